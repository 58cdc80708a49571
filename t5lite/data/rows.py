"""Each row of the global batch as its own deterministic stream, and what every batch
iterator does with rows (pipeline.BatchIterator in this process, workers.WorkerBatchIterator
in worker processes): stack their examples into a batch, and check a saved per-row state.

Row r of R reads each task's source at r, r + R, r + 2R, ... (RowSlice), shuffled per epoch
with a seed of its own (EpochShuffle), repeated, preprocessed, mixed over tasks with a draw
per element (RandomMix), then packed by the feature converter.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping

import grain
import numpy as np

from t5lite.data import cache, identity
from t5lite.util.checks import check_feature_lengths, require_int
from t5lite.data.preprocessors import apply_preprocessors, derive_seed
from t5lite.data.registry import Mixture, Task
from t5lite.data.stream_rows import StreamRow
from t5lite.errors import ConfigError


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
    # The parent and its length held here: grain's `_parent` property and len() per read
    # cost more than the shuffle (a row reads every document through this).
    self._source, self._length = parent, len(parent)
    self._seed, self._window = seed, window or self._length
    self._key, self._permutation = None, None

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    epoch, position = divmod(index, self._length)
    window, offset = divmod(position, self._window)
    if self._key != (epoch, window):
      start = window * self._window
      size = min(self._window, self._length - start)
      rng = np.random.default_rng([self._seed, epoch, window])
      self._permutation = (start + rng.permutation(size)).tolist()
      self._key = (epoch, window)
    return self._source[epoch * self._length + self._permutation[offset]]


class _InOrderIterator(grain.DatasetIterator):
  def __init__(self, parent: grain.MapDataset, stop: int):
    super().__init__()
    self._source, self._stop, self._next = parent, stop, 0

  def __next__(self):
    while self._next < self._stop:
      element = self._source[self._next]
      self._next += 1
      if element is not None:  # a sparse MapDataset's dropped element
        return element
    raise StopIteration

  def get_state(self):
    return {"next_index": self._next}

  def set_state(self, state):
    if "next_index" not in state:
      raise ConfigError(f"this data state was saved by a streamed reading of the task (keys "
                        f"{sorted(state)}), and its source is now read by index (or "
                        "USE_CACHED_TASKS changed): resume with the setup that saved it, or "
                        "train in a new MODEL_DIR")
    self._next = int(state["next_index"])


class InOrder(grain.IterDataset):
  """Elements 0, 1, 2, ... of a MapDataset, for `num_epochs` epochs (None: for ever; later
  epochs read indices past len(), which RowSlice wraps and EpochShuffle reshuffles).

  What `parent.repeat(num_epochs).to_iter_dataset()` with no read threads gives, state
  included ({"next_index": i}, so states saved either way restore either way), without
  grain's per-element statistics and prefetch bookkeeping (~10 us a document: more than the
  rest of span corruption's per-document work). Example: parent [a b c], 2 epochs -> a b c a
  b c, and state {"next_index": 4} continues at b.
  """

  def __init__(self, parent: grain.MapDataset, num_epochs: int | None = None):
    super().__init__()
    self._map = parent
    self._stop = sys.maxsize if num_epochs is None else num_epochs * len(parent)
    if not len(parent):
      self._stop = 0

  def __iter__(self):
    return _InOrderIterator(self._map, self._stop)


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
    self._source, self._length = parent, len(parent)  # as EpochShuffle: read per document
    self.reads, self.outputs, self._what = 0, 0, what

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.slice(index)
    self.reads += 1
    if not self.outputs and self.reads > max(2 * self._length, 1024):
      raise ConfigError(f"{self._what}: preprocessing dropped every one of its "
                        f"{self._length} source examples (read {self.reads - 1} times). "
                        "Use a smaller global batch size or more data.")
    return self._source[index]


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


# A streamed task's shuffle window per batch row when its shuffle_buffer_size is None
# (parsed documents held per row: ~1 MB for C4's ~2 KB documents).
STREAM_WINDOW = 512


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
  # Restore a state saved on other files (its positions then point into the new data).
  accept_data_changes: bool = False

  def __post_init__(self):
    # Before any row is allocated: a length of 10**12 once asked numpy for petabytes.
    require_int(self.global_batch_size, "global_batch_size", minimum=1)
    check_feature_lengths(self.task_feature_lengths, "task_feature_lengths",
                          self.global_batch_size)


def task_row_dataset(task: Task, row: int, config: PipelineConfig) -> grain.IterDataset:
  """Row `row`'s stream of preprocessed examples of one task."""
  start = 0
  source = None
  if config.use_cached:
    source = cache.cached_source(task, config.split, config.cache_dir)
    start = task.cache_index + 1
  if source is None:
    source = task.get_source(config.split)
  what = f"task {task.name!r} split {config.split!r} batch row {row}"
  if getattr(source, "streaming", False):
    ds = guard = StreamRow(source, row, config.global_batch_size,
                           seed=derive_seed(config.seed, task.name, row), shuffle=config.shuffle,
                           window=task.shuffle_buffer_size or STREAM_WINDOW,
                           num_epochs=config.num_epochs, what=what)
  else:
    ds, guard = _random_access_row(source, row, task, config, what)
  steps = list(enumerate(task.preprocessors))[start:]
  ds = apply_preprocessors(ds, task, steps, sequence_length=config.task_feature_lengths,
                           seed=derive_seed(config.seed, task.name, row, "preprocess"))
  return _Counting(ds, guard)


def _random_access_row(source, row: int, task: Task, config: PipelineConfig, what: str):
  """Row `row` of a random-access source, and its guard."""
  n, rows = len(source), config.global_batch_size
  if n < rows:
    raise ConfigError(f"task {task.name!r} split {config.split!r} has {n} examples, fewer than "
                      f"the global batch size {rows}: some batch rows would have no data")
  ds = RowSlice(source, row, rows)
  if config.shuffle:
    ds = EpochShuffle(ds, derive_seed(config.seed, task.name, row), task.shuffle_buffer_size)
  ds = guard = _EmptyRowGuard(ds, what)
  # No per-row read threads (InOrder): a process runs many rows, and threads per row cost
  # more than they save on in-memory preprocessing.
  return InOrder(ds, config.num_epochs), guard


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


def assemble_batch(rows: list[int], examples: Mapping[int, dict | None]) -> dict[str, np.ndarray]:
  """Stacks the rows' examples in row order. A finished row (None: finite epochs) becomes an
  all-zero row (segment ids and loss weights 0) until every row is finished; then
  StopIteration. Rows hold different numbers of examples, so no example is dropped."""
  present = [ex for ex in examples.values() if ex is not None]
  if not present:
    raise StopIteration
  blank = {k: np.zeros_like(v) for k, v in present[0].items()}
  ordered = [blank if examples[r] is None else examples[r] for r in rows]
  # np.array of equal-shaped rows: the same array as np.stack, in a third of the time.
  return {k: np.array([ex[k] for ex in ordered]) for k in present[0]}


def with_data(state: dict[str, Any], data) -> dict[str, Any]:
  """A state with the identity of the files it points into (identity.py), when known."""
  return {**state, "data": data()} if data is not None else state


def check_state(config: PipelineConfig, fingerprint_: str, rows, state: Mapping[str, Any],
                data=None) -> None:
  """A saved state fits this run: same seed, global batch size, task, split, lengths and
  converter, every row of ours present, and (data: the current identity.data_identity, a
  callable) the same files, unless config.accept_data_changes."""
  for key in ("global_batch_size", "seed"):
    if state[key] != getattr(config, key):
      raise ConfigError(f"data state was saved with {key}={state[key]}, this run has "
                        f"{getattr(config, key)}: the batch sequence would differ")
  if state.get("fingerprint") != fingerprint_:
    raise ConfigError(f"data state was saved for {state.get('fingerprint')}, this run reads "
                      f"{fingerprint_}: restoring it would skip or repeat examples")
  missing = [r for r in rows if str(r) not in state["rows"]]
  if missing:
    raise ValueError(f"data state lacks rows {missing[:5]}... (merge every process's state)")
  if data is not None and not config.accept_data_changes:
    identity.check_unchanged(state.get("data"), data())
