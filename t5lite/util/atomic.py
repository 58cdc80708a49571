"""Atomic first-use builds: write under a unique temporary name, then rename into place.

A build killed halfway (Ctrl-C, OOM, a preempted host) must leave nothing that looks built:
before this, an interrupted build of the embedded dataset left `incomplete.*` folders that
made every later run fail until someone deleted the data dir by hand. So a file or folder
is written under a sibling temporary name (`.NAME.tmp-HOST-PID-RANDOM`) and renamed onto
NAME, which is atomic on one filesystem: readers see all of it or nothing. Two processes
building at once each write their own temporary copy; the first rename wins and the loser
discards its copy. Temporaries of dead builds are removed by `remove_stale`. On a bucket
(gs://, s3://) one file is one object upload, atomic by itself (write_file).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
import time
from typing import Callable, Iterator

_HOST = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:40] or "host"
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|trash)-(?P<host>[A-Za-z0-9_.]+)-(?P<pid>\d+)-"
                   r"[0-9a-f]+$")
# Another host's temporary (a shared filesystem) is only presumed dead after this long.
STALE_SECONDS = 24 * 3600


def check_local(target: str) -> None:
  """Refuses a bucket URL where a local folder is written and renamed (os.path would take
  gs://B/x for a relative folder named gs:)."""
  from t5lite.util import storage
  if storage.is_url(target):
    from t5lite.errors import ConfigError
    raise ConfigError(f"{target}: this is built on local disk (written, then renamed into "
                      "place), not in a bucket: name a local folder and copy it up if needed")


def temp_path(target: str, kind: str = "tmp") -> str:
  """A sibling of target that no other build uses (same folder, so rename stays atomic)."""
  check_local(target)
  parent, name = os.path.split(os.path.abspath(target))
  return os.path.join(parent, f".{name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def writing(target: str) -> Iterator[str]:
  """A temporary path of this process alone to write `target` at (by any writer: a file, an
  ArrayRecordWriter, ...): renamed into place when the block ends, removed if it raises.

  Example: `with writing(path) as tmp: write(tmp)` -> path appears whole, or not at all.
  """
  tmp = temp_path(target)
  try:
    yield tmp
    os.replace(tmp, target)
  except BaseException:
    _remove(tmp)
    raise


def write_file(target: str, data: bytes | str) -> None:
  """Writes target whole or not at all (flushed to disk before the rename). A bucket URL
  (gs://, s3://) is one object upload, which a bucket makes atomic itself: readers see the
  old object or the new one, never a part."""
  from t5lite.util import storage
  if storage.is_url(target):
    payload = data.encode("utf-8") if isinstance(data, str) else data
    storage.path(target).write_bytes(payload)
    return
  with writing(target) as tmp, open(tmp, "wb") as f:
    f.write(data.encode("utf-8") if isinstance(data, str) else data)
    f.flush()
    os.fsync(f.fileno())


def discard(path: str) -> None:
  """Removes a file or folder, renamed away first so nobody sees it half deleted."""
  if not os.path.lexists(path):
    return
  trash = temp_path(path, "trash")
  try:
    os.rename(path, trash)
  except FileNotFoundError:  # someone else removed it
    return
  _remove(trash)


def publish_dir(built: str, target: str, is_complete: Callable[[str], bool]) -> bool:
  """Renames the folder `built` onto `target`. A target that exists but is not complete
  (left by a killed build of older code) is discarded first. Returns False when another
  process published first: its copy is kept and `built` is discarded."""
  if os.path.lexists(target) and not is_complete(target):
    discard(target)
  try:
    os.rename(built, target)  # replaces nothing but an empty folder
    return True
  except OSError as e:
    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not is_complete(target):
      raise
  discard(built)
  return False


def build_dir(target: str, build: Callable[[str], None],
              is_complete: Callable[[str], bool]) -> str:
  """Makes `target` with build(path) unless it is complete already; returns target.

  build writes the folder's content into `path` (a fresh temporary folder, its name not
  target's); the finished folder is then renamed onto target.
  """
  check_local(target)
  if is_complete(target):
    return target
  parent = os.path.dirname(os.path.abspath(target))
  os.makedirs(parent, exist_ok=True)
  remove_stale(parent)
  tmp = temp_path(target)
  os.makedirs(tmp)
  try:
    build(tmp)
    publish_dir(tmp, target, is_complete)
  except BaseException:
    _remove(tmp)
    raise
  return target


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def remove_stale(parent: str, max_age: float = STALE_SECONDS) -> list[str]:
  """Removes the temporaries in `parent` of builds that died: this host's whose process is
  gone, another host's older than max_age, and any trash. Returns what it removed."""
  removed = []
  try:
    names = os.listdir(parent)
  except FileNotFoundError:
    return removed
  for name in names:
    match = _TEMP.match(name)
    if not match:
      continue
    path = os.path.join(parent, name)
    if match["kind"] == "trash":
      dead = True
    elif match["host"] == _HOST:
      dead = int(match["pid"]) != os.getpid() and not _alive(int(match["pid"]))
    else:
      try:
        dead = time.time() - os.lstat(path).st_mtime > max_age
      except FileNotFoundError:
        continue
    if dead:
      _remove(path)
      removed.append(path)
  return removed


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    try:
      os.remove(path)
    except FileNotFoundError:
      pass
