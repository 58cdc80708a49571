"""Worker processes for the batch pipeline: each worker computes a fixed subset of the rows.

Worker w of W owns rows w, w + W, ... of this process's rows and sends, per step, its rows'
examples together with each row's state *after* that example. The main process assembles
batches in row order and keeps the state of what it actually handed out, so prefetching
never leaks into checkpoints: get_state() is exactly what the single-process iterator
would report, and restoring works with any number of workers (or none).
"""
from __future__ import annotations

import multiprocessing
import queue as queue_lib
import traceback
from typing import Any, Mapping

import cloudpickle
import numpy as np

from t5lite.data.rows import (PipelineConfig, assemble_batch, check_state, row_dataset,
                              with_data)

_DONE = "done"


def _work(payload: bytes, rows: list[int], state: Mapping[str, Any] | None, out) -> None:
  """Child process: build the rows' pipelines and stream (examples, states) per step; a
  finished row sends None (finite epochs) until all of the worker's rows are finished."""
  try:
    # The payload is this process's own pipeline, pickled by the parent: not an outside file.
    item, config, converter = cloudpickle.loads(payload)
    iterators = {r: iter(row_dataset(item, r, config, converter)) for r in rows}
    if state is not None:
      for r in rows:
        iterators[r].set_state(state["rows"][str(r)])
    finished: set[int] = set()
    while len(finished) < len(rows):
      examples = {}
      for r in rows:
        try:
          examples[r] = None if r in finished else next(iterators[r])
        except StopIteration:
          finished.add(r)
          examples[r] = None
      out.put(("ok", (examples, {r: iterators[r].get_state() for r in rows})))
    out.put((_DONE, None))
  except Exception:  # the main process re-raises it with the worker's traceback
    out.put(("error", traceback.format_exc()))


class WorkerBatchIterator:
  """Like pipeline.BatchIterator, with rows computed in `num_workers` spawned processes.

  Workers start on the first next(); set_state() (re)starts them from a state.
  """

  def __init__(self, item, config: PipelineConfig, converter, rows: range, num_workers: int,
               fingerprint: str = "", *, prefetch: int = 4, data=None):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    self.config, self.fingerprint, self.rows = config, fingerprint, list(rows)
    self.data = data  # identity.LazyIdentity of the files read, or None
    self._item, self._converter = item, converter
    self._num_workers, self._prefetch = min(num_workers, len(self.rows)), prefetch
    self._payload = cloudpickle.dumps((item, config, converter))  # tasks may hold closures
    self._states: dict[int, Any] | None = None  # None: the pipelines' initial states
    self._queues, self._processes, self._done = [], [], set()

  def _start(self) -> None:
    state = None if self._states is None else {"rows": {str(r): s for r, s in self._states.items()}}
    context = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
    for w in range(self._num_workers):
      out = context.Queue(maxsize=self._prefetch)
      process = context.Process(target=_work, daemon=True, args=(
          self._payload, self.rows[w::self._num_workers], state, out))
      process.start()
      self._queues.append(out)
      self._processes.append(process)

  def __iter__(self):
    return self

  def _receive(self, worker: int):
    while True:
      try:
        kind, value = self._queues[worker].get(timeout=5)
      except queue_lib.Empty:
        if not self._processes[worker].is_alive():
          raise RuntimeError(f"data worker {worker} died (exit code "
                             f"{self._processes[worker].exitcode})") from None
        continue
      if kind == "error":
        raise RuntimeError(f"data worker {worker} failed:\n{value}")
      if kind == _DONE:
        raise StopIteration
      return value

  def __next__(self) -> dict[str, np.ndarray]:
    if not self._processes:
      self._start()
    examples = {r: None for r in self.rows}
    states = {}
    for worker in range(len(self._queues)):
      if worker in self._done:
        continue
      try:
        rows, row_states = self._receive(worker)
      except StopIteration:
        self._done.add(worker)
        continue
      examples.update(rows)
      states.update(row_states)
    self._states = {**(self._states or {}), **states}
    return assemble_batch(self.rows, examples)

  def get_state(self) -> dict[str, Any]:
    states = self._states
    if states is None:  # nothing taken yet: fresh pipelines' states (built here, cheaply)
      states = {r: iter(row_dataset(self._item, r, self.config, self._converter)).get_state()
                for r in self.rows}
    return with_data({"global_batch_size": self.config.global_batch_size,
                      "seed": self.config.seed, "fingerprint": self.fingerprint,
                      "rows": {str(r): s for r, s in states.items()}}, self.data)

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(self.config, self.fingerprint, self.rows, state, self.data)
    self.close()
    self._states = {r: state["rows"][str(r)] for r in self.rows}

  def close(self) -> None:
    for process in self._processes:
      process.terminate()
    for process in self._processes:
      process.join(timeout=5)
    self._queues, self._processes, self._done = [], [], set()

  def __del__(self):
    try:
      self.close()
    except Exception:  # interpreter shutdown
      pass
