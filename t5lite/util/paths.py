"""A path or a bucket URL, through the same calls: what MODEL_DIR code uses instead of os.path.

    paths.join("gs://b/run", "checkpoints", "100")   # 'gs://b/run/checkpoints/100'
    paths.join("/tmp/run", "metrics.jsonl")          # os.path.join for a local path
    paths.isfile(p); paths.isdir(p); paths.read_text(p); paths.files_under(p)
    paths.append_text(p, "one more line\\n")

A local path takes os.path and open exactly as before; a `gs://` or `s3://` URL goes through
etils' epath (fsspec with gcsfs / s3fs: the library orbax reads buckets with), so a caller
writes one line for both. What a bucket lacks is said where it matters: `makedirs` is a no-op
(a bucket has no folders: an object's name holds its whole path), `append_text` rewrites the
object (a bucket has no append; the MODEL_DIR files appended to have one writer, process 0),
and a folder rename is not offered here at all (atomic.py and integrity.py say what replaces
it). Atomic single-object writes are atomic.write_file's.
"""
from __future__ import annotations

import os
import posixpath
import shutil

from t5lite.util import storage


def is_url(path) -> bool:
  return storage.is_url(os.fspath(path) if isinstance(path, os.PathLike) else path)


def absolute(path) -> str:
  """A URL unchanged; a local path made absolute (with ~ expanded)."""
  path = os.fspath(path)
  return path if is_url(path) else os.path.abspath(os.path.expanduser(path))


def join(base, *parts: str) -> str:
  base = os.fspath(base)
  if is_url(base):
    return posixpath.join(base, *parts)
  return os.path.join(base, *parts)


def dirname(path) -> str:
  path = os.fspath(path)
  return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(path)


def basename(path) -> str:
  path = os.fspath(path)
  return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


def _fresh_filesystem(url: str):
  """The fsspec filesystem epath uses for `url`, its cached listings of `url` dropped: other
  clients (orbax's tensorstore, the lease's conditional writes, other hosts) write to the
  bucket too, and a listing cached before their write would not show it."""
  import fsspec
  fs = fsspec.filesystem(storage.split(url)[0])
  fs.invalidate_cache(url)
  return fs


def isfile(path) -> bool:
  path = os.fspath(path)
  return _fresh_filesystem(path).isfile(path) if is_url(path) else os.path.isfile(path)


def isdir(path) -> bool:
  path = os.fspath(path)
  return _fresh_filesystem(path).isdir(path) if is_url(path) else os.path.isdir(path)


def exists(path) -> bool:
  path = os.fspath(path)
  return _fresh_filesystem(path).exists(path) if is_url(path) else os.path.exists(path)


def makedirs(path) -> None:
  """os.makedirs(exist_ok=True) for a local path; nothing for a URL (no folders in a bucket)."""
  if not is_url(path):
    os.makedirs(os.fspath(path), exist_ok=True)


def read_text(path) -> str:
  return storage.path(os.fspath(path)).read_text(encoding="utf-8")


def read_bytes(path) -> bytes:
  return storage.path(os.fspath(path)).read_bytes()


def open_text(path):
  """A text stream (UTF-8) for reading a file or an object."""
  path = os.fspath(path)
  if is_url(path):
    return storage.path(path).open("r", encoding="utf-8")
  return open(path, encoding="utf-8")


def open_binary(path, mode: str = "rb"):
  """A binary file object (mode 'rb' or 'wb'); on a bucket a 'wb' object appears at close."""
  return storage.path(os.fspath(path)).open(mode)


def size(path) -> int:
  return storage.size(storage.path(os.fspath(path)))


def version(url: str) -> str:
  """What changes when the object at `url` is written again: its GCS generation or S3 ETag
  (with its size and modification time where a server gives neither)."""
  info = _fresh_filesystem(url).info(url)
  for key in ("generation", "ETag", "etag"):
    if info.get(key):
      return str(info[key]).strip('"')
  changed = info.get("mtime") or info.get("LastModified") or info.get("updated")
  return f"{info.get('size')}-{changed}"


def remove(path) -> None:
  """Removes a file (missing is fine)."""
  target = storage.path(os.fspath(path))
  try:
    target.unlink()
  except FileNotFoundError:
    pass


def remove_tree(folder) -> None:
  """Removes a folder and everything in it (missing is fine); for a URL, every object under
  its prefix."""
  folder = os.fspath(folder)
  if not is_url(folder):
    shutil.rmtree(folder, ignore_errors=True)
    return
  # Through epath, as orbax lists and writes buckets: its filesystem's cached listings then
  # lose what is removed (another gcsfs instance's removal would leave them stale).
  storage.path(folder).rmtree(missing_ok=True)


def files_under(folder) -> list[str]:
  """Every file below `folder`, as '/'-separated paths relative to it, sorted."""
  folder = os.fspath(folder)
  if not is_url(folder):
    found = []
    for root, _, names in os.walk(folder):
      for name in names:
        found.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
    return sorted(found)
  scheme, bucket, key = storage.split(folder)
  prefix = f"{bucket}/{key.strip('/')}/"
  found = _fresh_filesystem(folder).find(folder)  # 'BUCKET/KEY...' of every object below
  return sorted(name[len(prefix):] for name in found if name.startswith(prefix))


def glob_files(pattern: str) -> list[str]:
  """The objects matching a bucket URL's glob (`*`, `?`, `[...]`; a plain URL matches itself
  when it exists), as URLs, sorted."""
  scheme = storage.split(pattern)[0]
  fs = _fresh_filesystem(pattern)
  if not set("*?[") & set(pattern):
    return [pattern] if fs.isfile(pattern) else []
  found = fs.glob(pattern, detail=True)  # {'BUCKET/KEY': info}: one listing, no stat each
  return sorted(f"{scheme}://{name}" for name, info in found.items()
                if info.get("type") == "file")


def append_text(path, text: str) -> None:
  """Appends `text` to a file (created if missing). On a bucket the object is read and
  written back whole: fine for the small logs a run appends to, from one writer."""
  path = os.fspath(path)
  if not is_url(path):
    with open(path, "a", encoding="utf-8") as f:
      f.write(text)
    return
  target = storage.path(path)
  before = target.read_text(encoding="utf-8") if target.exists() else ""
  target.write_text(before + text, encoding="utf-8")
