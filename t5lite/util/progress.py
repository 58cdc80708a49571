"""Progress of the long jobs (eval, infer, export, import, cache, data builds, bench): a bar on
a terminal, one plain line per period in a log.

    with progress.Progress("infer", total=len(texts), unit="input") as bar:
      for chunk in chunks:
        ...
        bar.update(len(chunk))

On a terminal (stderr is a TTY) it is tqdm's bar, with the count, the rate and, where the total
is known, the ETA. Where stderr is not a terminal (a pod's log, a CI job, `2> file`), a bar's
carriage returns would pile up into one unreadable line, so it writes a plain line every
T5LITE_PROGRESS_PERIOD seconds (default 30) and one at the end, e.g.

    infer: 120/500 inputs (24%), 12.3 inputs/s, ETA 31s

A job of a few long steps with no count (reading a checkpoint, writing shards) says each step
that runs longer than a few seconds as it begins and ends, with its time (`stage`):

    export: reading the checkpoint ...
    export: reading the checkpoint: done in 12s

A job shorter than the period writes only its last line. T5LITE_PROGRESS=0 turns both off;
`enabled=False` too (the processes other than process 0 of a pod job). tqdm draws the bar; the
plain lines are written here because tqdm writes even to a file as a bar redrawn in place.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Iterator, TextIO

PERIOD_ENV = "T5LITE_PROGRESS_PERIOD"
SWITCH_ENV = "T5LITE_PROGRESS"
DEFAULT_PERIOD_S = 30.0


def format_duration(seconds: float) -> str:
  """3725 -> '1h02m05s', 192 -> '3m12s', 7 -> '7s'."""
  seconds = max(0, int(round(seconds)))
  hours, rest = divmod(seconds, 3600)
  minutes, secs = divmod(rest, 60)
  if hours:
    return f"{hours}h{minutes:02d}m{secs:02d}s"
  if minutes:
    return f"{minutes}m{secs:02d}s"
  return f"{secs}s"


def _period() -> float:
  try:
    return max(0.0, float(os.environ.get(PERIOD_ENV, DEFAULT_PERIOD_S)))
  except ValueError:
    return DEFAULT_PERIOD_S


class Progress:
  """A count of done items of a job (module docstring). total: None when unknown (no
  percentage and no ETA then)."""

  def __init__(self, desc: str, total: int | None = None, unit: str = "item", *,
               enabled: bool = True, stream: TextIO | None = None):
    self.desc, self.total, self.unit = desc, total, unit
    self.stream = stream or sys.stderr
    self.count = 0
    self._written = 0  # the count of the last line written
    self._start = self._last = time.monotonic()
    self._bar = None
    self.enabled = enabled and os.environ.get(SWITCH_ENV, "1") != "0"
    if self.enabled and _isatty(self.stream):
      import tqdm
      self._bar = tqdm.tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                            dynamic_ncols=True)
    self.period = _period()

  def done(self, count: int, total: int | None = None) -> None:
    """Sets the count (and the total, when it becomes known) to these values."""
    if total is not None and total != self.total:
      self.total = total
      if self._bar is not None:
        self._bar.total = total
        self._bar.refresh()
    self.update(count - self.count)

  def update(self, n: int = 1) -> None:
    self.count += n
    if self._bar is not None:
      self._bar.update(n)
    elif self.enabled and time.monotonic() - self._last >= self.period:
      self._write()

  def line(self) -> str:
    """The plain progress line (what a log gets)."""
    elapsed = time.monotonic() - self._start
    units = self.unit if self.unit.endswith("s") else self.unit + "s"
    parts = [f"{self.desc}: {self.count:,}" + (f"/{self.total:,}" if self.total else "")
             + f" {units}" + (f" ({100 * self.count / self.total:.0f}%)" if self.total else "")]
    if elapsed > 0 and self.count:
      rate = self.count / elapsed
      parts.append(f"{rate:,.1f} {units}/s")
      if self.total and self.count < self.total:
        parts.append(f"ETA {format_duration((self.total - self.count) / rate)}")
    if self.total is None or self.count >= self.total:
      parts.append(f"in {format_duration(elapsed)}")
    return ", ".join(parts)

  def _write(self) -> None:
    self._last, self._written = time.monotonic(), self.count
    print(self.line(), file=self.stream, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    elif self.enabled and self.count != self._written:
      self._write()
    self.enabled = False

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _isatty(stream) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):  # no isatty, or closed
    return False


STAGE_QUIET_S = 2.0


@contextlib.contextmanager
def stage(desc: str, *, enabled: bool = True, stream: TextIO | None = None,
          quiet_s: float = STAGE_QUIET_S) -> Iterator[None]:
  """Says `desc ...` once the block has run quiet_s seconds, and `desc: done in Ns` when it
  then ends without an error (an error says itself). A block shorter than quiet_s says
  nothing: a refused input stays a one-line error, a quick job prints only its result."""
  stream = stream or sys.stderr
  enabled = enabled and os.environ.get(SWITCH_ENV, "1") != "0"
  start = time.monotonic()
  said = []  # the first line, once written (under the lock: never after the last one)
  lock = threading.Lock()

  def begin() -> None:
    with lock:
      print(f"{desc} ...", file=stream, flush=True)
      said.append(True)

  timer = threading.Timer(quiet_s, begin) if enabled else None
  if timer is not None:
    timer.daemon = True
    timer.start()
  try:
    yield
  finally:
    if timer is not None:
      timer.cancel()
      timer.join()  # a first line being written is written before what follows
  if said:
    with lock:
      print(f"{desc}: done in {format_duration(time.monotonic() - start)}", file=stream,
            flush=True)
