"""The adapter_config.json fields and adapter_model.safetensors tensors that t5lite reads from
a peft adapter directory, checked before any is used.

peft validates little of what it reads back, so a hand-edited or damaged directory could
otherwise end in a traceback deep in the import (`"abc"` as lora_alpha, an alpha_pattern key
that is no regular expression, a 0-d lora_A) or, worse, be read as something else: `"no"` as
use_rslora is true in Python, a lora_alpha of 1e308 overflows float32 into inf and NaN, and an
adapter of NaN would be refused only later, by every read. Here each of them is one line
naming the file, the field or tensor, and what peft writes instead.
"""
from __future__ import annotations

import math
import re

import numpy as np

from t5lite.errors import ConfigError

FLOAT32_MAX = float(np.finfo(np.float32).max)


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _alpha(where: str, value) -> None:
  if not _is_number(value) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
    raise ConfigError(f"{where} {value!r} is not a finite number float32 can hold; peft "
                      "writes a number such as 16")


def _rank(where: str, value) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(f"{where} {value!r} is not a positive integer rank; peft writes e.g. 8")


def _pattern(config_file: str, field: str, patterns, check) -> None:
  """peft's rank_pattern / alpha_pattern: {regular expression over module names: value}."""
  if patterns is None:
    return
  if not isinstance(patterns, dict):
    raise ConfigError(f"{config_file}: {field} is a JSON {type(patterns).__name__}; peft "
                      "writes an object {module name pattern: value}")
  for key, value in patterns.items():
    try:
      re.compile(rf"(.*\.)?({key})$")
    except re.error as e:
      raise ConfigError(f"{config_file}: {field} key {key!r} is not a regular expression "
                        f"({e})") from None
    check(f"{config_file}: {field}[{key!r}]", value)


def check(config_file: str, settings: dict) -> None:
  """Raises ConfigError for a field of `settings` (a parsed adapter_config.json) that t5lite
  would misread or fail on."""
  if settings.get("peft_type") != "LORA":
    tokens = settings.get("num_virtual_tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
      raise ConfigError(f"{config_file}: num_virtual_tokens {tokens!r} is not a positive "
                        "integer; peft writes the prompt's length, e.g. 20")
    return
  if settings.get("r") is not None:
    _rank(f"{config_file}: r", settings["r"])
  _alpha(f"{config_file}: lora_alpha", settings.get("lora_alpha", 8))
  dropout = settings.get("lora_dropout")
  if dropout is not None and (not _is_number(dropout) or not 0 <= dropout < 1):
    raise ConfigError(f"{config_file}: lora_dropout {dropout!r} is not a probability in "
                      "[0, 1); peft writes e.g. 0.05")
  rslora = settings.get("use_rslora")
  if rslora is not None and not isinstance(rslora, bool):
    raise ConfigError(f"{config_file}: use_rslora {rslora!r} is not true or false (JSON "
                      "booleans, as peft writes them)")
  _pattern(config_file, "alpha_pattern", settings.get("alpha_pattern"), _alpha)
  _pattern(config_file, "rank_pattern", settings.get("rank_pattern"), _rank)


def check_tensors(weights_file: str, tensors: dict) -> None:
  """Every LoRA tensor a matrix of nonzero rank; every floating tensor finite."""
  for key, value in sorted(tensors.items()):
    if re.search(r"\.lora_[AB]\.weight$", key) and (value.ndim != 2 or 0 in value.shape):
      raise ConfigError(f"{weights_file}: {key} has shape {tuple(value.shape)}; a LoRA "
                        "weight is a (rank, fan_in) or (fan_out, rank) matrix, rank >= 1")
    floating = value.dtype.kind == "f" or value.dtype.name == "bfloat16"
    if floating and not np.isfinite(value).all():
      raise ConfigError(f"{weights_file}: {key} holds NaN or inf values (a damaged or "
                        "diverged adapter)")
