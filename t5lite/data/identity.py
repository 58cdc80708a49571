"""What a run read, saved with its data state, so that a resume on changed data is refused.

A data state holds positions (row r is at example i of its slice; a streamed row at record k
of shard s): on other files the same positions point at other examples, and the run would go
on mixing old and new data without a word. So the state also holds each task split's files
as they were: base name, size and a CRC32 of the first and last 64 KiB; for an object in a
bucket, its size and version (GCS generation, S3 ETag). Not paths or modification times:
another host's mount or a copy on a fresh VM is the same data. Restoring compares them with
the files now and names the first difference.

Sources without files (a Python function, a list, TFDS by name) have no identity here and are
not checked.
"""
from __future__ import annotations

import os
import zlib
from typing import Any

from t5lite.data.sources import streams
from t5lite.data.sources.files import expand_patterns
from t5lite.errors import ConfigError
from t5lite.util import paths

_EDGE = 1 << 16  # bytes read at each end of a file for its fingerprint


def _source_files(source) -> list[str] | None:
  """The files a source reads, or None when it reads none (or cannot say)."""
  if isinstance(source, streams.HfStream):  # its data files, when they are named
    files = source.data_files
    files = [files] if isinstance(files, str) else files
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
      return None
    try:
      return expand_patterns(files)  # globs, as datasets expands them
    except (ConfigError, OSError):  # e.g. hf:// or relative to a dataset folder: not checked
      return None
  files = getattr(source, "files", None)  # file sources, streams, caches, array_record
  return list(files) if isinstance(files, list) else None


def _fingerprint(path: str) -> list[Any]:
  """[size, CRC32 of both ends] of a file; [size, version] of an object in a bucket. Not the
  path or the modification time: a copy of the data (another host's mount, a fresh VM's
  download of a bucket cache) is the same data."""
  if paths.is_url(path):
    return [paths.size(path), paths.version(path)]
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    crc = zlib.crc32(f.read(_EDGE))
    if size > 2 * _EDGE:
      f.seek(-_EDGE, os.SEEK_END)
      crc = zlib.crc32(f.read(_EDGE), crc)
  return [size, crc]


def _names(files: list[str]) -> list[str]:
  """How files are named in an identity: their base names (the same on every host and copy),
  or the whole paths when two share a base name."""
  names = [os.path.basename(f.rstrip("/")) for f in files]
  return names if len(set(names)) == len(names) else list(files)


def data_identity(sources: dict[str, Any]) -> dict[str, list]:
  """{"TASK/SPLIT": [file fingerprints]} for the sources that read files."""
  identity = {}
  for key, source in sources.items():
    files = _source_files(source)
    if files is not None:
      identity[key] = [[name, *_fingerprint(f)] for name, f in zip(_names(files), files)]
  return identity


def _difference(saved: list, now: list) -> str | None:
  """The first difference between two lists of file fingerprints, in words."""
  saved_by_path, now_by_path = {f[0]: f for f in saved}, {f[0]: f for f in now}
  for path in saved_by_path:
    if path not in now_by_path:
      return f"{path} is gone"
  for path in now_by_path:
    if path not in saved_by_path:
      return f"{path} is new"
  for path, before in saved_by_path.items():
    after = now_by_path[path]
    if before[1] != after[1]:
      return f"{path} changed size ({before[1]} -> {after[1]} bytes)"
    if before[2:] != after[2:]:
      return f"{path} changed (same size, other contents or object version)"
  if [f[0] for f in saved] != [f[0] for f in now]:
    return "the files are read in another order"
  return None


def check_unchanged(saved: dict[str, list] | None, now: dict[str, list]) -> None:
  """A ConfigError naming what changed since `saved` (a state without one is not checked)."""
  if saved is None:
    return
  for key in sorted(set(saved) | set(now)):
    if key not in now or key not in saved:
      continue  # a task whose source gained or lost files of its own kind: not comparable
    difference = _difference(saved[key], now[key])
    if difference:
      task, split = key.rsplit("/", 1)
      raise ConfigError(
          f"the data of task {task!r} split {split!r} changed since the data state was saved: "
          f"{difference}. The saved positions point into the old data; train in a new "
          "MODEL_DIR to start over, or set --gin.TrainConfig.accept_data_changes=True to go on "
          "from them in the new data")


class LazyIdentity:
  """data_identity(sources()) computed on first call (a resume or the first checkpoint),
  not when a pipeline is built: evaluation pipelines never need it."""

  def __init__(self, sources):
    self._sources, self._identity = sources, None

  def __call__(self) -> dict[str, list]:
    if self._identity is None:
      self._identity = data_identity(self._sources())
    return self._identity
