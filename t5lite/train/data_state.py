"""The data iterator's state as one global JSON object, whatever the number of processes.

Each process's BatchIterator holds the grain states of the batch rows it computes. A
checkpoint must hold every row (a run resumes on another topology without repeating or
skipping examples: see t5lite/data/pipeline.py), so with several processes the per-process
states are gathered and merged; the primary process's copy is what orbax writes.
"""
from __future__ import annotations

import json

import jax
import numpy as np

from t5lite.data.pipeline import merge_states


def _allgather_bytes(payload: bytes) -> list[bytes]:
  """Every process's bytes, in process order (a collective: all processes must call it)."""
  from jax.experimental import multihost_utils
  length = np.array([len(payload)], np.int64)
  lengths = np.asarray(multihost_utils.process_allgather(length)).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[:len(payload)] = np.frombuffer(payload, np.uint8)
  gathered = np.asarray(multihost_utils.process_allgather(padded))
  return [gathered[i, :n].tobytes() for i, n in enumerate(lengths)]


def global_state(batches) -> dict:
  """The merged state of every process's rows (a collective when there are several)."""
  state = batches.get_state()
  if jax.process_count() == 1:
    return state
  parts = _allgather_bytes(json.dumps(state).encode())
  return merge_states([json.loads(p) for p in parts])
