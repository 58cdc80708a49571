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


class RowSlice(grain.MapDataset):
  """Elements row, row + rows, row + 2 * rows, ... of a random-access source.

  The same elements as `grain.MapDataset.source(source).slice(slice(row, None, rows))`,
  read with one indexing: grain's source wrapper and slice cost ~20 us per element (metrics,
  byte-size estimates), more than reading an in-memory document. Indices past len() wrap
  round (later epochs), as with grain's. Example: source [a b c d e], row 1, rows 2 -> [b d],
  and index 2 -> b.
  """

  def __init__(self, source, row: int, rows: int):
    super().__init__()
    self._source, self._row, self._rows = source, row, rows
    self._length = len(range(row, len(source), rows))

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    return self._source[self._row + self._rows * (index % self._length)]

  def __str__(self) -> str:
    return f"RowSlice(row={self._row}, rows={self._rows})"


class EpochShuffle(grain.MapDataset):
  """A fresh shuffle of the parent per epoch, from (seed, epoch): a full permutation, or
  (window=W) permutations within consecutive windows of W elements, the last one shorter.

  Indices past len() address later epochs, so `.repeat()` on top reshuffles every epoch.
  Only one window's permutation is held at a time. (grain's index_shuffle costs ~5 ms per
  index on small row slices, and its window shuffle fails on a partial last window.)
  Example: 5 elements, window 2 -> each epoch permutes [0 1], [2 3] and [4] separately.
  """

  def __init__(self, parent: grain.MapDataset, seed: int, window: int | None = None):
    super().__init__(parent)
    self._seed, self._window = seed, window or len(parent)
    self._key, self._permutation = None, None

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, position = divmod(index, len(self._parent))
    window, offset = divmod(position, self._window)
    if self._key != (epoch, window):
      start = window * self._window
      size = min(self._window, len(self._parent) - start)
      rng = np.random.default_rng([self._seed, epoch, window])
      self._permutation = start + rng.permutation(size)
      self._key = (epoch, window)
    return self._parent[epoch * len(self._parent) + int(self._permutation[offset])]


class _RandomMixIterator(grain.DatasetIterator):
  """Draws each element's task from (seed, element index): stateless and resumable."""

  def __init__(self, parents, weights, seed: int):
    super().__init__(list(parents))
    self._weights = np.asarray(weights, np.float64) / np.sum(weights)
    self._seed, self._index = seed, 0
    self._exhausted: list[int] = []  # finite epochs: finished tasks leave the draw

  def __next__(self):
    while True:
      weights = self._weights.copy()
      weights[self._exhausted] = 0.0
      if not weights.sum():
        raise StopIteration
      choice = np.random.default_rng([self._seed, self._index]).choice(
          len(weights), p=weights / weights.sum())
      self._index += 1
      try:
        return next(self._parents[choice])
      except StopIteration:
        self._exhausted.append(int(choice))

  def get_state(self):
    return {"index": self._index, "exhausted": list(self._exhausted),
            "parents": [p.get_state() for p in self._parents]}

  def set_state(self, state):
    self._index, self._exhausted = state["index"], list(state["exhausted"])
    for parent, parent_state in zip(self._parents, state["parents"]):
      parent.set_state(parent_state)


class RandomMix(grain.IterDataset):
  """Mixes datasets by weight with an independent draw per element (seeded per row), so
  rows of one batch mix tasks independently (grain's mix follows one fixed schedule, which
  gives every row the same task at the same step)."""

  def __init__(self, parents, weights, seed: int):
    super().__init__(list(parents))
    self._weights, self._seed = list(weights), seed

  def __iter__(self):
    return _RandomMixIterator([iter(p) for p in self._parents], self._weights, self._seed)


class _EmptyRowGuard(grain.MapDataset):
  """Counts a row's source reads and its preprocessed outputs, so a row whose preprocessing
  drops everything fails with a clear message instead of looping for ever.

  "Everything" = no output in at least two epochs and 1,024 reads (steps such as
  concatenating 128 documents legitimately read many before their first output).
  """

  def __init__(self, parent: grain.MapDataset, what: str):
    super().__init__(parent)
    self.reads, self.outputs, self._what = 0, 0, what

  def __len__(self) -> int:
    return len(self._parent)

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    self.reads += 1
    if not self.outputs and self.reads > max(2 * len(self._parent), 1024):
      raise ValueError(f"{self._what}: preprocessing dropped every one of its "
                       f"{len(self._parent)} source examples (read {self.reads - 1} times). "
                       "Use a smaller global batch size or more data.")
    return self._parent[index]


class _CountingIterator(grain.DatasetIterator):
  def __init__(self, parent, guard: _EmptyRowGuard):
    super().__init__(parent)
    self._guard = guard

  def __next__(self):
    element = next(self._parent)
    self._guard.outputs += 1
    return element

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    self._parent.set_state(state)


class _Counting(grain.IterDataset):
  def __init__(self, parent: grain.IterDataset, guard: _EmptyRowGuard):
    super().__init__(parent)
    self._guard = guard

  def __iter__(self):
    return _CountingIterator(iter(self._parent), self._guard)


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
  ds = RowSlice(source, row, rows)
  if config.shuffle:
    ds = EpochShuffle(ds, derive_seed(config.seed, task.name, row), task.shuffle_buffer_size)
  ds = guard = _EmptyRowGuard(ds, f"task {task.name!r} split {config.split!r} batch row {row}")
  # No per-row read threads: a process runs many rows, and threads per row cost more than
  # they save on in-memory preprocessing.
  ds = ds.repeat(config.num_epochs).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  steps = list(enumerate(task.preprocessors))[start:]
  ds = apply_preprocessors(ds, task, steps, sequence_length=config.task_feature_lengths,
                           seed=derive_seed(config.seed, task.name, row, "preprocess"))
  return _Counting(ds, guard)


def row_dataset(mixture_or_task: Task | Mixture, row: int, config: PipelineConfig,
                converter) -> grain.IterDataset:
  """Row `row`: the task (or the mixture of its tasks by rate), then the feature converter."""
  if isinstance(mixture_or_task, Mixture):
    pairs = [(t, rate) for t, rate in mixture_or_task.task_rates(config.split) if rate > 0]
    ds = RandomMix([task_row_dataset(t, row, config) for t, _ in pairs],
                   [rate for _, rate in pairs],
                   derive_seed(config.seed, mixture_or_task.name, row, "mix"))
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


def assemble_batch(rows: list[int], examples: Mapping[int, dict | None]) -> dict[str, np.ndarray]:
  """Stacks the rows' examples in row order. A finished row (None: finite epochs) becomes an
  all-zero row (segment ids and loss weights 0) until every row is finished; then
  StopIteration. Rows hold different numbers of examples, so no example is dropped."""
  present = [ex for ex in examples.values() if ex is not None]
  if not present:
    raise StopIteration
  blank = {k: np.zeros_like(v) for k, v in present[0].items()}
  ordered = [blank if examples[r] is None else examples[r] for r in rows]
  return {k: np.stack([ex[k] for ex in ordered]) for k in present[0]}


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
               fingerprint: str = ""):
    self.config, self.fingerprint = config, fingerprint
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
    return {"global_batch_size": self.config.global_batch_size, "seed": self.config.seed,
            "fingerprint": self.fingerprint,
            "rows": {str(r): self._iterators[r].get_state() for r in self.rows}}

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(self.config, self.fingerprint, self.rows, state)
    self._finished = set()
    for r in self.rows:
      self._iterators[r].set_state(state["rows"][str(r)])


def check_state(config: PipelineConfig, fingerprint_: str, rows, state: Mapping[str, Any]) -> None:
  """A saved state fits this run: same seed, global batch size, task, split, lengths and
  converter, and every row of ours present."""
  for key in ("global_batch_size", "seed"):
    if state[key] != getattr(config, key):
      raise ValueError(f"data state was saved with {key}={state[key]}, this run has "
                       f"{getattr(config, key)}: the batch sequence would differ")
  if state.get("fingerprint") != fingerprint_:
    raise ValueError(f"data state was saved for {state.get('fingerprint')}, this run reads "
                     f"{fingerprint_}: restoring it would skip or repeat examples")
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
  key = fingerprint(mixture_or_task_name, config, converter)
  if num_workers:
    from t5lite.data.workers import WorkerBatchIterator  # imports this module
    return WorkerBatchIterator(item, config, converter, rows, num_workers, key)
  return BatchIterator({r: row_dataset(item, r, config, converter) for r in rows}, config, key)
