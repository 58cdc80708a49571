"""Checks of integer settings and feature lengths, run where configs are made.

They run before anything is allocated: TASK_FEATURE_LENGTHS {'inputs': 10**12} once got as
far as asking for a 2.3 PB array, and TRAIN_STEPS=10.5 trained to step 11, because `< 1`
lets floats, bools and strings through.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

from t5lite.errors import ConfigError

# Longer than any model t5lite trains; a row of it is 4 MiB of int32 per feature.
MAX_FEATURE_LENGTH = 1 << 20
# A global batch's token count must stay an int32 (positions, segment offsets, indexing).
MAX_BATCH_TOKENS = (1 << 31) - 1


def is_integer(value: Any) -> bool:
  """An int or numpy integer; bools are not (True would pass as 1)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _got(value: Any) -> str:
  """'10.5 (float): use 10 or 11' and the like, for error messages."""
  text = f"{value!r} ({type(value).__name__})"
  if isinstance(value, float) and math.isfinite(value):
    low, high = math.floor(value), math.ceil(value)
    return text + (f": write {low}" if low == high else f": use {low} or {high}")
  return text


def require_int(value: Any, name: str, *, minimum: int | None = None,
                optional: bool = False) -> int | None:
  """value as an int, or a ConfigError naming `name` (None passes when optional)."""
  if value is None and optional:
    return None
  if not is_integer(value):
    kind = "an integer or None" if optional else "an integer"
    raise ConfigError(f"{name} must be {kind}, got {_got(value)}")
  if minimum is not None and value < minimum:
    raise ConfigError(f"{name} must be >= {minimum}, got {value}")
  return int(value)


def check_feature_lengths(lengths: Any, name: str = "TASK_FEATURE_LENGTHS",
                          batch_size: int | None = None) -> dict[str, int | None]:
  """{feature: length} checked: integers from 1 to MAX_FEATURE_LENGTH (None: no limit, as
  `trim` reads it), and batch_size * their sum within MAX_BATCH_TOKENS."""
  if not isinstance(lengths, Mapping):
    raise ConfigError(f"{name} must be a dict of feature name to length, e.g. "
                      f"{{'inputs': 512, 'targets': 114}}, got {lengths!r}")
  checked = {}
  for key, length in lengths.items():
    if length is not None:
      require_int(length, f"{name}[{key!r}]", minimum=1)
      if length > MAX_FEATURE_LENGTH:
        raise ConfigError(f"{name}[{key!r}] = {length:,} is above {MAX_FEATURE_LENGTH:,} tokens, "
                          "the most t5lite allows per feature (its rows could not be allocated)")
      length = int(length)
    checked[key] = length
  if batch_size is not None and is_integer(batch_size) and batch_size > 0:
    total = int(batch_size) * sum(n for n in checked.values() if n)
    if total > MAX_BATCH_TOKENS:
      raise ConfigError(f"{name} {checked} with batch size {batch_size:,} make {total:,} tokens "
                        f"per batch, above {MAX_BATCH_TOKENS:,} (int32 indexing): lower the "
                        "batch size or the lengths")
  return checked
