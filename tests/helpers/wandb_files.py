"""Reads the records of a W&B run file (run-ID.wandb), as written by wandb in offline mode.

wandb ships no reader for its run files since its Go core took over writing them; the format
is LevelDB's log (32 KiB blocks of chunks, each a 7-byte header: CRC32C, length, type) after
a 7-byte file header, holding wandb's own `Record` protobufs, which wandb's package does ship.
"""
from __future__ import annotations

import json
import struct

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path) -> list:
  """Every wandb Record in the file, in order."""
  from wandb.proto import wandb_internal_pb2
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", data[:7]
  out, pending, pos = [], b"", HEADER
  while pos + HEADER <= len(data):
    left = BLOCK - pos % BLOCK
    if left < HEADER:  # a block's tail too short for a header is padding
      pos += left
      continue
    _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
    if kind == 0:
      pos += left
      continue
    pending += data[pos + HEADER:pos + HEADER + length]
    pos += HEADER + length
    if kind in (FULL, LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      out.append(record)
      pending = b""
  return out


def _items(items) -> dict:
  return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def history(path) -> list[dict]:
  """The logged rows: W&B's step as `step`, without W&B's other keys (_runtime, _timestamp)."""
  rows = [_items(r.history.item) for r in records(path) if r.WhichOneof("record_type") == "history"]
  return [{"step": row["_step"], **{k: v for k, v in row.items() if not k.startswith("_")}}
          for row in rows]


def config(path) -> dict:
  """The run's config (the run record's, updated by later config records)."""
  out = {}
  for r in records(path):
    kind = r.WhichOneof("record_type")
    if kind == "run":
      out.update(_items(r.run.config.update))
    elif kind == "config":
      out.update(_items(r.config.update))
  return out


def summary(path) -> dict:
  """Summary keys set by name (run.summary.update): wandb's own per-row updates leave the key
  empty and are left out."""
  out = {}
  for r in records(path):
    if r.WhichOneof("record_type") == "summary":
      out.update({k: v for k, v in _items(r.summary.update).items() if k})
  return out
