"""A T5X run's config.gin, read without gin: the few bindings the T5X importer needs.

    gin_bindings(text, "T5Config")   # {'vocab_size': 32128, 'emb_dim': 512, ...}

`a.T5Config.x = v` lines and `a.T5Config:` blocks, with %MACROs resolved; values are Python
literals (anything else, e.g. an @reference, is kept as its text). Importing gin would run
the T5X run's configurables; a checkpoint from elsewhere is untrusted input, so it is parsed
as text, with a size limit.
"""
from __future__ import annotations

import ast
import os
import re
from typing import Any

from t5lite.interop.t5x.files import MAX_JSON_BYTES


def gin_bindings(text: str, configurable: str) -> dict[str, Any]:
  """Values bound to `configurable` (matched on its last name, e.g. 'T5Config') in a gin file:
  `a.T5Config.x = v` lines and `a.T5Config:` blocks; %MACROs resolved; literals only."""
  lines, pending = [], ""
  for raw in text.splitlines():
    line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
    pending = f"{pending} {line.strip()}" if pending else line
    if pending and sum(pending.count(c) for c in "([{") <= sum(pending.count(c) for c in ")]}"):
      lines.append(pending)
      pending = ""
  macros, found, block = {}, {}, False
  pattern = rf"(?:[\w.]+\.)?{re.escape(configurable)}"
  for line in lines:
    if m := re.fullmatch(rf"{pattern}:", line):
      block = True
      continue
    block = block and line[:1].isspace()
    if block and (m := re.fullmatch(r"\s+(\w+)\s*=\s*(.+)", line)):
      found[m[1]] = m[2]
    elif m := re.fullmatch(rf"{pattern}\.(\w+)\s*=\s*(.+)", line):
      found[m[1]] = m[2]
    elif m := re.fullmatch(r"([A-Z_][A-Z0-9_]*)\s*=\s*(.+)", line):
      macros[m[1]] = m[2]
  return {k: _gin_value(v, macros) for k, v in found.items()}


def _gin_value(text: str, macros: dict[str, str], depth: int = 0):
  text = text.strip()
  if text.startswith("%") and text[1:] in macros and depth < 8:
    return _gin_value(macros[text[1:]], macros, depth + 1)
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a reference (@x, %x) we do not follow


def read_gin(ckpt_dir: str) -> tuple[str | None, str]:
  """config.gin of the T5X model dir (beside checkpoint_N), or of the step folder."""
  for folder in (os.path.dirname(ckpt_dir), ckpt_dir):
    path = os.path.join(folder, "config.gin")
    if os.path.isfile(path) and os.path.getsize(path) < MAX_JSON_BYTES:
      with open(path, encoding="utf-8", errors="replace") as f:
        return path, f.read()
  return None, ""
