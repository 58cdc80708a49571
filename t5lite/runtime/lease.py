"""One writer per MODEL_DIR: a lease file that a training run holds while it runs.

    with lease.hold(model_dir, timeout_s=600) as held:  # ConfigError: another trainer has it
      ... train; held.check() before each checkpoint (None on processes other than 0) ...

MODEL_DIR/t5lite.lease is a small JSON file: who holds it (host, pid, the process's start
time), a random token, when it was taken and a heartbeat time that a background thread
renews every timeout_s / 10 seconds. A second trainer reads it and stops (ConfigError, exit
2 from the CLI) naming the first, unless the lease is stale:
  - its holder ran on this host and that process is gone (a SIGKILLed or crashed run): taken
    over at once;
  - its heartbeat is older than timeout_s (a holder on another host that died): taken over,
    with a message. Hosts' clocks are assumed to agree to well within timeout_s (NTP).

Why a file and not flock/fcntl: POSIX locks are not honest on NFS without lockd and on
FUSE-mounted buckets (GCS FUSE ignores them), the filesystems MODEL_DIR lives on in a pod.
The lease is written to a unique temporary name and renamed into place (atomic on all of
them); after `settle_s` the taker reads it back and keeps it only if its own token is still
there, so of two trainers starting together exactly one goes on (the last rename wins, the
other sees a foreign token and stops). The holder's heartbeat also checks the token: if
another run took the lease over (this one stalled past timeout_s), `check()` raises before
this run writes another checkpoint.

In a bucket (MODEL_DIR gs://... or s3://), where there is no atomic rename, BucketLease keeps
the same promises with conditional writes (t5lite.util.storage): the lease object is created
only if absent, taken over and renewed only at the version last seen or written.

Multi-process jobs hold one lease, by process 0 (t5lite.train.trainer agrees on the outcome).
Released on exit: the file is removed when it still holds this run's token.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time

from t5lite.errors import ConfigError
from t5lite.runtime.processes import all_flags
from t5lite.util import storage

LEASE_FILE = "t5lite.lease"
DEFAULT_TIMEOUT_S = 600.0


def _process_start(pid: int) -> str | None:
  """The start time of a process (Linux /proc: clock ticks since boot), or None: with the
  pid it names one process, even after the pid is reused."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _alive(pid: int, started: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # exists, another user's
  return started is None or _process_start(pid) in (None, started)


def read(model_dir: str) -> dict | None:
  """The lease held on MODEL_DIR, or None. A torn or foreign file reads as no lease; an
  error other than a missing file (ESTALE on NFS, EIO) is raised: it says nothing."""
  try:
    with open(os.path.join(model_dir, LEASE_FILE), encoding="utf-8") as f:
      lease = json.load(f)
  except FileNotFoundError:
    return None
  except ValueError:
    return None
  return lease if isinstance(lease, dict) and "token" in lease else None


def _number(value, default: float) -> float:
  """A field of a lease someone else wrote: a number, or `default` for anything else."""
  try:
    return float(value)
  except (TypeError, ValueError):
    return default


def describe(lease: dict, now: float | None = None) -> str:
  now = time.time() if now is None else now
  return (f"host {lease.get('host')}, pid {lease.get('pid')}, heartbeat "
          f"{now - _number(lease.get('heartbeat'), 0.0):.0f} s ago")


class Lease:
  """This run's hold on a MODEL_DIR (see the module docstring)."""

  def __init__(self, model_dir: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               settle_s: float = 0.5):
    if timeout_s <= 0:
      raise ConfigError(f"the MODEL_DIR lease timeout must be > 0 seconds, got {timeout_s}")
    self.model_dir, self.timeout_s, self.settle_s = os.fspath(model_dir), timeout_s, settle_s
    self.path = os.path.join(self.model_dir, LEASE_FILE)
    self.token = secrets.token_hex(16)
    self.record = {"host": socket.gethostname(), "pid": os.getpid(),
                   "process_start": _process_start(os.getpid()), "token": self.token,
                   "taken": time.time()}
    self.lost: str | None = None  # why this run no longer holds it
    self.taken_over: str | None = None  # the stale holder this run replaced
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._created_dir = False

  def stale(self, other: dict) -> str | None:
    """Why `other`'s lease may be taken over, or None while its holder may be running."""
    pid = int(_number(other.get("pid"), 0))
    if (other.get("host") == self.record["host"] and pid > 0
        and not _alive(pid, other.get("process_start"))):
      return "its process is no longer running"
    age = time.time() - _number(other.get("heartbeat"), 0.0)  # unreadable: as old as can be
    if age > self.timeout_s:
      return f"its heartbeat is {age:.0f} s old (timeout {self.timeout_s:.0f} s)"
    return None

  def acquire(self) -> None:
    """Takes the lease or raises ConfigError naming its holder (nothing else is written)."""
    held = read(self.model_dir)
    if held is not None and held["token"] != self.token:
      why = self.stale(held)
      if why is None:
        raise self._in_use(held)
      self.taken_over = f"{describe(held)}: {why}"
    try:
      os.makedirs(self.model_dir)
      self._created_dir = True
    except FileExistsError:
      pass  # there already, or a rival made it just now: the token read-back decides
    self._write()
    time.sleep(self.settle_s)  # a rival's rename lands within this on a coherent filesystem
    now = read(self.model_dir)
    if now is None or now["token"] != self.token:
      self._created_dir = False
      raise self._in_use(now or {"host": "?", "pid": "?", "heartbeat": time.time()})
    self._thread = threading.Thread(target=self._beat, name="t5lite-lease", daemon=True)
    self._thread.start()

  def _in_use(self, held: dict) -> ConfigError:
    return ConfigError(
        f"MODEL_DIR {self.model_dir} is in use by another trainer ({describe(held)}); "
        "wait for it to finish or stop it, or use another MODEL_DIR. A lease whose process "
        f"is gone (same host) or whose heartbeat is older than {self.timeout_s:.0f} s is "
        f"taken over ({self.path})")

  def _write(self) -> None:
    tmp = f"{self.path}.{self.token}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump({**self.record, "heartbeat": time.time()}, f)
    os.replace(tmp, self.path)

  def _still_ours(self) -> bool:
    """Whether the lease file still holds this run's token (else `lost` says who took it).
    Raises OSError when the file cannot be read just now."""
    held = read(self.model_dir)
    if held is None or held["token"] != self.token:
      self.lost = ("another trainer took over its lease"
                   + (f" ({describe(held)})" if held else " (the lease file is gone)"))
    return self.lost is None

  def _beat(self) -> None:
    while not self._stop.wait(self.timeout_s / 10):
      try:
        if not self._still_ours():
          return
        self._write()  # (read, then write: a rival's takeover in between is seen next beat)
      except OSError:
        pass  # a full or flaky disk: the next beat retries; the timeout leaves slack

  def check(self) -> str | None:
    """Why this run may no longer write to MODEL_DIR (another run took the lease over), or
    None. Reads the lease file now (a stalled run may have lost it since the last beat)."""
    if self.lost is None:
      try:
        self._still_ours()
      except OSError:
        pass  # unreadable just now: the heartbeat's verdict stands
    if self.lost:
      return (f"MODEL_DIR {self.model_dir}: {self.lost}; this run stops without writing "
              "another checkpoint")
    return None

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    with contextlib.suppress(OSError):
      held = read(self.model_dir)
      if held is not None and held["token"] == self.token:
        os.remove(self.path)
    if self._created_dir:  # a run refused before writing anything leaves no empty folder
      with contextlib.suppress(OSError):
        os.rmdir(self.model_dir)


class BucketLease(Lease):
  """The lease on a MODEL_DIR in a bucket (gs://, s3://), by conditional writes instead of
  rename and read-back: taken by creating the lease object only if none exists (GCS
  ifGenerationMatch=0, S3 If-None-Match: *), a stale one taken over by overwriting it only at
  the version read (so of two takers one wins), and each heartbeat written only over the
  version this run wrote last: a run whose lease was taken over gets None from that write
  and stops before its next checkpoint. Released by deleting it at its last version."""

  def __init__(self, model_dir: str, *, timeout_s: float = DEFAULT_TIMEOUT_S):
    super().__init__(model_dir, timeout_s=timeout_s, settle_s=0.0)
    self.path = f"{self.model_dir.rstrip('/')}/{LEASE_FILE}"
    self.version = None  # of the lease object this run wrote last
    self._version_lock = threading.Lock()

  def _payload(self) -> bytes:
    return json.dumps({**self.record, "heartbeat": time.time()}).encode()

  def _held(self) -> tuple[dict | None, object]:
    found = storage.read_versioned(self.path)
    if found is None:
      return None, None
    try:
      lease = json.loads(found[0])
    except ValueError:
      lease = None
    return (lease if isinstance(lease, dict) and "token" in lease else {}), found[1]

  def acquire(self) -> None:
    self.version = storage.create_exclusive(self.path, self._payload())
    if self.version is None:
      held, version = self._held()
      if held is not None:  # (None: released just now; the next start takes it)
        why = self.stale(held) if held else "its lease object is unreadable"
        if why is None:
          raise self._in_use(held)
        self.version = storage.replace_if(self.path, self._payload(), version)
        if self.version is not None:
          self.taken_over = f"{describe(held)}: {why}" if held else why
      if self.version is None:  # another run created or took it over first
        raise self._in_use(self._held()[0] or {"host": "?", "pid": "?",
                                                "heartbeat": time.time()})
    self._thread = threading.Thread(target=self._beat, name="t5lite-lease", daemon=True)
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(self.timeout_s / 10):
      try:
        with self._version_lock:  # check() must not read between this write and its version
          version = storage.replace_if(self.path, self._payload(), self.version)
          if version is not None:
            self.version = version
            continue
      except (ConfigError, OSError):
        continue  # the storage failed past its retries: the next beat tries again
      # Refused: taken over (stop beating), or this run's own write landed although its
      # answer was lost and the client's retry then failed the precondition.
      with contextlib.suppress(ConfigError, OSError):
        if not self._still_ours():
          return

  def _still_ours(self) -> bool:
    """Whether the lease object still holds this run's token; if so, its version is taken
    as this run's last (a write whose answer was lost still counts as this run's)."""
    with self._version_lock:
      held, version = self._held()
      if held and held.get("token") == self.token:
        self.version = version
      elif self.lost is None:
        self.lost = ("another trainer took over its lease"
                     + (f" ({describe(held)})" if held else " (the lease object is gone)"))
    return self.lost is None

  def check(self) -> str | None:
    if self.lost is None:
      with contextlib.suppress(ConfigError, OSError):
        self._still_ours()
    return super().check() if self.lost else None

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self.version is not None and self.lost is None:
      with contextlib.suppress(ConfigError, OSError):
        storage.delete_if(self.path, self.version)


def lease_for(model_dir: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Lease:
  """The lease kind for where MODEL_DIR is: a bucket's (conditional writes) or a folder's."""
  if storage.is_url(model_dir):
    return BucketLease(model_dir, timeout_s=timeout_s)
  return Lease(model_dir, timeout_s=timeout_s)


@contextlib.contextmanager
def hold(model_dir: str, *, timeout_s: float = DEFAULT_TIMEOUT_S):
  """Process 0 holds MODEL_DIR's lease for the duration (yielded; None on the others). Every
  process raises ConfigError when process 0 cannot take it (held by another run, or MODEL_DIR
  not writable), so all of them stop together."""
  import jax
  lease = lease_for(model_dir, timeout_s=timeout_s) if jax.process_index() == 0 else None
  error = None
  if lease is not None:
    try:
      lease.acquire()
    except ConfigError as e:
      error = e
    except OSError as e:  # read-only, full, permission denied: the run could write nothing
      error = ConfigError(f"MODEL_DIR {model_dir} is not writable ({e.strerror or e}: "
                          f"{e.filename or model_dir}); a training run writes its checkpoints "
                          "and metrics there: use a writable folder (eval, infer and export "
                          "only read it)")
  if any(all_flags(error is not None)):
    raise error or ConfigError(f"process 0 could not take the lease of MODEL_DIR {model_dir} "
                               "(its output says why)")
  try:
    yield lease
  finally:
    if lease is not None:
      lease.release()
