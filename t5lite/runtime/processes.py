"""Agreeing across the processes of a job: every process's answer to one yes/no question.

Multi-host decisions (stop on SIGTERM, fall back to an older checkpoint, end an eval split,
trust a shared MODEL_DIR) must come out the same on every process, or one of them waits
alone in a collective. Each is one tiny all-gather of a flag.
"""
from __future__ import annotations

import jax
import numpy as np


def all_flags(flag: bool) -> list[bool]:
  """Every process's `flag`, in process order. A collective when there are several
  processes: all of them must call it, in the same order as their other collectives."""
  if jax.process_count() == 1:
    return [bool(flag)]
  from jax.experimental import multihost_utils
  flags = multihost_utils.process_allgather(np.array([flag], np.int32))
  return [bool(f) for f in np.asarray(flags).reshape(-1)]
