"""A lost process ends a multi-process job cleanly: one line, exit 43, within a bounded time.

Left to JAX, the loss of one process (killed, out of memory, its host gone) ends the others
with a C++ abort (SIGABRT and a stack trace): JAX's coordination service runs inside process
0 and, when a process stops sending heartbeats, tells every other process, whose client then
aborts; when process 0 itself goes, the service goes with it and the others abort at once. A
process whose peer vanished mid-collective meanwhile gets a Python error, exits, and waits in
JAX's shutdown barrier until that abort (89 s, with JAX's 100 s heartbeat timeout).

So, once the job is known (coordinator, count and id given or detected, not a Cloud TPU VM's
metadata), t5lite runs the service in a small process of its own beside process 0
(`python -m t5lite.launch.peers`, started by process 0), recoverable (a lost process is not
turned into a fatal error for the others), and every process watches the job itself: a
thread writes a heartbeat key to the service every POLL_SECONDS and reads everyone's in one
request (key-value reads: JAX's get_live_nodes would be a barrier). When a process's heartbeat has
not moved for the heartbeat timeout (--heartbeat_timeout, 60 s by default) and it did not
leave on purpose (done, exit 42, a setup error: it marks its departure first; a crash does
not), every other process prints

    t5lite: error: process 1 of 2 stopped (killed, crashed, out of memory, or its host lost): ...

and exits LOST_PROCESS_EXIT_CODE (43) at once, skipping JAX's shutdown barrier: within the
heartbeat timeout plus POLL_SECONDS. A process whose collective failed first waits for that
verdict instead of printing the collective's error. Rerunning every process resumes from the
newest checkpoint, as after a preemption.

The service process ignores SIGTERM (a preemption's saves need it until every process has
saved), outlives process 0 until the others have disconnected (they must see its loss from
there), and is replaced by the next job's on the same host and port; a port still serving
another job's connected processes is refused (exit 2), never taken over. If the host of process 0
is lost whole, the service goes with it and JAX aborts the others, as before.

This reaches into JAX internals (jax._src.distributed, jaxlib's service constructor); where a
JAX keeps them elsewhere, the job runs with JAX's own service and behaviour, and says so.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from t5lite.errors import ConfigError

LOST_PROCESS_EXIT_CODE = 43
DEFAULT_HEARTBEAT_TIMEOUT = 60
POLL_SECONDS = 2.0
SHUTDOWN_TIMEOUT = 300  # JAX's own default for its shutdown barrier
DONE_KEY = "t5lite/left/{}"
BEAT_KEY = "t5lite/beat/{}"
_SERVICE_MODULE = "t5lite.launch.peers"


class _Watch:
  """The running watch of this process (one per process)."""

  def __init__(self, client, index: int, count: int, heartbeat_timeout: float):
    self.client, self.index, self.count = client, index, count
    self.heartbeat_timeout = heartbeat_timeout
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._run, name="t5lite-peers", daemon=True)
    self._lock = threading.Lock()
    now = time.monotonic()
    self._seen = {i: (None, now) for i in range(count) if i != index}  # last beat, when seen
    self._beats = 0

  def _run(self) -> None:
    while not self.stop.wait(POLL_SECONDS):
      self._beats += 1
      with contextlib.suppress(Exception):  # the service busy: the next beat counts
        self.client.key_value_set(BEAT_KEY.format(self.index), str(self._beats),
                                  allow_overwrite=True)
      gone = self.lost()
      if gone:
        report_and_exit(gone, self.index, self.count, self.stop)

  def lost(self) -> list[int]:
    """Processes whose heartbeat has not moved for the heartbeat timeout and that did not
    leave on purpose."""
    with self._lock:
      now = time.monotonic()
      beats = self._read(BEAT_KEY)  # one request for the whole job, however many processes
      for i, (last, _) in self._seen.items():
        if beats.get(i, last) != last:
          self._seen[i] = (beats[i], now)
      silent = [i for i, (_, since) in self._seen.items()
                if now - since > self.heartbeat_timeout]
    left = self._read(DONE_KEY) if silent else {}
    return [i for i in silent if i not in left]

  def _read(self, pattern: str) -> dict[int, str]:
    """{process: value} of the keys `pattern` names, read in one request ({} on an error:
    the service busy, and the next poll asks again)."""
    folder = pattern.rsplit("/", 1)[0] + "/"
    try:
      entries = self.client.key_value_dir_get(folder)
    except Exception:  # the runtime's errors are private to jaxlib
      return {}
    return {int(key.rsplit("/", 1)[1]): value for key, value in entries
            if key.rsplit("/", 1)[1].isdigit()}


_watch: _Watch | None = None


_exiting = threading.Lock()


def report_and_exit(gone: list[int], index: int, count: int, stop: threading.Event) -> None:
  """Prints the one line and exits 43, unless this process is leaving on purpose (`stop`
  set). The watch thread and the main thread may both get here: the second waits for the
  first's exit; leave() takes the same lock."""
  _exiting.acquire()  # held until os._exit below: whoever comes second waits for that
  if stop.is_set():
    _exiting.release()
    return
  names = ", ".join(str(i) for i in gone)
  print(f"t5lite: error: process {names} of {count} stopped (killed, crashed, out of memory, "
        f"or its host lost): process {index} stops too (exit {LOST_PROCESS_EXIT_CODE}). Rerun "
        "every process of the job: training resumes from the newest checkpoint",
        file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(LOST_PROCESS_EXIT_CODE)  # JAX's shutdown barrier would wait for the lost process


def watch(coordination, heartbeat_timeout: float) -> bool:
  """Starts this process's watch of the job, after jax.distributed.initialize; coordination:
  (process id, process count, JAX's coordination client), or None where it is out of reach
  (then False: nothing is watched)."""
  global _watch
  if coordination is None or coordination[1] <= 1 or not hasattr(coordination[2],
                                                                  "key_value_dir_get"):
    return False
  index, count, client = coordination
  _watch = _Watch(client, index, count, heartbeat_timeout)
  _watch.thread.start()
  return True


def leave(coordination=None) -> None:
  """Before this process exits on purpose (done, preempted, a setup error): marks it as left,
  so that the others do not count it lost, and stops the watch. coordination: (process id,
  count, client) to mark it by when no watch runs yet (a setup error while the job forms)."""
  global _watch
  current, _watch = _watch, None
  if current is not None:
    with _exiting:  # not while the watch thread reports a loss: that exit wins
      current.stop.set()
    coordination = (current.index, current.count, current.client)
  if coordination is not None and coordination[1] > 1:
    with contextlib.suppress(Exception):
      coordination[2].key_value_set(DONE_KEY.format(coordination[0]), "1",
                                    allow_overwrite=True)


# How a collective or a barrier fails when a peer vanished (gloo on CPU, the coordination
# service's barriers): such an error waits for the service's verdict on the job.
PEER_ERROR_SIGNS = ("closed by peer", "reset by peer", "Gloo", "UNAVAILABLE",
                    "DEADLINE_EXCEEDED", "arrier", "heartbeat")


def wait_for_verdict(error: BaseException) -> None:
  """After `error` in a multi-process job: exits 43 if a process of the job was lost. An error
  that looks like a peer's loss (PEER_ERROR_SIGNS) waits up to the heartbeat timeout for the
  service to confirm it; any other is checked once. Returns when every process is there (the
  error is this process's own: the caller reports it)."""
  current = _watch
  if current is None:
    return
  patient = any(sign in str(error) for sign in PEER_ERROR_SIGNS)
  deadline = time.monotonic() + (current.heartbeat_timeout + 3 * POLL_SECONDS if patient else 0)
  while True:
    gone = current.lost()
    if gone:
      report_and_exit(gone, current.index, current.count, current.stop)
    if time.monotonic() >= deadline:
      return
    time.sleep(POLL_SECONDS / 2)


# --- the coordination service in a process of its own ----------------------------------------

# Seconds the service process may take to answer (a cold interpreter importing jaxlib on a
# busy host takes several), whatever --initialization_timeout says.
SERVICE_START_SECONDS = 120

_service: subprocess.Popen | None = None


def _service_file(port: str, suffix: str) -> str:
  return os.path.join(tempfile.gettempdir(), f"t5lite-coordinator-{port}.{suffix}")


def _answers(port: int) -> bool:
  with contextlib.suppress(OSError):
    with socket.create_connection(("127.0.0.1", port), timeout=1.0):
      return True
  return False


def _stop_stale(port: str) -> None:
  """Ends a previous job's service on this port, lingering with no process connected (a
  rerun right after a lost process must be able to bind it). A port that still serves
  connected processes, or that another program listens on, is refused: never taken over."""
  try:
    pid = int(open(_service_file(port, "pid"), encoding="utf-8").read())
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      ours = _SERVICE_MODULE.encode() in f.read()
  except (OSError, ValueError):
    ours = False
  if ours and not _clients(int(port)):
    with contextlib.suppress(OSError):
      os.kill(pid, signal.SIGKILL)
    for _ in range(100):
      if not os.path.exists(f"/proc/{pid}"):
        break
      time.sleep(0.05)
  if _answers(int(port)):
    raise ConfigError(f"the coordinator port {port} is in use on this host (another job's "
                      "coordination service, or another program): choose another port in "
                      "--coordinator_address, or end that job first")


def wait_for_service(port: str, deadline: float) -> None:
  """Returns once the service process started by start_service answers on `port`; a
  ConfigError naming its log when it exited instead, or when `deadline` passes."""
  while not _answers(int(port)):
    if (_service is not None and _service.poll() is not None) or time.monotonic() > deadline:
      log, tail = _service_file(port, "log"), []
      with contextlib.suppress(OSError):
        tail = open(log, encoding="utf-8", errors="replace").read().strip().splitlines()[-1:]
      raise ConfigError(f"the coordination service process did not start on port {port} "
                        f"({' '.join(tail) or 'no output'}; see {log})")
    time.sleep(0.2)


def _jaxlib_runtime():
  """The jaxlib module jax.distributed makes its service and clients with (private to JAX)."""
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  return jax_distributed._jax  # pylint: disable=protected-access


def start_service(coordinator_address: str, num_processes: int, heartbeat_timeout: float) -> bool:
  """On process 0: starts the coordination service process (the caller waits until its port
  answers). False (JAX then starts its own, in this process) where jaxlib's constructor is not
  where this module looks."""
  global _service
  try:
    runtime = _jaxlib_runtime()
    if not hasattr(runtime, "get_distributed_runtime_service"):
      raise AttributeError
  except (ImportError, AttributeError):
    print("t5lite: warning: this JAX keeps its coordination service elsewhere: the loss of a "
          "process ends the others by JAX's abort", file=sys.stderr, flush=True)
    return False
  port = coordinator_address.rsplit(":", 1)[1]
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}")
  _stop_stale(port)
  with open(_service_file(port, "log"), "w", encoding="utf-8") as log:
    _service = subprocess.Popen(
        [sys.executable, "-m", _SERVICE_MODULE, "--bind", bind, "--num_processes",
         str(num_processes), "--heartbeat_timeout", str(heartbeat_timeout)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        start_new_session=True)  # the terminal's ^C and the job's SIGTERM are process 0's
  with contextlib.suppress(OSError):
    with open(_service_file(port, "pid"), "w", encoding="utf-8") as f:
      f.write(str(_service.pid))
  return True


@contextlib.contextmanager
def without_inprocess_service(separate: bool):
  """jax.distributed.initialize, on process 0, starts no service of its own while `separate`
  (the one start_service started serves the job)."""
  if not separate:
    yield
    return
  from jax._src import distributed as jax_distributed
  real = jax_distributed._jax  # pylint: disable=protected-access
  jax_distributed._jax = _WithoutService(real)  # pylint: disable=protected-access
  try:
    yield
  finally:
    jax_distributed._jax = real  # pylint: disable=protected-access


class _WithoutService:
  """jaxlib's module, but get_distributed_runtime_service returns a stand-in to shut down."""

  def __init__(self, real):
    self._real = real

  def __getattr__(self, name: str):
    return getattr(self._real, name)

  @staticmethod
  def get_distributed_runtime_service(*args, **kwargs):
    return _NoService()


class _NoService:
  def shutdown(self) -> None:
    pass


def serve(bind: str, num_processes: int, heartbeat_timeout: float) -> None:
  """The service process: serves until process 0 (its parent) is gone and no other process of
  the job is connected any more (those still
  running must see process 0's loss from here, and leave). A service that stayed on would
  answer the next job's processes on this port."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  parent = os.getppid()
  service = _jaxlib_runtime().get_distributed_runtime_service(  # noqa: F841 (serves while held)
      bind, num_processes, heartbeat_timeout=int(heartbeat_timeout),
      shutdown_timeout=SHUTDOWN_TIMEOUT, recoverable=True)
  while os.getppid() == parent:  # process 0 exited, however it exited: this one is adopted
    time.sleep(0.5)
  port = int(bind.rsplit(":", 1)[1])
  deadline = time.monotonic() + heartbeat_timeout + 5 * POLL_SECONDS + 10
  while _clients(port) and time.monotonic() < deadline:
    time.sleep(0.25)
  os._exit(0)  # shutting the service down would wait on the processes that left


def _clients(port: int) -> int:
  """Established TCP connections to this host's `port`: the job's processes still there."""
  import psutil  # pylint: disable=import-outside-toplevel
  try:
    return sum(1 for c in psutil.net_connections(kind="tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)
  except (psutil.Error, OSError):
    return 1  # cannot tell: wait out the deadline


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog=f"python -m {_SERVICE_MODULE}")
  parser.add_argument("--bind", required=True)
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--heartbeat_timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT)
  args = parser.parse_args(argv)
  serve(args.bind, args.num_processes, args.heartbeat_timeout)


if __name__ == "__main__":
  main()
