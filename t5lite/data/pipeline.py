"""Deterministic, resumable, topology-independent batches from a task or mixture (grain).

The global batch has `global_batch_size` rows; row r is its own deterministic stream:
each task's source is split into that many strided index ranges (r, r + R, r + 2R, ...),
shuffled with a seed derived from (seed, task, r), repeated, preprocessed, mixed, and
packed by the feature converter. A process computes only the rows it owns, so the global
sequence of batches depends on (seed, global batch size, data) alone, never on how many
processes or devices read it. The iterator state is one grain state per row, keyed by row:
a run saved with 2 processes restores with 1 or 4 and neither repeats nor skips an example.

The rows' streams are built in rows.py; with num_workers, workers.py computes them in worker
processes.
"""
from __future__ import annotations

import json
from typing import Any, Iterator, Mapping

import grain
import numpy as np

from t5lite.data import cache, identity
from t5lite.data.registry import Mixture, get_mixture_or_task
from t5lite.data.rows import (PipelineConfig, assemble_batch, check_state, row_dataset,
                              with_data)
from t5lite.data.workers import WorkerBatchIterator
from t5lite.errors import ConfigError


def owned_rows(global_batch_size: int, process_index: int, process_count: int) -> range:
  """The contiguous rows of the global batch that one process computes."""
  if global_batch_size % process_count:
    raise ConfigError(f"global batch size {global_batch_size} does not divide evenly over "
                      f"{process_count} processes; pick a multiple of {process_count}")
  per = global_batch_size // process_count
  return range(process_index * per, (process_index + 1) * per)


def fingerprint(name: str, config: PipelineConfig, converter) -> str:
  """What else the batch sequence depends on; a restored state must have been saved with it."""
  return json.dumps([name, config.split, sorted(config.task_feature_lengths.items()),
                     repr(converter), config.shuffle, config.num_epochs])


class BatchIterator:
  """Yields this process's slice of each global batch as a dict of (rows, length) arrays.

  get_state() holds one entry per owned row; set_state() accepts a state merged from any
  number of processes (e.g. all of a 4-process run) and takes the rows it owns.
  """

  def __init__(self, datasets: Mapping[int, grain.IterDataset], config: PipelineConfig,
               fingerprint: str = "", data=None):
    self.config, self.fingerprint, self.data = config, fingerprint, data
    self.rows = sorted(datasets)
    self._iterators = {r: iter(datasets[r]) for r in self.rows}
    self._finished: set[int] = set()

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def _next_example(self, row: int):
    if row in self._finished:
      return None
    try:
      return next(self._iterators[row])
    except StopIteration:
      self._finished.add(row)
      return None

  def __next__(self) -> dict[str, np.ndarray]:
    return assemble_batch(self.rows, {r: self._next_example(r) for r in self.rows})

  def get_state(self) -> dict[str, Any]:
    return with_data({"global_batch_size": self.config.global_batch_size,
                      "seed": self.config.seed, "fingerprint": self.fingerprint,
                      "rows": {str(r): self._iterators[r].get_state() for r in self.rows}},
                     self.data)

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(self.config, self.fingerprint, self.rows, state, self.data)
    self._finished = set()
    for r in self.rows:
      self._iterators[r].set_state(state["rows"][str(r)])


def merge_states(states: list[Mapping[str, Any]]) -> dict[str, Any]:
  """One global state from the per-process states of a run."""
  merged = dict(states[0])
  merged["rows"] = {}
  for state in states:
    merged["rows"].update(state["rows"])
  return merged


def task_sources(item, config: PipelineConfig) -> dict[str, Any]:
  """{"TASK/SPLIT": source} of the tasks a pipeline reads (the caches with use_cached)."""
  tasks = ([t for t, rate in item.task_rates(config.split) if rate > 0]
           if isinstance(item, Mixture) else [item])
  return {f"{t.name}/{config.split}": cache.cached_source(t, config.split, config.cache_dir)
          if config.use_cached else t.get_source(config.split) for t in tasks}


def get_dataset(mixture_or_task_name: str, config: PipelineConfig, converter, *,
                process_index: int = 0, process_count: int = 1, num_workers: int = 0):
  """The batch iterator for this process: in-process, or with rows spread over
  `num_workers` worker processes (same batches, same states)."""
  item = get_mixture_or_task(mixture_or_task_name)
  rows = owned_rows(config.global_batch_size, process_index, process_count)
  key = fingerprint(mixture_or_task_name, config, converter)
  data = identity.LazyIdentity(lambda: task_sources(item, config))
  if num_workers:
    return WorkerBatchIterator(item, config, converter, rows, num_workers, key, data=data)
  return BatchIterator({r: row_dataset(item, r, config, converter) for r in rows}, config, key,
                       data)
