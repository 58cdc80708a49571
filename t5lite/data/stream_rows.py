"""A batch row's stream over a streamed source: its own shards, a bounded shuffle, a small state.

Row r of R reads shards r, r + R, r + 2R, ... whole when there are at least R shards (so the
processes owning disjoint rows read disjoint files, together every file once per epoch).
With fewer shards than rows, the rows sharing shard s = r mod S split its records: row r
reads every c-th record from the (r // S)-th, c being the number of rows on that shard.
Each epoch visits the row's shards in an order drawn from (seed, epoch), and shuffles the
examples within consecutive windows of `window` examples (a window may span two shards),
from (seed, epoch, window): memory is one window of parsed examples per row plus one open
shard. Without shuffling, examples come in shard order.

The state is five integers: {"epoch", "unit" (position in the epoch's shard order),
"record" (the row's records of that shard read before the current window), "window",
"emitted" (examples of the window already returned)}. Restoring reopens the shard, skips to
the window's start, reads the window again and continues after what was returned: the same
examples, in the same order, as an uninterrupted run, on any number of processes.
"""
from __future__ import annotations

import dataclasses
import sys

import grain
import numpy as np

from t5lite.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Unit:
  """Records offset, offset + stride, ... of one shard."""
  shard: int
  stride: int = 1
  offset: int = 0


def row_units(num_shards: int, row: int, rows: int) -> list[Unit]:
  """The parts of the shards that row `row` of `rows` reads.

  Example: 5 shards, 2 rows -> row 0 reads shards 0, 2, 4 and row 1 shards 1, 3; 2 shards,
  5 rows -> row 3 reads shard 1 from record 1 on, every 2nd (rows 1 and 3 share it).
  """
  if num_shards >= rows:
    return [Unit(s) for s in range(row, num_shards, rows)]
  shard = row % num_shards
  return [Unit(shard, len(range(shard, rows, num_shards)), row // num_shards)]


class _StreamRowIterator(grain.DatasetIterator):

  def __init__(self, parent: "StreamRow"):
    super().__init__()
    self._row = parent
    self._epoch = self._unit = self._record = self._window = self._emitted = 0
    self._examples: list | None = None  # the current window, in its shuffled order
    self._reader, self._reader_at = None, None  # the open shard and where it stands
    self._next_start = (0, 0)  # (unit, record) after the current window
    self._orders: dict[int, list[int]] = {}

  def _order(self, epoch: int) -> list[int]:
    """The epoch's order of the row's shards (kept for the current epoch only)."""
    if epoch not in self._orders:
      units = len(self._row.units)
      self._orders = {epoch: np.random.default_rng([self._row.seed, epoch]).permutation(
          units).tolist() if self._row.shuffle else list(range(units))}
    return self._orders[epoch]

  def _read(self, unit: int, record: int):
    """The next example from position (unit, record) of this epoch's order, or None at
    the end of the epoch; keeps one shard open and reads it sequentially."""
    order = self._order(self._epoch)
    while unit < len(order):
      if self._reader_at != (self._epoch, unit, record):
        u = self._row.units[order[unit]]
        self._reader = self._row.source.examples(u.shard, stride=u.stride, offset=u.offset,
                                                 skip=record)
      example = next(self._reader, None)
      if example is not None:
        self._reader_at = (self._epoch, unit, record + 1)
        return example, unit, record + 1
      unit, record, self._reader_at = unit + 1, 0, None
    return None, unit, record

  def _fill(self) -> None:
    """Reads the window starting at (self._unit, self._record)."""
    examples, (unit, record) = [], (self._unit, self._record)
    while len(examples) < self._row.window:
      example, unit, record = self._read(unit, record)
      if example is None:
        break
      examples.append(example)
    self._row.reads += len(examples)
    if self._row.shuffle and examples:
      rng = np.random.default_rng([self._row.seed, self._epoch, self._window])
      examples = [examples[i] for i in rng.permutation(len(examples))]
    self._examples, self._next_start = examples, (unit, record)

  def __next__(self):
    while True:
      if self._examples is None:
        self._fill()
      if self._emitted < len(self._examples):
        self._emitted += 1
        return self._examples[self._emitted - 1]
      if not self._examples:  # the epoch is over
        if self._unit == 0 and self._record == 0 and self._window == 0 and \
            not self._row.empty_ok:
          raise ConfigError(f"{self._row.what} got no example from its shards "
                            f"{self._row.units}: fewer examples than batch rows?")
        self._row.check_progress()
        self._epoch += 1
        if self._epoch >= self._row.num_epochs:
          raise StopIteration
        self._unit = self._record = self._window = 0
      else:
        (self._unit, self._record), self._window = self._next_start, self._window + 1
      self._emitted, self._examples = 0, None

  def get_state(self):
    return {"epoch": self._epoch, "unit": self._unit, "record": self._record,
            "window": self._window, "emitted": self._emitted}

  def set_state(self, state):
    if not {"epoch", "unit", "record", "window", "emitted"} <= set(state):
      raise ConfigError(
          f"{self._row.what}: this data state was saved by an indexed reading of the task "
          f"(keys {sorted(state)}), and its source is now streamed (or USE_CACHED_TASKS "
          "changed): resume with the setup that saved it, or train in a new MODEL_DIR")
    self._epoch, self._unit, self._record = state["epoch"], state["unit"], state["record"]
    self._window, self._emitted = state["window"], state["emitted"]
    self._examples, self._reader, self._reader_at = None, None, None


class StreamRow(grain.IterDataset):
  """Row `row` of `rows` of a streamed source (see the module docstring), for `num_epochs`
  epochs (None: for ever). `reads` and `outputs` (counted by the caller) let a row whose
  preprocessing drops everything fail clearly instead of reading for ever."""

  def __init__(self, source, row: int, rows: int, *, seed: int, window: int, shuffle: bool,
               num_epochs: int | None, what: str, empty_ok: bool = False):
    super().__init__()
    if window < 1:
      raise ConfigError(f"{what}: the shuffle window must be >= 1 examples, got {window}")
    if not source.num_shards:
      raise ConfigError(f"{what}: {source!r} has no shards")
    self.empty_ok = empty_ok  # an epoch without examples ends the row instead of failing
    self.source, self.units = source, row_units(source.num_shards, row, rows)
    self.seed, self.window, self.shuffle, self.what = seed, window, shuffle, what
    self.num_epochs = sys.maxsize if num_epochs is None else num_epochs
    self.reads, self.outputs, self._epochs_seen = 0, 0, 0

  def check_progress(self) -> None:
    """Called at each epoch's end: two whole epochs with no output is an error."""
    self._epochs_seen += 1
    if not self.outputs and self._epochs_seen >= 2 and self.reads >= 1024:
      raise ConfigError(f"{self.what}: preprocessing dropped every one of its source examples "
                        f"(read {self.reads}). Use a smaller global batch size or more data.")

  def __iter__(self):
    return _StreamRowIterator(self)

  def __str__(self) -> str:
    return f"StreamRow({self.source!r}, units={self.units})"
