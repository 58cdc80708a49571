"""File access shared by the file-backed sources: globs, buffers, line offsets, indexing.

`IndexedFileSource` is the base of every file source (text lines, JSONL, TSV, Parquet,
TFRecord): patterns are expanded in sorted order and each file indexed once, on first
use, so that registering a task costs nothing and a source pickles without open files.
"""
from __future__ import annotations

import abc
import difflib
import glob
import gzip
import mmap
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from t5lite.util import paths
from t5lite.errors import ConfigError, ConfigFileNotFoundError

Patterns = str | os.PathLike | Sequence[str | os.PathLike]
_GLOB_CHARS = frozenset("*?[")
_NEWLINE_SCAN_BYTES = 1 << 26  # scan for newlines 64 MiB at a time to bound temporaries
_MAX_OPEN_MAPS = 64  # each mmap holds a file descriptor: C4 alone has 1024 shards


def _near_names(pattern: str) -> str:
  """' (near names in DIR: a, b)' for a pattern matching nothing, or where DIR is missing."""
  directory = os.path.dirname(pattern) or "."
  if not os.path.isdir(directory):
    return f" (directory {directory!r} does not exist)"
  names = sorted(os.listdir(directory))
  near = difflib.get_close_matches(os.path.basename(pattern), names, n=5, cutoff=0.5)
  return f" (near names in {directory!r}: {', '.join(near)})" if near else ""


def expand_patterns(patterns: Patterns) -> list[str]:
  """Files matching one or more globs: each pattern's matches sorted, duplicates dropped.

  Example: expand_patterns(["d/b-*.txt", "d/a.txt"]) -> ["d/b-0.txt", "d/b-1.txt", "d/a.txt"].
  """
  if isinstance(patterns, (str, os.PathLike)):
    patterns = [patterns]
  files: list[str] = []
  for pattern in map(os.fspath, patterns):
    if paths.is_url(pattern):
      matches = paths.glob_files(pattern)
      if not matches:
        raise ConfigFileNotFoundError(f"no object matches {pattern!r}")
      files.extend(m for m in matches if m not in files)
      continue
    pattern = os.path.expanduser(pattern)
    if _GLOB_CHARS & set(pattern):
      matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    else:
      matches = [pattern] if os.path.isfile(pattern) else []
    if not matches:
      raise ConfigFileNotFoundError(f"no file matches {pattern!r}{_near_names(pattern)}")
    files.extend(m for m in matches if m not in files)
  return files


def read_buffer(path: str) -> bytes | mmap.mmap:
  """A file's bytes: memory-mapped, or decompressed into memory for `.gz` files.

  Compressed files cannot be read at an offset, so they are held decompressed (as one
  bytes object, not as Python strings); for corpora bigger than memory read them as streams
  (t5lite.data.sources.streams), or cache the task to array_record (`t5lite cache`). An
  object in a bucket (gs://, s3://) is downloaded whole into memory (decompressed if `.gz`).
  """
  if paths.is_url(path):
    data = paths.read_bytes(path)
    return gzip.decompress(data) if path.endswith(".gz") else data
  if path.endswith(".gz"):
    with gzip.open(path, "rb") as f:
      return f.read()
  with open(path, "rb") as f:
    if os.fstat(f.fileno()).st_size == 0:
      return b""  # mmap refuses empty files
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def checked_index(index, length: int, owner) -> int:
  """index as a non-negative int below length (negative counts from the end), or an
  IndexError naming the source and its length."""
  i = operator.index(index)
  if not -length <= i < length:
    raise IndexError(f"index {i} out of range for {owner!r} of length {length}")
  return i % length


def line_spans(buf: bytes | mmap.mmap) -> tuple[np.ndarray, np.ndarray]:
  """(starts, ends) byte offsets of the non-empty lines, without "\\n" / "\\r\\n".

  Example: b"a\\n\\nbc\\r\\n" -> starts [0, 3], ends [1, 5].
  """
  data = np.frombuffer(buf, dtype=np.uint8)
  if not len(data):
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  newlines = [np.flatnonzero(data[i:i + _NEWLINE_SCAN_BYTES] == 10) + i
              for i in range(0, len(data), _NEWLINE_SCAN_BYTES)]
  newlines = np.concatenate(newlines).astype(np.int64)
  starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
  ends = np.concatenate([newlines, [len(data)]]).astype(np.int64)
  has_cr = (ends > starts) & (data[np.maximum(ends - 1, 0)] == 13)
  ends = ends - has_cr
  keep = ends > starts
  return starts[keep], ends[keep]


def line_number(buf: bytes | mmap.mmap, offset: int) -> int:
  """1-based number of the line holding byte `offset` (for error messages only)."""
  with memoryview(buf) as view:  # mmap has no .count
    return bytes(view[:offset]).count(b"\n") + 1


class ByteSpans:
  """Where a file's examples lie: example i is buf[starts[i]:ends[i]] (lines or records)."""

  def __init__(self, starts: np.ndarray, ends: np.ndarray):
    self.starts, self.ends = starts, ends

  def __len__(self) -> int:
    return len(self.starts)


class IndexedFileSource(abc.ABC):
  """Base of file-backed sources: lazy glob expansion, a per-file index, global indexing.

  Subclasses implement `_index_file(path, buf) -> per-file index` (anything with len) and
  `_example(file_id, local_index) -> dict`.
  """
  # Whether files are opened with read_buffer (False: the subclass opens them itself).
  _uses_buffers = True

  def __init__(self, patterns: Patterns):
    self._patterns = patterns
    self._files: list[str] | None = None
    self._indexes: list[Any] | None = None
    self._cumulative: np.ndarray | None = None
    self._buffers: dict[int, Any] = {}
    self._lock = threading.RLock()  # grain reads with several threads

  @property
  def files(self) -> list[str]:
    """The matched files, in reading order."""
    if self._files is None:
      self._files = expand_patterns(self._patterns)
    return self._files

  @abc.abstractmethod
  def _index_file(self, path: str, buf: Any) -> Any:
    """Builds a file's index of examples (e.g. line offsets) from its bytes."""

  def _count(self, file_index: Any) -> int:
    """Number of examples in a file, from its index."""
    return len(file_index)

  @abc.abstractmethod
  def _example(self, file_id: int, index: int) -> dict[str, Any]:
    """The index-th example of file file_id, parsed."""

  def _buffer(self, file_id: int) -> Any:
    """The open buffer of a file (reopened after unpickling; few mmaps kept open)."""
    with self._lock:
      buf = self._buffers.pop(file_id, None)
      if buf is None:
        buf = read_buffer(self.files[file_id])
        maps = [k for k, v in self._buffers.items() if isinstance(v, mmap.mmap)]
        if isinstance(buf, mmap.mmap) and len(maps) >= _MAX_OPEN_MAPS:
          # Drop the least recently used (dicts keep insertion order) without closing it:
          # another thread may still be reading it; the mmap closes when unreferenced.
          del self._buffers[maps[0]]
      self._buffers[file_id] = buf  # (re)insert as the most recently used
      return buf

  def _build(self) -> None:
    """Indexes every file once; an all-empty source is an error naming its files."""
    indexes = []
    for file_id, path in enumerate(self.files):
      buf = self._buffer(file_id) if self._uses_buffers else None
      indexes.append(self._index_file(path, buf))
    counts = np.array([self._count(ix) for ix in indexes], dtype=np.int64)
    if not counts.sum():
      raise ConfigError(f"{self!r} has no examples: these files are empty: {self.files}")
    self._indexes, self._cumulative = indexes, np.cumsum(counts)

  def __len__(self) -> int:
    if self._cumulative is None:
      with self._lock:
        if self._cumulative is None:
          self._build()
    return int(self._cumulative[-1])

  def __getitem__(self, index: int) -> dict[str, Any]:
    i = checked_index(index, len(self), self)
    file_id = int(np.searchsorted(self._cumulative, i, side="right"))
    start = int(self._cumulative[file_id - 1]) if file_id else 0
    return self._example(file_id, i - start)

  def __getstate__(self) -> dict[str, Any]:
    state = {**self.__dict__, "_buffers": {}}  # mmaps do not pickle; reopen lazily
    del state["_lock"]
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state, _lock=threading.RLock())

  def _repr_args(self) -> str:
    return repr(self._patterns)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self._repr_args()})"
