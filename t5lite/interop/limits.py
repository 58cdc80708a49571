"""Bounds on what an import may claim, checked before anything is allocated or built.

A checkpoint's sizes come from untrusted text (an HF config.json, a T5X .zarray): a few bytes
can claim a model no host holds, and trusting them aborts the process (std::bad_alloc) or
runs for minutes building a million layers. So every import (`t5lite import hf|t5x`,
`load_hf`, `load_t5x`, and with them finetuning from an HF INITIAL_CHECKPOINT_PATH) checks
two things before it reads weights or builds the model:

1. The import ceiling (max_import_params()): the parameters a checkpoint may claim in all.
   The default, DEFAULT_MAX_IMPORT_PARAMS = 10**11 (400 GB in float32), is about what one
   host could plausibly import; the environment variable T5LITE_MAX_IMPORT_PARAMS, or
   `--max_params N` of `t5lite import hf|t5x` (which wins), sets another (e.g. 2e11).
2. The files: a claim must be backed by what is actually there. HF: the tensor shapes in
   the safetensors headers (.bin files have none: their tensors, whose reading costs no more
   than the files' size); T5X: the bytes of each array's chunk files (t5x_files.py says how
   compression is allowed for).

Sizes in config files must be integers (JSON numbers like 512 or 512.0, not "512", true or
512.5): a ConfigError names the field otherwise.
"""
from __future__ import annotations

import json
import os

from t5lite.errors import ConfigError

DEFAULT_MAX_IMPORT_PARAMS = 10**11
MAX_IMPORT_PARAMS_ENV = "T5LITE_MAX_IMPORT_PARAMS"
# A scanned T5X stack's depth is one number in a shape (its bytes can be few: d_model 1);
# t5lite builds and checks each layer by name, so a million claimed layers would run for
# hours. T5 has 24 per stack, PaLM 118. (HF's depth is checked against its weight files.)
MAX_LAYERS = 4096
HOW_TO_RAISE = f"set {MAX_IMPORT_PARAMS_ENV} or pass --max_params to raise it"
MAX_PARAMS_HELP = (f"the import ceiling: refuse a checkpoint that claims more parameters "
                   f"than N (e.g. 2e11; default: ${MAX_IMPORT_PARAMS_ENV}, else "
                   f"{DEFAULT_MAX_IMPORT_PARAMS:.0e}). Sizes are checked against it and "
                   "against the files before anything is allocated")


def parse_count(text: str, what: str) -> int:
  """A positive count written as 100000000000, 100_000_000_000 or 1e11."""
  try:
    value = float(text) if any(c in str(text) for c in ".eE") else int(str(text), 10)
  except ValueError:
    raise ConfigError(f"{what}={text!r} is not a number of parameters") from None
  if value != value or value in (float("inf"), float("-inf")) or value != int(value):
    raise ConfigError(f"{what}={text!r} is not a whole number of parameters")
  if int(value) < 1:
    raise ConfigError(f"{what}={text!r} must be at least 1")
  return int(value)


def max_import_params(override: int | None = None) -> int:
  """The import ceiling in parameters: `override` (--max_params), else the environment
  variable T5LITE_MAX_IMPORT_PARAMS, else DEFAULT_MAX_IMPORT_PARAMS."""
  if override is not None:
    if isinstance(override, bool) or not isinstance(override, int) or override < 1:
      raise ConfigError(f"max_params={override!r} must be a positive integer")
    return override
  env = os.environ.get(MAX_IMPORT_PARAMS_ENV, "").strip()
  return parse_count(env, MAX_IMPORT_PARAMS_ENV) if env else DEFAULT_MAX_IMPORT_PARAMS


def check_ceiling(claimed: int, what: str, max_params: int | None = None) -> None:
  """Refuses `claimed` parameters over the ceiling; `what` names the claim (file, field)."""
  ceiling = max_import_params(max_params)
  if claimed > ceiling:
    raise ConfigError(f"{what} claims {claimed:,} parameters, over the import ceiling of "
                      f"{ceiling:,} ({HOW_TO_RAISE})")


def size_field(value, field: str, where: str) -> int:
  """A positive integer size from a config file, else a ConfigError naming the field. An
  integral float (512.0, 1e12) is taken as the integer: JSON writers differ on that."""
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int):
    raise ConfigError(f"{where}: {field}={value!r} is not an integer size")
  if value < 1:
    raise ConfigError(f"{where}: {field}={value} must be at least 1")
  return value


def file_inside(directory: str, name: str) -> str | None:
  """directory/name, None if there is nothing there. A symlink is followed only within the
  directory: one whose real path leaves it (spiece.model -> /etc/passwd) is refused before
  it is opened, naming where it points."""
  path = os.path.join(directory, name)
  if not os.path.lexists(path):
    return None
  root = os.path.realpath(directory)
  real = os.path.realpath(path)
  if os.path.commonpath([root, real]) != root:
    raise ConfigError(f"{path} points to {real}, outside {directory}; refused (files of an "
                      "imported checkpoint must lie inside its directory)")
  return path


def read_json(path: str, max_bytes: int = 64 << 20):
  """A small JSON file (config.json, an index) read whole; damage is a ConfigError naming it."""
  size = os.path.getsize(path)
  if size > max_bytes:
    raise ConfigError(f"{path}: {size:,} bytes, too large for a JSON config (over {max_bytes:,})")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (ValueError, UnicodeError, RecursionError) as e:  # RecursionError: absurd nesting
    raise ConfigError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None


def positive_count(text: str) -> int:
  """argparse type of --max_params: 100000000000, 100_000_000_000 or 1e11."""
  return parse_count(text, "--max_params")
