"""Deterministic, resumable, topology-independent batches from a task or mixture (grain).

The global batch has `global_batch_size` rows; row r is its own deterministic stream:
each task's source is split into that many strided index ranges (r, r + R, r + 2R, ...),
shuffled with a seed derived from (seed, task, r), repeated, preprocessed, mixed, and
packed by the feature converter. A process computes only the rows it owns, so the global
sequence of batches depends on (seed, global batch size, data) alone, never on how many
processes or devices read it. The iterator state is one grain state per row, keyed by row:
a run saved with 2 processes restores with 1 or 4 and neither repeats nor skips an example.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Any, Iterator, Mapping

import grain
import numpy as np

from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, Mixture, Task, get_mixture_or_task


def derive_seed(*parts: Any) -> int:
  """A stable 32-bit seed from any printable parts (hash() is salted per process)."""
  digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
  return int.from_bytes(digest[:4], "little")


# Module-level callables (not lambdas) so pipelines pickle into grain worker processes.
def _call(fn, kwargs, ex):
  return fn(ex, **kwargs)


def _call_random(fn, kwargs, ex, rng):
  return fn(ex, rng=rng, **kwargs)


def _is_example(ex) -> bool:
  return ex is not None


def apply_preprocessors(ds: grain.IterDataset, task: Task, steps, *,
                        sequence_length: Mapping[str, int] | None, seed: int) -> grain.IterDataset:
  """Applies task preprocessors (a slice of task.preprocessors) to an IterDataset."""
  for index, fn in steps:
    if fn is CACHE_POINT:
      continue
    injected = {"output_features": task.output_features, "sequence_length": sequence_length,
                "seed": derive_seed(seed, index)}
    wanted = pp.wanted_kwargs(fn)  # once per pipeline, not per example
    kwargs = {k: v for k, v in injected.items() if k in wanted and k != "rng"}
    if pp.is_stream(fn):
      ds = fn(ds, **kwargs)
      continue
    if "rng" in wanted:
      ds = ds.random_map(functools.partial(_call_random, fn, kwargs), seed=derive_seed(seed, index))
    else:
      ds = ds.map(functools.partial(_call, fn, kwargs))
    ds = ds.filter(_is_example)
  return ds


class EpochShuffle(grain.MapDataset):
  """A fresh permutation of the parent per epoch, from (seed, epoch).

  Indices past len() address later epochs, as grain's shuffle does, so `.repeat()` on top
  reshuffles every epoch. (grain's index_shuffle costs ~5 ms per index on small row slices;
  one cached numpy permutation per epoch costs microseconds.)
  """

  def __init__(self, parent: grain.MapDataset, seed: int):
    super().__init__(parent)
    self._seed = seed
    self._epoch, self._permutation = -1, None

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, position = divmod(index, len(self._parent))
    if epoch != self._epoch:
      self._permutation = np.random.default_rng([self._seed, epoch]).permutation(len(self._parent))
      self._epoch = epoch
    return self._parent[int(self._permutation[position])]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """Everything the batch sequence depends on (besides the data)."""
  global_batch_size: int
  task_feature_lengths: Mapping[str, int]
  split: str = "train"
  seed: int = 0
  shuffle: bool = True
  num_epochs: int | None = None  # None = repeat forever
  use_cached: bool = False
  cache_dir: str | None = None


def task_row_dataset(task: Task, row: int, config: PipelineConfig) -> grain.IterDataset:
  """Row `row`'s stream of preprocessed examples of one task."""
  from t5lite.data import cache  # the cache module imports this one
  start = 0
  source = None
  if config.use_cached:
    source = cache.cached_source(task, config.split, config.cache_dir)
    start = task.cache_index + 1
  if source is None:
    source = task.get_source(config.split)
  n, rows = len(source), config.global_batch_size
  if n < rows:
    raise ValueError(f"task {task.name!r} split {config.split!r} has {n} examples, fewer than "
                     f"the global batch size {rows}: some batch rows would have no data")
  ds = grain.MapDataset.source(source).slice(slice(row, None, rows))
  if config.shuffle:
    row_seed = derive_seed(config.seed, task.name, row)
    if task.shuffle_buffer_size:
      ds = grain.experimental.WindowShuffleMapDataset(ds, window_size=task.shuffle_buffer_size,
                                                      seed=row_seed)
    else:
      ds = EpochShuffle(ds, row_seed)
  # No per-row read threads: a process runs many rows, and threads per row cost more than
  # they save on in-memory preprocessing.
  ds = ds.repeat(config.num_epochs).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  steps = list(enumerate(task.preprocessors))[start:]
  return apply_preprocessors(ds, task, steps, sequence_length=config.task_feature_lengths,
                             seed=derive_seed(config.seed, task.name, row, "preprocess"))


def row_dataset(mixture_or_task: Task | Mixture, row: int, config: PipelineConfig,
                converter) -> grain.IterDataset:
  """Row `row`: the task (or the mixture of its tasks by rate), then the feature converter."""
  if isinstance(mixture_or_task, Mixture):
    pairs = mixture_or_task.task_rates(config.split)
    ds = grain.IterDataset.mix([task_row_dataset(t, row, config) for t, _ in pairs],
                               [rate for _, rate in pairs])
  else:
    ds = task_row_dataset(mixture_or_task, row, config)
  return converter(ds, config.task_feature_lengths)


def owned_rows(global_batch_size: int, process_index: int, process_count: int) -> range:
  """The contiguous rows of the global batch that one process computes."""
  if global_batch_size % process_count:
    raise ValueError(f"global batch size {global_batch_size} does not divide evenly over "
                     f"{process_count} processes; pick a multiple of {process_count}")
  per = global_batch_size // process_count
  return range(process_index * per, (process_index + 1) * per)


class BatchIterator:
  """Yields this process's slice of each global batch as a dict of (rows, length) arrays.

  get_state() holds one entry per owned row; set_state() accepts a state merged from any
  number of processes (e.g. all of a 4-process run) and takes the rows it owns.
  """

  def __init__(self, datasets: Mapping[int, grain.IterDataset], config: PipelineConfig):
    self.config = config
    self.rows = sorted(datasets)
    self._iterators = {r: iter(datasets[r]) for r in self.rows}

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    examples = [next(self._iterators[r]) for r in self.rows]
    return {k: np.stack([ex[k] for ex in examples]) for k in examples[0]}

  def get_state(self) -> dict[str, Any]:
    return {"global_batch_size": self.config.global_batch_size, "seed": self.config.seed,
            "rows": {str(r): self._iterators[r].get_state() for r in self.rows}}

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(self.config, self.rows, state)
    for r in self.rows:
      self._iterators[r].set_state(state["rows"][str(r)])


def check_state(config: PipelineConfig, rows, state: Mapping[str, Any]) -> None:
  """A saved state fits this run: same seed and global batch size, all our rows present."""
  for key in ("global_batch_size", "seed"):
    if state[key] != getattr(config, key):
      raise ValueError(f"data state was saved with {key}={state[key]}, this run has "
                       f"{getattr(config, key)}: the batch sequence would differ")
  missing = [r for r in rows if str(r) not in state["rows"]]
  if missing:
    raise ValueError(f"data state lacks rows {missing[:5]}... (merge every process's state)")


def merge_states(states: list[Mapping[str, Any]]) -> dict[str, Any]:
  """One global state from the per-process states of a run."""
  merged = dict(states[0])
  merged["rows"] = {}
  for state in states:
    merged["rows"].update(state["rows"])
  return merged


def get_dataset(mixture_or_task_name: str, config: PipelineConfig, converter, *,
                process_index: int = 0, process_count: int = 1, num_workers: int = 0):
  """The batch iterator for this process: in-process, or with rows spread over
  `num_workers` worker processes (same batches, same states)."""
  item = get_mixture_or_task(mixture_or_task_name)
  rows = owned_rows(config.global_batch_size, process_index, process_count)
  if num_workers:
    from t5lite.data.workers import WorkerBatchIterator  # imports this module
    return WorkerBatchIterator(item, config, converter, rows, num_workers)
  return BatchIterator({r: row_dataset(item, r, config, converter) for r in rows}, config)
