"""Temporary folders that a SIGKILL leaks only until the next one of their kind is made.

Staged checkpoints, downloads and uploads can be gigabytes; a process killed while it holds
one (a preempted pod, an OOM kill) never runs its cleanup. So each such folder holds a lock
file its process keeps an flock on while it lives: the kernel drops the lock with the
process, which tells a dead owner from a live one also across containers that share the
temporary folder, where process ids say nothing. `OwnedFolder(prefix)` first removes every
folder of that prefix whose lock nobody holds, then makes its own.

    folder = OwnedFolder("t5lite-download-")
    local = folder.subfolder("files")          # beside the lock file, never among its files
    ...
    folder.close()                             # removed (also when garbage-collected)
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import weakref

LOCK_FILE = ".owner.lock"


def remove_abandoned(prefix: str) -> None:
  """Removes the folders of `prefix` in the temporary folder whose owner is gone."""
  root = tempfile.gettempdir()
  for name in os.listdir(root):
    if not name.startswith(prefix):
      continue
    try:
      fd = os.open(os.path.join(root, name, LOCK_FILE), os.O_RDWR)
    except OSError:
      continue  # being made right now, or not ours to open
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      continue  # its owner lives
    finally:
      os.close(fd)
    shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _remove(path: str, lock: int) -> None:
  shutil.rmtree(path, ignore_errors=True)
  os.close(lock)


class OwnedFolder:
  """A fresh temporary folder of this process (module docstring)."""

  def __init__(self, prefix: str):
    remove_abandoned(prefix)
    self.path = tempfile.mkdtemp(prefix=prefix)
    lock = os.open(os.path.join(self.path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    self._cleanup = weakref.finalize(self, _remove, self.path, lock)

  def subfolder(self, name: str) -> str:
    """A new empty folder `name` in this one, for what it stages (the lock file stays out)."""
    path = os.path.join(self.path, name)
    os.makedirs(path)
    return path

  def close(self) -> None:
    self._cleanup()
