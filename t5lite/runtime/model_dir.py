"""A self-describing MODEL_DIR: what a run writes beside its checkpoints, and reading it back.

  MODEL_DIR/
    model_config.json      the ModelConfig (t5lite.ModelConfig.from_json reads it)
    vocabulary.json        the vocabulary (t5lite.data.vocab.vocabularies.load_vocabulary reads it,
    spiece.model           as does T5LITE_VOCAB=MODEL_DIR) and its sentencepiece model
    config.gin             the gin config the run was started with
    task.json              what it trained on: {"mixture_or_task_name", "task_feature_lengths"}
    checkpoints/<step>/    orbax checkpoints: state (TrainState) + data (iterator state)
    metrics.jsonl          one JSON object per logged step; tensorboard/ the same as events

Export, import, eval and infer need nothing else: no gin files, no task registry.

A MODEL_DIR is a folder or a gs://BUCKET/run or s3://BUCKET/run URL (t5lite.util.paths reads
and writes them): with several hosts, a gs:// bucket or a folder every host sees (NFS,
Filestore, Lustre, a FUSE mount at the same path everywhere; s3:// checkpoints are one
process's: t5lite.runtime.checkpoint_mirror). Other URL schemes are refused (check_location),
and a multi-process run on a folder checks that all processes see the same one (check_shared)
before it writes anything there; a bucket is one namespace for every host.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import time

from t5lite.data.vocab.vocabularies import Vocabulary
from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.models.config import ModelConfig
from t5lite.runtime.checkpoint_mirror import check_single_process
from t5lite.util import paths

MODEL_CONFIG_FILE = "model_config.json"
GIN_FILE = "config.gin"
TASK_FILE = "task.json"
SHARED_CHECK_FILE = ".t5lite_shared_check"
"""Prefix of the file process 0 writes, and every process reads, as a multi-process run
starts (check_shared); removed once read."""
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# Fields a resumed run may change: they alter computation, not the saved arrays.
RUNTIME_FIELDS = frozenset({"dropout_rate", "dtype", "remat_policy"})


def load_model_config(model_dir: str | os.PathLike) -> ModelConfig:
  path = paths.join(model_dir, MODEL_CONFIG_FILE)
  if not paths.isfile(path):
    raise ConfigFileNotFoundError(f"{path} not found: {model_dir} is not a t5lite MODEL_DIR")
  return ModelConfig.from_json(paths.read_text(path))


def load_task_record(model_dir: str | os.PathLike) -> dict | None:
  """task.json's {"mixture_or_task_name": str, "task_feature_lengths": {feature: length}},
  or None where the folder has none (an HF directory, a MODEL_DIR of an older t5lite)."""
  path = paths.join(model_dir, TASK_FILE)
  if not paths.isfile(path):
    return None
  try:
    record = json.loads(paths.read_text(path))
    lengths = record["task_feature_lengths"]
    if not (isinstance(record["mixture_or_task_name"], str) and isinstance(lengths, dict)
            and all(isinstance(k, str) and isinstance(v, int) for k, v in lengths.items())):
      raise ValueError("not the fields t5lite writes")
  except (ValueError, TypeError, KeyError) as e:
    raise ConfigError(f"{path} is damaged ({type(e).__name__}: {e}): remove it, or copy it "
                      "from the run that wrote this MODEL_DIR") from None
  return record


def model_dir_of(checkpoint_path: str | os.PathLike) -> str:
  """The MODEL_DIR a checkpoint path belongs to: the path itself, or the folder above its
  checkpoints/ folder (for MODEL_DIR/checkpoints or MODEL_DIR/checkpoints/<step>)."""
  path = paths.absolute(checkpoint_path)
  for candidate in (path, paths.dirname(path), paths.dirname(paths.dirname(path))):
    if paths.isfile(paths.join(candidate, MODEL_CONFIG_FILE)):
      return candidate
  raise ConfigFileNotFoundError(f"{checkpoint_path} is not in a t5lite MODEL_DIR (no "
                                f"{MODEL_CONFIG_FILE} there or two folders up)")


DISTILLATION_PARAMS = "distillation"
"""The top-level params key of a distillation run's trained projection (not the model's)."""


PEFT_RECORD_FILE = "peft.json"
"""A PEFT run's record (t5lite.interop.peft.record): its MODEL_DIR holds adapters only."""


def load_params(checkpoint_path: str | os.PathLike, mesh=None, rules=None):
  """(model_config, params, step) of a checkpoint: a MODEL_DIR (its newest step) or a step
  folder. Params only, laid out on `mesh` by `rules` (default: every device, data parallel).
  A PEFT run holds only adapters: t5lite.interop.peft.record.load_run joins them to its base."""
  from t5lite.families import family_of
  from t5lite.runtime import checkpoint_reader, partitioning
  home = model_dir_of(checkpoint_path)
  if paths.isfile(paths.join(home, PEFT_RECORD_FILE)):
    raise ConfigError(f"{home} is a PEFT run (adapters only), not a whole model: name the "
                      "base it adapts (its peft.json's 'base'), or read it with "
                      "t5lite.interop.peft.record.load_run, which joins the two")
  model_config = load_model_config(home)
  mesh = mesh if mesh is not None else partitioning.make_mesh(partitioning.MeshConfig())
  rules = rules if rules is not None else partitioning.logical_axis_rules()
  shardings = partitioning.param_shardings(model_config, mesh, rules)
  abstract = partitioning.abstract_sharded(family_of(model_config).abstract_params(), shardings)
  # A distillation run's checkpoint also holds its trained projection, not part of the model.
  params, step = checkpoint_reader.restore_params(checkpoint_path, abstract,
                                                  ignore=(DISTILLATION_PARAMS,))
  return model_config, params, step


def write_json(path: str, value) -> None:
  _write_atomic(path, json.dumps(value, indent=2) + "\n")


def _write_atomic(path: str, text: str) -> None:
  from t5lite.util import atomic
  atomic.write_file(path, text)


def check_compatible(model_dir: str | os.PathLike, model_config: ModelConfig) -> None:
  """Raises ValueError when MODEL_DIR holds a run of another model config, which
  `model_config` cannot continue (a folder without model_config.json is fine). The one check
  of a MODEL_DIR against a config: training runs it on every process before anything is
  written there."""
  model_dir = os.fspath(model_dir)
  if not paths.isfile(paths.join(model_dir, MODEL_CONFIG_FILE)):
    return
  a, b = load_model_config(model_dir).to_dict(), model_config.to_dict()
  differ = sorted(k for k in a if a[k] != b.get(k) and k not in RUNTIME_FIELDS)
  if differ:
    changes = ", ".join(f"{k}: {a[k]!r} -> {b.get(k)!r}" for k in differ)
    raise ConfigError(f"MODEL_DIR {model_dir} was trained with another model config ({changes}); "
                      "use a new MODEL_DIR, or the model gin file it was trained with")


def check_vocabulary(model_dir: str | os.PathLike, vocabulary: Vocabulary | None,
                     what: str = "MODEL_DIR") -> None:
  """Raises ConfigError when `model_dir` holds a vocabulary (vocabulary.json, or an HF
  directory's spiece.model) other than `vocabulary`: its checkpoints' ids mean other text,
  and resuming or finetuning them on this task would train on (and infer, eval and export
  would decode with) the wrong one."""
  from t5lite.data.vocab.vocabularies import CONFIG_FILE, SPIECE_FILE, load_vocabulary
  model_dir = os.fspath(model_dir)
  if vocabulary is None or not any(paths.isfile(paths.join(model_dir, name))
                                   for name in (CONFIG_FILE, SPIECE_FILE)):
    return
  saved = load_vocabulary(model_dir)
  extends = getattr(vocabulary, "extends", None)  # a LazyVocabulary delegates it
  if what == "INITIAL_CHECKPOINT_PATH" and extends is not None and extends(saved):
    return  # tokens added for finetuning (GPT-1's): the embedding grows (train.warm_start)
  if not vocabulary == saved:  # the task's on the left: a lazy one compares what it wraps
    raise ConfigError(
        f"{what} {model_dir} was trained with another vocabulary ({saved!r}) than the task's "
        f"({vocabulary!r}); use a task with the checkpoint's vocabulary (T5LITE_VOCAB="
        f"{model_dir} points the shipped tasks at it), or a new MODEL_DIR")


def prepare(model_dir: str | os.PathLike, model_config: ModelConfig,
            vocabulary: Vocabulary | None, gin_config_text: str | None = None,
            task: tuple[str, dict[str, int]] | None = None) -> None:
  """Writes (or, when present, checks) model_config.json, the vocabulary and config.gin, and
  task.json from `task` (its name and feature lengths).

  Call on the primary process only, once every check that can refuse the run has passed
  (t5lite.train.trainer.train): a refused run leaves MODEL_DIR as it found it. A MODEL_DIR
  that holds another model config or vocabulary is refused before anything is overwritten.
  """
  model_dir = os.fspath(model_dir)
  paths.makedirs(model_dir)
  check_compatible(model_dir, model_config)
  check_vocabulary(model_dir, vocabulary)
  _write_atomic(paths.join(model_dir, MODEL_CONFIG_FILE), model_config.to_json() + "\n")
  if vocabulary is not None:
    vocabulary.save(model_dir)
  if gin_config_text is not None:
    _write_atomic(paths.join(model_dir, GIN_FILE), gin_config_text)
  if task is not None:
    name, lengths = task
    write_json(paths.join(model_dir, TASK_FILE), {
        "mixture_or_task_name": name, "task_feature_lengths": dict(lengths)})


def check_location(path: str | os.PathLike | None, what: str = "MODEL_DIR") -> None:
  """Raises ConfigError for a URL other than gs:// and s3:// (say http:// or hdfs://): os.path
  and open would take it for a relative folder, so each host would write to its own disk."""
  if not isinstance(path, (str, os.PathLike)):
    return
  path = os.fspath(path)
  if _URL.match(path) and not paths.is_url(path):
    raise ConfigError(
        f"{what}={path!r}: t5lite reads and writes gs://BUCKET/PATH and "
        "s3://BUCKET/PATH URLs and local folders (or mounts), not this scheme")


# The longest path orbax and t5lite write below a MODEL_DIR, past it: "/checkpoints/" + a
# step's uncommitted folder ("<step>.orbax-checkpoint-tmp-<timestamp>", or a damaged step's
# "<step>.corrupt-<n>") + "/state/ocdbt.process_<n>/d/" + a 32-digit hex file name.
DEEPEST_BELOW = 160


def check_path_length(model_dir: str | os.PathLike, what: str = "MODEL_DIR") -> None:
  """Raises ConfigError for a local MODEL_DIR so long that the files of its checkpoints would
  pass the system's path limit (PATH_MAX): otherwise the run would train until its first save,
  then stop. A bucket's object names have their own limit (1,024 bytes), checked likewise."""
  if not isinstance(model_dir, (str, os.PathLike)):
    return  # a placeholder (t5lite compile fills MODEL_DIR in later)
  path = os.fspath(model_dir)
  if paths.is_url(path):
    scheme, _, bucket = path.split("/", 3)[:3]  # "gs:", "", BUCKET: 1,024 bytes past them
    limit = len(os.fsencode(f"{scheme}//{bucket}/")) + 1024
  else:
    path = os.path.abspath(path)
    existing = path
    while not os.path.isdir(existing):
      existing = os.path.dirname(existing)
    try:
      limit = os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
      limit = 4096
  size = len(os.fsencode(path))
  if size + DEEPEST_BELOW >= limit:
    raise ConfigError(
        f"{what} is {size} bytes long ({path[:60]}...): its checkpoint files, up to "
        f"{DEEPEST_BELOW} bytes deeper, would pass the limit of {limit} bytes for a path; "
        f"choose a {what} under {limit - DEEPEST_BELOW} bytes")


def check_shared(model_dir: str | os.PathLike, *, patience: float = 5.0) -> None:
  """With several processes, stops every one of them (ValueError, the same on each) unless
  all see `model_dir` as one folder: process 0 writes a file named by a fresh token there,
  then every process looks for it (for up to `patience` seconds: a network filesystem may
  show a new file late). A name new to every host, so no cache can answer for it. Why:
  checkpoints are written by every process and committed by process 0, so a folder on each
  host's own disk would give checkpoints that no host holds whole. For that reason an s3://
  MODEL_DIR, whose checkpoints go through one host's disk, is refused too."""
  import jax
  import numpy as np
  if jax.process_count() == 1:
    return
  check_single_process(os.fspath(model_dir), jax.process_count())
  if paths.is_url(model_dir):
    return  # (a bucket: every host that names it reaches the same objects)
  from jax.experimental import multihost_utils

  from t5lite.runtime.processes import all_flags
  model_dir = os.fspath(model_dir)
  token = int(np.asarray(multihost_utils.broadcast_one_to_all(
      np.array(secrets.randbits(31), np.int32))))
  path = os.path.join(model_dir, f"{SHARED_CHECK_FILE}.{token}")
  unwritable = ""  # process 0's error: it still joins the collectives, so none waits alone
  if jax.process_index() == 0:
    try:
      os.makedirs(model_dir, exist_ok=True)
      _write_atomic(path, str(token))
    except OSError as e:
      unwritable = f" (process 0 could not write it: {e})"
  multihost_utils.sync_global_devices("t5lite: MODEL_DIR check file written")
  seen = not unwritable and _sees_token(path, token, patience)
  flags = np.array(all_flags(seen))
  if jax.process_index() == 0 and not unwritable:
    os.remove(path)
  blind = np.flatnonzero(flags == 0).tolist()
  if blind:
    raise ConfigError(
        f"MODEL_DIR {model_dir} is not shared: process(es) {blind} do not see the file "
        f"process 0 wrote there ({os.path.basename(path)}){unwritable}. MODEL_DIR must be a "
        "folder every host sees, at the same path: a shared filesystem such as NFS/Filestore "
        "or a FUSE mount at the same path everywhere; or a bucket URL such as gs://BUCKET/run")


def _sees_token(path: str, token: int, patience: float) -> bool:
  deadline = time.monotonic() + patience
  while True:
    try:
      with open(path, encoding="utf-8") as f:
        if f.read().strip() == str(token):
          return True
    except OSError:
      pass
    if time.monotonic() >= deadline:
      return False
    time.sleep(0.2)
