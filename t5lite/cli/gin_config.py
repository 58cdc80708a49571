"""Gin at the edge: the configurables gin files may bind, and parsing with clear errors.

Only entry points read gin; everything underneath takes plain dataclasses. Model files
(gin/models/...) define the macro MODEL_CONFIG = @ModelConfig() and bind its fields.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import pathlib
import re
import tokenize
import types
import typing

import gin

from t5lite.util.checks import check_feature_lengths, require_int
from t5lite.errors import ConfigError
from t5lite.eval.evaluator import DecodeConfig
from t5lite.eval.run import EvalConfig, InferConfig
from t5lite.families.distillation import DistillationConfig
from t5lite.families.peft import PeftConfig
from t5lite.models.adapters import AdapterConfig
from t5lite.models.electra_config import ElectraConfig
from t5lite.models.moe.config import MoeConfig
from t5lite.models.span_boundary_config import SpanBoundaryConfig
from t5lite.models.config import ModelConfig
from t5lite.models.config_legacy import MOVED_FIELDS
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.runtime.wandb_sink import WandbConfig
from t5lite.runtime.partitioning import MeshConfig
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.step import StepConfig
from t5lite.train.train_config import TrainConfig



def _gin_dir() -> pathlib.Path:
  """The shipped configs: `t5lite/gin/` in an installed package (setup.py copies the
  repository's top-level gin/ there), else the checkout's gin/ beside the package (source
  trees and editable installs). The package's own folder is looked at first: in an installed
  tree, the folder beside the package is site-packages/gin, the gin-config library."""
  package = pathlib.Path(__file__).resolve().parents[1]
  installed = package / "gin"
  return installed if (installed / "runs").is_dir() else package.parent / "gin"


GIN_DIR = _gin_dir()

# Registered by name (e.g. `ModelConfig`, or `t5lite.ModelConfig`); the classes stay gin-free.
CONFIGURABLES = (ModelConfig, TrainConfig, OptimizerConfig, ScheduleConfig, StepConfig,
                 MeshConfig, CheckpointConfig, DecodeConfig, EvalConfig, InferConfig,
                 DistillationConfig, PeftConfig, AdapterConfig, MoeConfig, ElectraConfig,
                 SpanBoundaryConfig, WandbConfig)
for _cls in CONFIGURABLES:
  gin.external_configurable(_cls, name=_cls.__name__, module="t5lite")


class GinConfigError(ConfigError):
  """A gin file or binding that cannot be used; the message names the file/flag and line."""


def shipped_gin_files() -> list[str]:
  """Every .gin file under the repo's gin/ folder, as paths relative to the repo root."""
  root = GIN_DIR.parent
  return sorted(str(p.relative_to(root)) for p in GIN_DIR.rglob("*.gin"))


def resolve_gin_file(path: str) -> str:
  """A gin file as given, or relative to the repo root or gin/, as an absolute path (gin reads
  an absolute path directly); else an error with near names."""
  for candidate in (pathlib.Path(path), GIN_DIR.parent / path, GIN_DIR / path):
    if candidate.is_file():
      return str(candidate.resolve())
  near = difflib.get_close_matches(path, shipped_gin_files(), n=3, cutoff=0.5)
  hint = f"; did you mean {', '.join(near)}?" if near else "; shipped files: gin/models/..., gin/runs/..."
  raise GinConfigError(f"gin file {path!r} not found{hint}")


def _search_repo_gin_first() -> None:
  """Makes `include 'runs/pretrain.gin'` find the repo's gin/ before anything else.

  gin tries each search path in order, the current folder first, and with each path asks its
  readers in turn; its package-resource reader takes 'runs/pretrain.gin' as package `runs`,
  and crashes (TypeError) when the current folder holds a plain folder of that name (say the
  demo's runs/ output, or a models/ folder), which Python sees as a namespace package. With
  the repo's gin/ tried first, shipped includes resolve before that reader is ever asked;
  other relative includes still resolve against the current folder next.
  """
  prefixes = getattr(gin.config, "_LOCATION_PREFIXES", None)
  repo = str(GIN_DIR)
  if isinstance(prefixes, list):  # gin-config's search path list (0.5.x)
    if repo in prefixes:
      prefixes.remove(repo)
    prefixes.insert(0, repo)
  else:
    gin.add_config_file_search_path(repo)


def _explain(error: Exception) -> str:
  """gin's message plus a 'did you mean' for a misspelled ModelConfig field."""
  if isinstance(error, tokenize.TokenError):  # e.g. an unclosed bracket: gin gives no line
    message, (line, _) = error.args
    return f"line {line}: {message} (an unclosed bracket or quote above it?)"
  message = str(error)
  match = re.search(r"Configurable '(\w+)' doesn't have a parameter named '(\w+)'", message)
  classes = {cls.__name__: cls for cls in CONFIGURABLES}
  if match and match.group(1) in classes:
    fields = list(classes[match.group(1)].__dataclass_fields__)
    near = difflib.get_close_matches(match.group(2), fields, n=3)
    if match.group(1) == "ModelConfig" and match.group(2) in MOVED_FIELDS:
      message += f"\n  It moved to a family's sub-config: {MOVED_FIELDS[match.group(2)]}"
    elif near:
      message += f"\n  Did you mean: {', '.join(near)}?"
  return message


def _parse_binding(binding: str) -> None:
  name, _, value = binding.partition("=")
  name, value = name.strip(), value.strip()
  try:
    gin.parse_config(f"{name} = {value}")
  except (SyntaxError, tokenize.TokenError):
    if value.startswith(("@", "%", "'", '"', "(", "[", "{")):
      raise
    # T5X users write --gin.MODEL_DIR=/tmp/x; take a bare non-literal as a string.
    gin.parse_config(f"{name} = {value!r}")


class _QuietMissingPaths(logging.Filter):
  """Drops gin's resource reader's 'Path not found' errors: gin tries an include under every
  search path (the current folder first) and logs each miss, even when a later one hits."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Path not found")


def parse(gin_files: list[str] = (), bindings: list[str] = (), *, clear: bool = True) -> None:
  """Parses gin files, then NAME=VALUE bindings (later ones win), raising GinConfigError."""
  if clear:
    gin.clear_config()
  _search_repo_gin_first()
  quiet = _QuietMissingPaths()
  logging.getLogger().addFilter(quiet)
  try:
    _parse(gin_files, bindings)
  finally:
    logging.getLogger().removeFilter(quiet)


def _parse(gin_files: list[str], bindings: list[str]) -> None:
  for path in gin_files:
    resolved = resolve_gin_file(path)
    try:
      gin.parse_config_file(resolved)
    except Exception as e:  # gin raises ValueError, SyntaxError, TokenError, ...
      raise GinConfigError(f"malformed gin file {resolved}: {_explain(e)}") from e
  for binding in bindings:
    if "=" not in binding:
      raise GinConfigError(f"gin binding {binding!r} is not NAME=VALUE")
    try:
      _parse_binding(binding)
    except Exception as e:
      raise GinConfigError(f"bad gin binding --gin.{binding}: {_explain(e)}") from e
  try:
    _check_bound_integers()
  except ConfigError as e:
    raise GinConfigError(str(e)) from None


def _int_fields(cls) -> dict[str, bool]:
  """{field: whether None is allowed} for a config class's `int` / `int | None` fields."""
  hints = typing.get_type_hints(cls)
  fields = {}
  for field in dataclasses.fields(cls):
    hint = hints.get(field.name)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = set(typing.get_args(hint)) if union else {hint}
    if options - {type(None)} == {int}:
      fields[field.name] = type(None) in options
  return fields


def _bound(selector: str):
  """(value, macro) of a binding such as 'TrainConfig.train_steps': macro is the NAME of the
  %NAME it was set through (None: set directly). ValueError when it is not bound."""
  value, macro = gin.query_parameter(selector), None
  while isinstance(value, gin.config.ConfigurableReference) and value.selector == "gin.macro":
    macro = value.scoped_selector.rpartition("/")[0]
    value = gin.query_parameter(f"%{macro}")
  return value, macro


def _check_bound_integers() -> None:
  """Integer settings bound to floats, bools or strings, and feature lengths past the
  ceiling, refused by the name the user wrote (TRAIN_STEPS, not TrainConfig.train_steps):
  TRAIN_STEPS=10.5 used to train to step 11, and BATCH_SIZE=2.5 to fail on the mesh."""
  for cls in CONFIGURABLES:
    names = {**_int_fields(cls), "task_feature_lengths": False}
    values = {}
    for field, optional in names.items():
      try:
        value, macro = _bound(f"{cls.__name__}.{field}")
      except ValueError:  # not bound: the dataclass default
        continue
      if isinstance(value, gin.config.ConfigurableReference):  # @x() or %gin.REQUIRED
        continue
      name = f"{macro} ({cls.__name__}.{field})" if macro else f"{cls.__name__}.{field}"
      if field == "task_feature_lengths":
        check_feature_lengths(value, macro or f"{cls.__name__}.{field}",
                              values.get("batch_size"))
      else:
        values[field] = require_int(value, name, optional=optional)


def model_config() -> ModelConfig:
  """The ModelConfig that the parsed gin files built as MODEL_CONFIG, with the run file's
  DROPOUT_RATE (T5X's macro) as its dropout rate when that is set (None: the model file's).

  This is the one place the macro applies: the config a run trains, saves in MODEL_DIR and
  later decodes with is the ModelConfig itself, never overridden further down."""
  config = _build("MODEL_CONFIG", ModelConfig,
                  "add a model file, e.g. --gin_file=gin/models/t5_1_1/small.gin")
  config = ModelConfig.from_dict(config.to_dict())
  dropout_rate = macro("DROPOUT_RATE")
  return config if dropout_rate is None else config.replace(dropout_rate=float(dropout_rate))


def _build(macro: str, cls, hint: str):
  """The object that the macro %`macro` evaluates to, built with its bindings."""
  try:
    reference = gin.query_parameter(f"%{macro}")
  except ValueError as e:
    raise GinConfigError(f"no {macro} is bound: {hint}") from e
  try:
    return copy.deepcopy(reference)  # evaluates @Configurable() with its bindings
  except (TypeError, ValueError) as e:
    missing = re.search(r"Required bindings for `(\w+)` not provided in config: \[(.*)\]",
                        str(e))
    if missing:
      raise GinConfigError(f"{cls.__name__} needs {missing.group(2)}: bind it, e.g. "
                           f"--gin.MODEL_DIR=/tmp/run (T5X macro names: MODEL_DIR, "
                           "MIXTURE_OR_TASK_NAME, TRAIN_STEPS, ...)") from e
    if isinstance(e, ConfigError):  # a config's own check: its message, less gin's
      # "In call to configurable ..." lines, so that it stays the one error line
      raise GinConfigError(re.split(r"\n\s*In call to configurable", str(e))[0]) from e
    raise GinConfigError(f"{macro} cannot be built: {e}") from e


def run_config(macro: str, cls, run_file: str, fill: dict | None = None):
  """The `cls` instance a run file (gin/runs/...) built as %macro, every required macro set
  (fill: values for fields whose macro is left %gin.REQUIRED, e.g. a placeholder MODEL_DIR
  for `t5lite compile`, which writes nothing there)."""
  config = _build(macro, cls, f"add a run file, e.g. --gin_file={run_file}")
  if not isinstance(config, cls):
    raise GinConfigError(f"{macro} must be @{cls.__name__}(), got {type(config).__name__}")
  # A macro set to %gin.REQUIRED reaches the dataclass as gin's REQUIRED marker; the field
  # names of the required ones are T5X's macro names in lower case.
  missing = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) is gin.REQUIRED]
  filled = {name: fill[name] for name in missing if name in (fill or {})}
  if filled:
    config = dataclasses.replace(config, **filled)
    missing = [name for name in missing if name not in filled]
  if missing:
    flags = " ".join(f"--gin.{name.upper()}=..." for name in missing)
    raise GinConfigError(f"the run file requires {', '.join(n.upper() for n in missing)}: "
                         f"add {flags}")
  return config


def train_config(fill: dict | None = None) -> TrainConfig:
  """The TrainConfig that the parsed run file (e.g. gin/runs/pretrain.gin) built."""
  return run_config("TRAIN_CONFIG", TrainConfig, "gin/runs/pretrain.gin", fill)


def macro(name: str, default=None):
  """The value of a gin macro, or `default` when the config does not bind it."""
  try:
    return gin.query_parameter(f"%{name}")
  except ValueError:
    return default


def split_gin_flags(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
  """Pulls --gin_file=F / --gin_file F and --gin.NAME=VALUE out of argv (T5X style).

  Returns (gin_files, bindings, remaining argv).
  """
  files, bindings, rest = [], [], []
  args = list(argv)
  while args:
    arg = args.pop(0)
    if arg == "--gin_file":
      if not args:
        raise GinConfigError("--gin_file needs a path")
      files.append(args.pop(0))
    elif arg.startswith("--gin_file="):
      files.append(arg.split("=", 1)[1])
    elif arg.startswith("--gin."):
      bindings.append(arg[len("--gin."):])
    else:
      rest.append(arg)
  return files, bindings, rest
