"""Checksums of checkpoint steps, moving damaged steps aside, and the MODEL_DIR's log file.

A committed checkpoint step (MODEL_DIR/checkpoints/<step>/) is sealed once orbax has
committed it (the training loop looks after every step): every file in it (the arrays' data files, orbax's metadata, the data iterator
state) is read back and its CRC32C (google-crc32c) written to `t5lite_checksums.json` in the
step folder, with its size. Every restore verifies the step against that list first, so a
flipped bit, a truncated or a deleted file is found before any array is read, and named:

    CorruptCheckpointError: checkpoint step 120: state/d/8834c0... (array data) fails its
    CRC32C check (saved 0x1c2d..., now 0x90ab...)

What sealing covers: damage after the seal (disk errors, bit rot, a truncation, a careless
copy). A step that orbax committed but that was not sealed yet (the process was killed right
after the commit) is trusted on its first full read by a training run, which then seals it;
read-only paths (eval, infer, export) read it with a warning and do not write.

A damaged step is never deleted: a training run that falls back from it moves it to
checkpoints/<step>.corrupt-N (orbax lists only integer folder names), so the retrained step
can be saved in its place and the damaged files stay there for a post-mortem.

Details that would flood the console (orbax and TensorStore errors, their specs, asyncio
noise) go to MODEL_DIR/t5lite.log; the console gets one line per damaged step.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import sys
import threading
import traceback

import google_crc32c
import jax
import numpy as np

from t5lite.util import atomic, paths, storage
from t5lite.errors import ConfigError

CHECKSUMS_FILE = "t5lite_checksums.json"
LOG_FILE = "t5lite.log"
_BLOCK = 8 << 20  # read files in 8 MiB blocks: memory stays flat whatever the array size
COMMIT_MARKER = storage.COMMIT_MARKER


class CorruptCheckpointError(ConfigError):
  """A committed checkpoint step that cannot be restored: a file fails its checksum, is
  missing or cannot be read, or the restored arrays hold NaN/inf. Not a bug in the code, so
  the CLI reports it in one line (exit 2), like a setup mistake."""


def file_crc32c(path: str) -> int:
  crc = 0
  with paths.open_binary(path) as f:
    while block := f.read(_BLOCK):
      crc = google_crc32c.extend(crc, block)
  return crc


def _files(step_dir: str) -> list[str]:
  """Every file of a step folder (relative paths, '/'-separated), the checksum list aside."""
  return [rel for rel in paths.files_under(step_dir)
          if rel != CHECKSUMS_FILE and not rel.endswith(".tmp")
          and not rel.rsplit("/", 1)[-1].startswith(f".{CHECKSUMS_FILE}.")]  # a seal cut short


def is_sealed(step_dir: str) -> bool:
  return paths.isfile(paths.join(step_dir, CHECKSUMS_FILE))


def seal(step_dir: str) -> None:
  """Writes the checksum list of a committed step (atomically: a kill leaves none)."""
  files = {rel: {"size": paths.size(paths.join(step_dir, rel)),
                 "crc32c": f"{file_crc32c(paths.join(step_dir, rel)):08x}"}
           for rel in _files(step_dir)}
  path = paths.join(step_dir, CHECKSUMS_FILE)
  try:
    atomic.write_file(path, json.dumps({"algorithm": "crc32c", "files": files}, indent=1,
                                       sort_keys=True))
  except OSError as e:  # a write error names no file: say which (a full disk, most likely)
    raise OSError(e.errno, e.strerror, path) from e


def describe(rel: str) -> str:
  """What a file of a step folder holds, for error messages."""
  if rel.startswith("data/"):
    return "the data iterator state"
  if "/d/" in f"/{rel}":
    return "array data"
  return "checkpoint metadata"


def verify(step_dir: str, step: int, *, name_folder: bool = False) -> bool:
  """Checks every listed file of a sealed step: True when it was sealed and is intact, False
  when it was never sealed. Raises CorruptCheckpointError naming the step and the file, and
  with `name_folder` the step's folder too (a reader of another run's checkpoint, a teacher's
  or a base's, says whose step it is: the run's own steps may have the same numbers)."""
  step_name = f"checkpoint step {step}" + (f" in {step_dir}" if name_folder else "")
  path = paths.join(step_dir, CHECKSUMS_FILE)
  if not paths.isfile(path):
    return False
  try:
    listed = json.loads(paths.read_text(path))["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CorruptCheckpointError(f"{step_name}: its checksum list {CHECKSUMS_FILE} "
                                 f"is unreadable ({e})") from e
  for rel, want in sorted(listed.items()):
    full = paths.join(step_dir, rel)
    what = f"{step_name}: {rel} ({describe(rel)})"
    if not paths.isfile(full):
      raise CorruptCheckpointError(f"{what} is missing")
    size = paths.size(full)
    if size != want["size"]:
      raise CorruptCheckpointError(f"{what} has {size} bytes, {want['size']} were saved")
    try:
      crc = f"{file_crc32c(full):08x}"
    except OSError as e:
      raise CorruptCheckpointError(f"{what} cannot be read: {e}") from e
    if crc != want["crc32c"]:
      raise CorruptCheckpointError(f"{what} fails its CRC32C check (saved 0x{want['crc32c']}, "
                                   f"now 0x{crc})")
  return True


@jax.jit
def _all_finite(leaves):
  return [jax.numpy.isfinite(leaf).all() for leaf in leaves]


def check_finite(state, step: int, directory: str) -> None:
  """A restored state must be all-finite: NaNs read back mean a corrupted file. One program
  checks every floating leaf (one per leaf would compile a program each, for each sharding)."""
  floating = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)
              if jax.dtypes.issubdtype(leaf.dtype, np.floating)]
  if not floating:
    return
  finite = jax.device_get(_all_finite([leaf for _, leaf in floating]))
  for (path, _), ok in zip(floating, finite):
    if not bool(ok):
      raise CorruptCheckpointError(f"checkpoint step {step} in {directory}: "
                                   f"{jax.tree_util.keystr(path)} holds non-finite values")


@contextlib.contextmanager
def quiet_orbax(level: int = logging.ERROR):
  """Orbax warns, when reading a finished run, that its folder is read only and that a step's
  item has no metadata file of its own: true and expected, so not shown to users. Listing
  steps (level CRITICAL) it also logs a damaged step's metadata file as an error: the
  checksums name that file, in one line, when the step is read."""
  logger = logging.getLogger("absl")
  saved = logger.level
  logger.setLevel(level)
  try:
    yield
  finally:
    logger.setLevel(saved)


def move_aside(step_dir: str) -> str:
  """Renames a damaged step folder to <step>.corrupt-N (N: the first unused, from 1);
  returns the new path. Never deletes a file no copy holds.

  A bucket has no folder rename: every object is copied to <step>.corrupt-N/ first (a server
  side copy), then the originals are deleted, orbax's commit marker first, so that a kill in
  between leaves either the whole step listed (found damaged again on the next start) or an
  uncommitted folder (which orbax clears) beside a whole copy."""
  n = 1
  while paths.exists(f"{step_dir}.corrupt-{n}"):
    n += 1
  target = f"{step_dir}.corrupt-{n}"
  if not paths.is_url(step_dir):
    os.rename(step_dir, target)
    return target
  names = paths.files_under(step_dir)
  for rel in names:
    storage.copy(paths.join(step_dir, rel), paths.join(target, rel))
  for rel in sorted(names, key=lambda rel: rel != COMMIT_MARKER):  # the marker first
    paths.remove(paths.join(step_dir, rel))
  return target


# --- the MODEL_DIR log file ------------------------------------------------------------------

def log_details(model_dir: str, text: str) -> str | None:
  """Appends `text` (with a UTC timestamp) to MODEL_DIR/t5lite.log; returns the file's path,
  or None when it cannot be written (a read-only MODEL_DIR): the caller then says less."""
  if jax.process_index() != 0:
    return None  # one writer per MODEL_DIR file; other processes' output says the rest
  path = paths.join(model_dir, LOG_FILE)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
  try:
    paths.append_text(path, f"--- {stamp} pid {os.getpid()}\n{text.rstrip()}\n")
  except Exception as e:  # a full disk, a bucket that is gone: the caller then says less
    if not (isinstance(e, OSError) or storage.is_service_error(e)):
      raise
    return None
  return path


def error_details(error: BaseException) -> str:
  """The whole story of an exception and its causes, for the log file."""
  return "".join(traceback.format_exception(error))


def first_line(error: BaseException, limit: int = 300) -> str:
  """A console-sized summary of an exception (TensorStore puts whole specs in messages)."""
  text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  text = text.split(" See full TensorStore details")[0]  # the spec follows: log file only
  return text if len(text) <= limit else text[:limit] + "..."


@contextlib.contextmanager
def captured_noise(sink: list[str]):
  """Collects what orbax, absl, TensorStore's asyncio loop and finalizers print through
  logging or `sys.unraisablehook` while a damaged checkpoint is read, into `sink` (for the
  log file), instead of the console."""
  handler = _ListHandler(sink)
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio", "orbax", "jax")]
  saved = [(lg, lg.propagate, lg.level) for lg in loggers]
  unraisable = sys.unraisablehook
  for lg in loggers:
    lg.addHandler(handler)
    lg.propagate = False
  sys.unraisablehook = lambda info: sink.append(
      f"{info.err_msg or 'unraisable'}: {info.exc_type.__name__}: {info.exc_value}")
  try:
    yield
  finally:
    sys.unraisablehook = unraisable
    for lg, propagate, level in saved:
      lg.removeHandler(handler)
      lg.propagate = propagate
      lg.setLevel(level)


class _ListHandler(logging.Handler):
  def __init__(self, sink: list[str]):
    super().__init__(logging.DEBUG)
    self.sink = sink

  def emit(self, record: logging.LogRecord) -> None:
    self.sink.append(self.format(record))


@contextlib.contextmanager
def orbax_messages_to_log(model_dir: str, quiet_after: tuple[type, ...] = (OSError,)):
  """For a training run: what orbax logs (its background save threads log a failed write
  with a traceback per thread, dozens of lines) goes to MODEL_DIR/t5lite.log instead of the
  console, and so do the "Event loop is closed" tracebacks that TensorStore's callbacks print
  (one per pending write: hundreds) once a failed save has closed orbax's event loop. The run
  reports the failure itself, in one line (checkpoints.CheckpointWriteError). So does asyncio's
  "Task exception was never retrieved" for a storage client's request that a dropped
  connection cut (aiohttp's write of a request the client then retried): the retry's outcome
  is what counts, and a failure after the retries is reported by the run.

  After a failed write (`quiet_after`: OSError, and the caller's checkpoint write error)
  TensorStore's pending writes go on reporting until the process exits, so the filter then
  stays and lets through only t5lite's own lines (the CLI's error line). After anything
  else everything is put back; a bug's traceback is never filtered."""
  loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
  divert = _OrbaxToLogFile(model_dir)
  for logger in loggers:
    logger.addFilter(divert)
  stderr = sys.stderr
  filtered = sys.stderr = _StderrFilter(stderr)
  try:
    yield
  except quiet_after:
    filtered.only_own_lines = True
    divert.everything = True  # what orbax's threads and asyncio still log: off the console
    raise
  except BaseException:
    sys.stderr = stderr
    for logger in loggers:
      logger.removeFilter(divert)
    raise
  else:
    sys.stderr = stderr
    for logger in loggers:
      logger.removeFilter(divert)
  finally:
    filtered.close_into(model_dir)


class _StderrFilter:
  """sys.stderr, less the tracebacks whose exception line is one of NOISE (kept: a count and
  the first one, for the log file). Everything else passes through, in order. Each thread's
  writes are taken apart on their own: TensorStore's callback threads print concurrently."""

  NOISE = ("RuntimeError: Event loop is closed",)

  def __init__(self, real):
    self.real = real
    self.only_own_lines = False
    self.dropped, self.first = 0, ""
    self._lock = threading.Lock()
    self._threads: dict[int, list] = {}  # thread id -> [partial line, traceback lines]

  def write(self, text: str) -> int:
    with self._lock:
      state = self._threads.setdefault(threading.get_ident(), ["", []])
      state[0] += text
      while "\n" in state[0]:
        line, state[0] = state[0].split("\n", 1)
        self._line(state, line + "\n")
    return len(text)

  def _line(self, state: list, line: str) -> None:
    if self.only_own_lines:
      if line.startswith("t5lite"):
        self.real.write(line)
      return
    block = state[1]
    if not block and not line.startswith("Traceback (most recent call last):"):
      self.real.write(line)
      return
    block.append(line)
    if line.startswith((" ", "\t", "Traceback")):
      return  # the traceback goes on
    text, state[1] = "".join(block), []  # its exception line ends it
    if line.startswith(self.NOISE):
      self.dropped += 1
      self.first = self.first or text
    else:
      self.real.write(text)

  def flush(self) -> None:
    with self._lock:
      state = self._threads.get(threading.get_ident())
      if state and state[0] and not state[1] and not self.only_own_lines:
        self.real.write(state[0])
        state[0] = ""
    self.real.flush()

  def close_into(self, model_dir: str) -> None:
    """Notes the tracebacks dropped so far in the log file."""
    self.flush()
    if self.dropped:
      log_details(model_dir, f"{self.dropped} traceback(s) like this one were kept off the "
                  f"console:\n{self.first}")
      self.dropped = 0

  def __getattr__(self, name: str):
    return getattr(self.real, name)  # fileno, isatty, encoding, ...


class _OrbaxToLogFile(logging.Filter):
  def __init__(self, model_dir: str):
    super().__init__()
    self.model_dir = model_dir
    self.formatter = logging.Formatter("%(levelname)s %(threadName)s %(message)s")

  everything = False

  def filter(self, record: logging.LogRecord) -> bool:
    orbax_error = (f"{os.sep}orbax{os.sep}" in record.pathname
                   and record.levelno >= logging.ERROR)
    if not (self.everything or orbax_error or _cut_storage_request(record)):
      return True  # orbax's advice (e.g. "checkpointing less frequently") stays visible
    log_details(self.model_dir, self.formatter.format(record))
    return False


def _cut_storage_request(record: logging.LogRecord) -> bool:
  """asyncio's report of a storage client's task that a dropped connection ended, which
  nobody awaited because the client had moved on to its retry."""
  error = record.exc_info[1] if record.exc_info else None
  return (record.name == "asyncio" and error is not None
          and "exception was never retrieved" in str(record.msg)
          and storage.is_service_error(error))
