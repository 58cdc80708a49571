"""Packing examples into fixed-length rows: a fast, exactly checkpointable grain IterDataset.

The feature converters (converters.py) describe rows as *slots*, each a row length and the
features laid in it, e.g. ((("inputs",), 512), (("targets",), 114)) for T5, or one slot
(("targets", "causal", "loss"), I + T) for a prefix LM. Features of one slot are aligned
(equal lengths within an example) and share the slot's `<lead>_segment_ids` and
`<lead>_positions`, lead = its first feature. An example gets one segment id (1-based per
row, 0 = padding) in every slot; positions restart at 0 per example.

PackIterDataset(parent, slots=..., prepare=..., finalize=..., num_packing_bins=N, seed=...):
  1. prepare(example) -> a tuple of trimmed 1-D integer arrays, one per feature in slot
     order; an example whose slots are all empty is skipped.
  2. Best fit over N bins: the example goes into the fullest open bin (most used positions,
     summed over slots; the first of equals) where every slot has room, else into a new
     bin. An example that fits no bin when all N are open closes the group: its rows are
     emitted and the example starts the next group. This is grain's BestFitPackIterDataset
     (same groups, same rows), written for speed: buffers filled by slice assignment, no
     per-example parent state, and a fast path: each slot keeps an upper bound of the room
     left in its open bins, so an example longer than that (e.g. span corruption inputs of
     exactly the inputs length, once every open bin holds some inputs) opens a new bin
     without a scan. Best rather than first fit: first fit (stop at the first bin with room)
     saves only ~2% of the per-example time on variable-length data (the scan is a few
     hundred ns per open bin, and skipped on the fast path) and packs a little looser
     (random T5 lengths, 16 bins: 0.834 vs 0.823 of positions real; the same 0.950 for LM
     rows; equal with 1 or 4 bins).
  3. finalize({"<f>": (rows, length) int32, "<lead>_segment_ids": ..., "<lead>_positions":
     ...}) -> model features of the whole group at once (vectorised); rows are emitted one
     at a time (views of the group's arrays), in an order shuffled by (seed, group index),
     so that the fullest rows do not all come first (~15 us a group, ~1 us a row at 16 bins).

State: {"parent": A, "skip": k, "group": g, "next_row": r}: the current group is the g-th
(0-based), its first example is the element read after skipping k elements from parent
state A, and r of its rows were emitted. A is the parent's state right after the first
example of the group before (the initial state for group 0): taken once per group, never
per example, as a deep pipeline's get_state() costs. Restoring sets A, reads k elements
again (the rest of the group before), re-packs the group and skips r rows: the same rows follow.
JSON-serialisable when the parent's state is.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np

from t5lite.errors import ConfigError

Slots = Sequence[tuple[Sequence[str], int]]  # ((feature names, lead first), row length), ...
Prepare = Callable[[Any], Sequence[np.ndarray]]
Finalize = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class _Layout:
  """Slots, checked and indexed once per dataset (see the module docstring)."""

  def __init__(self, slots: Slots):
    self.slots = tuple((tuple(names), int(length)) for names, length in slots)
    if not self.slots or any(not names or length < 1 for names, length in self.slots):
      raise ValueError(f"slots need feature names and positive lengths, got {slots}")
    self.widths = tuple(len(names) for names, _ in self.slots)
    self.leads = tuple(sum(self.widths[:k]) for k in range(len(self.slots)))
    self.arange = np.arange(max(length for _, length in self.slots), dtype=np.int32)

  def sizes(self, prepared: Sequence[np.ndarray]) -> list[int]:
    """Each slot's length in a prepared example (its lead feature's)."""
    return [len(prepared[i]) for i in self.leads]


class _Bins:
  """The rows of one group being filled. Per slot one int32 buffer (features + 2, bins,
  length): the features, then segment ids, then positions; `room[k][b]` = free positions."""

  def __init__(self, layout: _Layout, num_bins: int):
    self.layout, self.num_bins = layout, num_bins
    self.buffers = [np.zeros((len(names) + 2, num_bins, length), np.int32)
                    for names, length in layout.slots]
    self.room = [[length] * num_bins for _, length in layout.slots]
    self.bound = [-1] * len(layout.slots)  # >= the room of every open bin, per slot
    self.count = [0] * num_bins  # examples per bin (= its last segment id)
    self.open = 0  # bins holding examples: always the first ones
    self._plan = tuple(zip(range(len(layout.slots)), layout.widths, layout.leads,
                           (length for _, length in layout.slots), self.buffers, self.room))

  def _best(self, sizes: Sequence[int]) -> int:
    """The fullest open bin (least room over all slots; the first of equals) with room for
    the example in every slot, or -1."""
    room, best, least = self.room, -1, None
    if len(sizes) == 1:
      (size,), (free,) = sizes, room
      for b in range(self.open):
        if size <= free[b] and (least is None or free[b] < least):
          best, least = b, free[b]
    elif len(sizes) == 2:
      (s0, s1), (r0, r1) = sizes, room
      for b in range(self.open):
        if s0 <= r0[b] and s1 <= r1[b] and (least is None or r0[b] + r1[b] < least):
          best, least = b, r0[b] + r1[b]
    else:
      for b in range(self.open):
        if all(s <= r[b] for s, r in zip(sizes, room)):
          free = sum(r[b] for r in room)
          if least is None or free < least:
            best, least = b, free
    if best < 0:  # no open bin fits: make the bounds exact for the next examples
      self.bound = [max(r[:self.open], default=-1) for r in room]
    return best

  def add(self, prepared: Sequence[np.ndarray], sizes: Sequence[int]) -> bool:
    """Puts the example in a bin; False (nothing changed) when it fits none."""
    for size, bound in zip(sizes, self.bound):
      if size > bound:  # fast path: no open bin has that much room, no need to search
        b = -1
        break
    else:
      b = self._best(sizes)
    if b < 0:
      if self.open == self.num_bins:
        return False
      b, self.open = self.open, self.open + 1
    segment = self.count[b] + 1
    self.count[b] = segment
    arange, bound = self.layout.arange, self.bound
    for (k, width, first, length, buffer, free), size in zip(self._plan, sizes):
      if size:
        start = length - free[b]
        end = start + size
        for j in range(width):
          buffer[j, b, start:end] = prepared[first + j]  # cast to int32 here
        buffer[width, b, start:end] = segment
        buffer[width + 1, b, start:end] = arange[:size]
        free[b] -= size
      if segment == 1 and free[b] > bound[k]:  # a newly opened bin
        bound[k] = free[b]
    return True

  def arrays(self) -> dict[str, np.ndarray]:
    """The open bins' rows: {"<f>": ..., "<lead>_segment_ids": ..., "<lead>_positions": ...}."""
    out, n = {}, self.open
    for (names, _), buffer in zip(self.layout.slots, self.buffers):
      for j, name in enumerate(names):
        out[name] = buffer[j, :n]
      out[f"{names[0]}_segment_ids"] = buffer[len(names), :n]
      out[f"{names[0]}_positions"] = buffer[len(names) + 1, :n]
    return out


class _PackIterator(grain.DatasetIterator):
  """See PackIterDataset and the module docstring (state)."""

  def __init__(self, parent: grain.DatasetIterator, ds: "PackIterDataset"):
    super().__init__(parent)
    self._ds = ds
    self._read_parent = parent.__next__
    # The parent's position: `_read` elements after its state `_anchor`.
    self._anchor, self._read = parent.get_state(), 0
    self._start = (self._anchor, 0)  # where the current group's first example is read
    self._next_start = None  # where the next group's is (known once the current is packed)
    self._group, self._next_row = 0, 0
    self._rows: list[dict[str, np.ndarray]] = []  # the current group's, in emission order
    self._pending = None  # (prepared, sizes) of the next group's first example

  def get_state(self) -> dict[str, Any]:
    anchor, skip = self._start
    return {"parent": anchor, "skip": skip, "group": self._group, "next_row": self._next_row}

  def set_state(self, state: Mapping[str, Any]) -> None:
    if "skip" not in state:
      raise ConfigError("this packed data state was not saved by "
                        "t5lite.data.converters.packing (an older "
                        f"t5lite packed with grain's packer): keys {sorted(state)}")
    anchor, skip = state["parent"], int(state["skip"])
    self._parent.set_state(anchor)
    self._anchor, self._read = anchor, 0
    while self._read < skip:  # re-read up to the group's first example
      try:
        self._read_parent()
      except StopIteration:
        break
      self._read += 1
    self._start, self._next_start = (anchor, skip), None
    self._group, self._next_row = int(state["group"]), int(state["next_row"])
    self._rows, self._pending = [], None  # the group is re-packed on the next next()

  def __next__(self) -> dict[str, np.ndarray]:
    if not self._rows:
      self._rows = self._pack()  # raises StopIteration at the end
    row = self._rows[self._next_row]
    self._next_row += 1
    if self._next_row == len(self._rows):  # the state moves on to the next group
      self._rows, self._next_row = [], 0
      self._start, self._group = self._next_start, self._group + 1
    return row

  def _pack(self) -> list[dict[str, np.ndarray]]:
    """Fills a group of bins; its rows, in emission order."""
    ds, layout = self._ds, self._ds.layout
    bins = _Bins(layout, ds.num_packing_bins)
    if self._pending is not None:
      bins.add(*self._pending)  # fits: the bins are empty
      self._pending = None
    prepare, leads, read_parent = ds.prepare, layout.leads, self._read_parent
    while True:
      try:
        example = read_parent()
      except StopIteration:
        self._next_start = (self._anchor, self._read)
        break
      self._read += 1
      prepared = prepare(example)
      sizes = [len(prepared[i]) for i in leads]
      if not any(sizes):
        continue  # nothing to train on
      if not bins.add(prepared, sizes):  # the group is complete; this example starts the next
        self._pending = (prepared, sizes)
        self._next_start = (self._anchor, self._read - 1)
        self._anchor, self._read = self._parent.get_state(), 0
        break
    if not bins.open:
      raise StopIteration
    features = ds.finalize(bins.arrays())
    keys, values = list(features), list(features.values())
    order = list(range(bins.open))
    random.Random(ds.seed * 2**32 + self._group).shuffle(order)
    return [dict(zip(keys, [v[i] for v in values])) for i in order]


class PackIterDataset(grain.IterDataset):
  """Packed rows of `parent`'s examples; see the module docstring.

  slots: ((feature names, lead first), row length) per slot; prepare: a parent element ->
  one trimmed 1-D integer array per feature, in slot order (cast to int32 when written);
  finalize: the group's packed arrays -> the model features of its rows. Both are pickled
  with the pipeline for grain workers: bound methods and partials, not lambdas.
  """

  def __init__(self, parent: grain.IterDataset, *, slots: Slots, prepare: Prepare,
               finalize: Finalize, num_packing_bins: int, seed: int = 0):
    super().__init__(parent)
    if num_packing_bins < 1:
      raise ConfigError(f"num_packing_bins must be >= 1, got {num_packing_bins}")
    self.layout = _Layout(slots)
    self.prepare, self.finalize = prepare, finalize
    self.num_packing_bins, self.seed = int(num_packing_bins), int(seed)

  def __iter__(self) -> _PackIterator:
    return _PackIterator(self._parent.__iter__(), self)

  def __str__(self) -> str:
    return (f"PackIterDataset(slots={self.layout.slots}, "
            f"num_packing_bins={self.num_packing_bins})")


class _PadIterator(grain.DatasetIterator):
  """See PadIterDataset. Holds nothing back: its state is the parent's."""

  def __init__(self, parent: grain.DatasetIterator, ds: "PadIterDataset"):
    super().__init__(parent)
    self._ds = ds
    self._read_parent = parent.__next__

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: Mapping[str, Any]) -> None:
    self._parent.set_state(state)

  def __next__(self) -> dict[str, np.ndarray]:
    ds, layout = self._ds, self._ds.layout
    while True:
      prepared = ds.prepare(self._read_parent())
      sizes = layout.sizes(prepared)
      if any(sizes):  # else nothing to train on
        break
    bins = _Bins(layout, 1)
    bins.add(prepared, sizes)
    return {k: v[0] for k, v in ds.finalize(bins.arrays()).items()}


class PadIterDataset(PackIterDataset):
  """Unpacked: each example alone in a row, laid out as PackIterDataset lays it (same keys,
  segment id 1, padding 0); examples with all slots empty are skipped."""

  def __init__(self, parent: grain.IterDataset, *, slots: Slots, prepare: Prepare,
               finalize: Finalize):
    super().__init__(parent, slots=slots, prepare=prepare, finalize=finalize,
                     num_packing_bins=1)

  def __iter__(self) -> _PadIterator:
    return _PadIterator(self._parent.__iter__(), self)

  def __str__(self) -> str:
    return f"PadIterDataset(slots={self.layout.slots})"
