"""Gin at the edge: the configurables gin files may bind, and parsing with clear errors.

Only entry points read gin; everything underneath takes plain dataclasses. Model files
(gin/models/...) define the macro MODEL_CONFIG = @ModelConfig() and bind its fields.
"""
from __future__ import annotations

import copy
import difflib
import pathlib
import re
import tokenize

import gin

from t5lite.models.config import ModelConfig

REPO_GIN_DIR = pathlib.Path(__file__).resolve().parents[1] / "gin"

# Registered as `ModelConfig` (or `t5lite.ModelConfig`); the class itself stays gin-free.
gin.external_configurable(ModelConfig, name="ModelConfig", module="t5lite")


class GinConfigError(ValueError):
  """A gin file or binding that cannot be used; the message names the file/flag and line."""


def shipped_gin_files() -> list[str]:
  """Every .gin file under the repo's gin/ folder, as paths relative to the repo root."""
  root = REPO_GIN_DIR.parent
  return sorted(str(p.relative_to(root)) for p in REPO_GIN_DIR.rglob("*.gin"))


def resolve_gin_file(path: str) -> str:
  """A gin file as given, or relative to the repo root or gin/; else an error with near names."""
  for candidate in (pathlib.Path(path), REPO_GIN_DIR.parent / path, REPO_GIN_DIR / path):
    if candidate.is_file():
      return str(candidate)
  near = difflib.get_close_matches(path, shipped_gin_files(), n=3, cutoff=0.5)
  hint = f"; did you mean {', '.join(near)}?" if near else f"; shipped files: gin/models/..., gin/runs/..."
  raise GinConfigError(f"gin file {path!r} not found{hint}")


def _explain(error: Exception) -> str:
  """gin's message plus a 'did you mean' for a misspelled ModelConfig field."""
  if isinstance(error, tokenize.TokenError):  # e.g. an unclosed bracket: gin gives no line
    message, (line, _) = error.args
    return f"line {line}: {message} (an unclosed bracket or quote above it?)"
  message = str(error)
  match = re.search(r"Configurable 'ModelConfig' doesn't have a parameter named '(\w+)'", message)
  if match:
    fields = list(ModelConfig.__dataclass_fields__)
    near = difflib.get_close_matches(match.group(1), fields, n=3)
    if near:
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


def parse(gin_files: list[str] = (), bindings: list[str] = (), *, clear: bool = True) -> None:
  """Parses gin files, then NAME=VALUE bindings (later ones win), raising GinConfigError."""
  if clear:
    gin.clear_config()
  gin.add_config_file_search_path(str(REPO_GIN_DIR))
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


def model_config() -> ModelConfig:
  """The ModelConfig that the parsed gin files built as MODEL_CONFIG."""
  try:
    reference = gin.query_parameter("%MODEL_CONFIG")
  except ValueError as e:
    raise GinConfigError("no MODEL_CONFIG is bound: add a model file, e.g. "
                         "--gin_file=gin/models/t5_1_1/small.gin") from e
  try:
    config = copy.deepcopy(reference)  # evaluates @ModelConfig() with its bindings
  except (TypeError, ValueError) as e:
    raise GinConfigError(f"MODEL_CONFIG cannot be built: {e}") from e
  return ModelConfig.from_dict(config.to_dict())


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
