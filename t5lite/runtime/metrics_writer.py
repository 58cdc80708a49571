"""Metric sinks of the train loop: MODEL_DIR/metrics.jsonl, TensorBoard events, a progress line.

metrics.jsonl holds one JSON object per `write` call, e.g.
  {"step": 100, "loss": 3.41, "learning_rate": 0.01}
  {"step": 200, "loss": 3.02, "eval/glue_cola/accuracy": 0.69}
where `loss` is that step's training loss (not a running average) and eval figures use keys
`eval/<task>/<metric>`. TensorBoard events go to MODEL_DIR/tensorboard/ through
tensorboardX, so no TensorFlow is needed. On a bucket MODEL_DIR (gs://, s3://), which has no
append, metrics.jsonl is uploaded whole at every write (one object, atomic; a few hundred
bytes a row), as tensorboardX does with its event file there. With a WandbConfig the rows
go to Weights & Biases too (t5lite.runtime.wandb_sink).
"""
from __future__ import annotations

import collections
import errno
import json
import math
import os
import re
import sys
from typing import Any, Mapping

from t5lite.runtime import integrity
from t5lite.runtime.wandb_sink import WandbConfig, WandbRun
from t5lite.util import atomic, paths, storage
from t5lite.util.progress import format_duration

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _to_float(value: Any) -> float:
  """A Python float from a Python / numpy / jax scalar (json cannot encode the array types)."""
  return float(value.item() if hasattr(value, "item") else value)


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported on first use (non-primary hosts never load it).

  tensorboardX.writer imports torch when torch is installed (most machines with HF
  transformers have it), only to accept torch tensors, which t5lite never passes: 1.1 s of
  every train start on a 2-core EPYC. Unless torch is loaded already, the import runs with
  torch hidden (a None entry in sys.modules makes `import torch` raise ImportError, which
  tensorboardX handles); loading torch later in the process works as usual.
  """
  if "tensorboardX.writer" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter
  else:
    sys.modules["torch"] = None
    try:
      from tensorboardX import SummaryWriter
    finally:
      if sys.modules.get("torch", 0) is None:
        del sys.modules["torch"]
  from tensorboardX import record_writer
  for scheme in storage.SCHEMES:
    record_writer.register_writer_factory(scheme, _BucketEventFiles())
  return SummaryWriter


class _BucketEventFiles:
  """tensorboardX's writer factory for gs:// and s3:// event files, through t5lite's own
  storage calls. tensorboardX ships its own, but its GCS writer uploads again when garbage
  collected after close (at interpreter exit: a 120 s retry if the bucket is unreachable),
  and its S3 one reads the endpoint from S3_ENDPOINT only."""

  def open(self, path: str) -> "_BucketAppender":
    return _BucketAppender(path, binary=True)

  def directory_check(self, path: str) -> None:
    del path  # no folders in a bucket


class MetricsWriter:
  """Appends scalars to metrics.jsonl and TensorBoard, on the primary process only.

  Every host runs the same loop, but only one may write MODEL_DIR files, so on the others
  (`is_primary=False`) every method is a no-op and nothing is created.
  """

  def __init__(self, model_dir: str | os.PathLike, *, is_primary: bool = True,
               resume_step: int | None = None, wandb: WandbConfig | None = None,
               run_config: Mapping[str, Any] | None = None):
    """resume_step: the checkpoint step a resumed run starts from. Rows of later steps (logged
    by the interrupted run after that checkpoint) are dropped, as the run logs those steps
    again; TensorBoard is told the same (purge_step). wandb: also log to this W&B run, whose
    config is run_config."""
    self.model_dir = os.fspath(model_dir)
    self.is_primary = is_primary
    self._jsonl = None
    self._tb = None
    self._wandb = None
    if not is_primary:
      return
    paths.makedirs(self.model_dir)
    path = paths.join(self.model_dir, METRICS_FILE)
    if resume_step is not None:
      _drop_rows_after(path, resume_step)
    if wandb is not None:  # before the files open: a missing wandb is refused first
      self._wandb = WandbRun(wandb, self.model_dir, run_config or {}, _rows(path),
                             resume_step)
    # Append, so that a run resumed from a checkpoint keeps the earlier history.
    self._jsonl = _BucketAppender(path) if paths.is_url(path) else open(path, "a",
                                                                         encoding="utf-8")
    self._tb = _summary_writer_class()(logdir=paths.join(self.model_dir, TENSORBOARD_DIR),
                             purge_step=None if resume_step is None else resume_step + 1)

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Logs `scalars` (name -> number) at `step`: one JSONL line and one TB scalar each."""
    if not self.is_primary:
      return
    if self._jsonl is None:
      raise RuntimeError("MetricsWriter.write after close()")
    step = int(step)
    values = {name: _to_float(value) for name, value in scalars.items()}
    # NaN/inf are not valid JSON; write null so that every line stays parseable.
    record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
    try:
      self._jsonl.write(json.dumps(record) + "\n")
      # Flushed per call so `t5lite plot` and `tail -f` see a live run, and a crash loses
      # nothing.
      self._jsonl.flush()
      for name, value in values.items():
        self._tb.add_scalar(name, value, global_step=step)
      self._tb.flush()
      if self._wandb is not None:
        self._wandb.log(step, values)
    except OSError as e:  # a write error names no file (a full disk): name the folder
      raise OSError(e.errno, e.strerror, self.model_dir) from e
    except Exception as e:  # a bucket that failed past its client's retries: as an OSError
      if not storage.is_service_error(e):
        raise
      raise OSError(errno.EIO, f"the bucket failed: {integrity.first_line(e)}", self.model_dir) from e

  def summarize(self, figures: Mapping[str, Any]) -> None:
    """The run's figures at its end, for trackers that keep a summary (W&B)."""
    if self._wandb is not None:
      self._wandb.summarize(figures)

  def close(self, failed: bool = False, preempted: bool = False) -> None:
    jsonl, tb, self._jsonl, self._tb = self._jsonl, self._tb, None, None
    tracker, self._wandb = self._wandb, None
    try:
      if jsonl is not None:
        jsonl.close()
      if tb is not None:
        tb.close()
    except OSError as e:  # the last flush (a full disk): name the folder
      raise OSError(e.errno, e.strerror, self.model_dir) from e
    finally:
      if tracker is not None:
        tracker.finish(failed, preempted)

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, exc_type, *exc) -> None:
    self.close(failed=exc_type is not None)


def _rows(path: str) -> list[dict]:
  """The rows of a metrics.jsonl, a torn last line left out."""
  if not paths.isfile(path):
    return []
  rows = []
  for line in paths.read_text(path).splitlines():
    try:
      rows.append(json.loads(line))
    except ValueError:  # torn by a kill mid-write
      continue
  return [row for row in rows if isinstance(row, dict) and "step" in row]


def _drop_rows_after(path: str, step: int) -> None:
  """Rewrites metrics.jsonl without the rows of steps after `step` (atomically). A torn last
  line (a kill mid-write) is dropped too."""
  if not paths.isfile(path):
    return
  kept, dropped = [], 0
  for line in re.findall(r"[^\n]*\n|[^\n]+$", paths.read_text(path)):  # a torn one: no \n
    try:
      row_step = int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
      dropped += 1  # torn or not a metrics row
      continue
    if row_step > step:
      dropped += 1
    else:
      kept.append(line if line.endswith("\n") else line + "\n")
  if dropped:
    atomic.write_file(path, "".join(kept))  # whole or not at all: the history stays


class _BucketAppender:
  """A file opened for append, on a bucket: the object is written whole at each flush (a
  bucket has no append), and only when something was written since."""

  def __init__(self, url: str, binary: bool = False):
    self.url = url
    self._data = (paths.read_bytes(url) if paths.isfile(url) else b"") if binary else (
        paths.read_text(url) if paths.isfile(url) else "")
    self._dirty = False

  def write(self, data) -> None:
    self._data += data
    self._dirty = True

  def flush(self) -> None:
    if self._dirty:
      atomic.write_file(self.url, self._data)
      self._dirty = False

  def close(self) -> None:
    self.flush()


class ProgressLine:
  """Formats the live one-line progress of a run; the loop prints it (no I/O here).

  `update(step, loss, lr, tokens, seconds)` takes the tokens and wall seconds of the steps
  since the previous call (or since `start_step`, the step a resumed run starts from).
  tokens/s and ETA use a moving average over the last `window` calls, so one slow interval
  (a checkpoint, a recompile) neither spikes nor stalls the display.

    >>> p = ProgressLine(1000)
    >>> p.update(120, 3.4123, 1e-2, tokens=296_280, seconds=24.0, mfu=0.412)
    'step 120/1000  loss 3.412  lr 1.0e-02  12,345 tok/s  MFU 41.2%  ETA 2m56s'
  """

  def __init__(self, total_steps: int, *, start_step: int = 0, window: int = 20):
    self.total_steps = int(total_steps)
    self._last_step = int(start_step)
    # (steps, tokens, seconds) of each recent update.
    self._recent: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=window)

  def update(self, step: int, loss: float, lr: float, tokens: float, seconds: float,
             mfu: float | None = None) -> str:
    """Records the interval ending at `step` and returns the formatted line."""
    step = int(step)
    # Steps covered by this interval: the gap since the previous call, as the loop may log
    # only every N steps (at least 1, should a step be reported twice).
    steps = max(1, step - self._last_step)
    self._last_step = step
    self._recent.append((steps, float(tokens), float(seconds)))
    total_steps = sum(s for s, _, _ in self._recent)
    total_tokens = sum(t for _, t, _ in self._recent)
    total_seconds = sum(s for _, _, s in self._recent)

    parts = [f"step {step}/{self.total_steps}", f"loss {_to_float(loss):.3f}",
             f"lr {_to_float(lr):.1e}"]
    if total_seconds > 0:
      parts.append(f"{total_tokens / total_seconds:,.0f} tok/s")
    if mfu is not None:
      parts.append(f"MFU {100 * mfu:.1f}%")
    if total_seconds > 0 and step < self.total_steps:
      seconds_per_step = total_seconds / total_steps
      parts.append(f"ETA {format_duration(seconds_per_step * (self.total_steps - step))}")
    return "  ".join(parts)
