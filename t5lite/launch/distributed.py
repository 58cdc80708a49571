"""Starting JAX's distributed runtime for a pod job, from flags or the cluster environment.

    cluster = resolve(args.coordinator_address, args.num_processes, args.process_id, os.environ)
    initialize(cluster, timeout=args.initialization_timeout)   # before any JAX computation

Flags win field by field over what cluster.detect reads from the environment (so Open MPI 5,
which does not name its launcher, needs only --coordinator_address). No cluster and no flags:
one process, said once on stderr. One detected process: nothing to start.

Failing fast. A setup that cannot form a job must not hang: jax.distributed.initialize aborts
the interpreter (a C++ fatal error, no Python exception) when its timeout passes, so it is
guarded here instead: processes other than 0 first wait (up to the timeout) until the
coordinator's port answers, and a watchdog ends the process with a plain message and exit
code 2 when the job has not formed within the timeout (a process never started, or
processes started with different --num_processes). Once connected, the processes compare
their --num_processes through the coordination service (process 0 with each, each with
process 0), so a disagreement stops all of them, not one.

JAX's own cluster detection is turned off whenever coordinator, count and id are known (all
kinds but a Cloud TPU VM's metadata): under srun or mpirun it would give each process one
GPU, not all of its host's.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from typing import Callable, Mapping

from t5lite.errors import ConfigError
from t5lite.launch import peers
from t5lite.launch.cluster import Cluster, detect, tpu_vm_present

DEFAULT_TIMEOUT = 300
SETUP_EXIT_CODE = 2  # the CLI's code for a bad setup


class DistributedSetupError(ConfigError):
  """The job could not form; the message says what to check (a ConfigError: a bad setup)."""


def add_flags(parser: argparse.ArgumentParser) -> None:
  group = parser.add_argument_group(
      "multi-host (default: detected from TPU pod, SLURM, JobSet or Open MPI variables)")
  group.add_argument("--coordinator_address", default=None, metavar="HOST:PORT",
                     help="process 0's host and a free port on it, the same for every process")
  group.add_argument("--num_processes", type=int, default=None,
                     help="processes in the job (1: a single-process run, nothing detected)")
  group.add_argument("--process_id", type=int, default=None, help="this process, 0..N-1")
  group.add_argument("--initialization_timeout", type=float, default=DEFAULT_TIMEOUT,
                     metavar="SECONDS",
                     help=f"give up (exit 2) when the job has not formed by then "
                     f"(default {DEFAULT_TIMEOUT})")
  group.add_argument("--heartbeat_timeout", type=float, default=peers.DEFAULT_HEARTBEAT_TIMEOUT,
                     metavar="SECONDS",
                     help="a process silent this long counts as lost: every other process "
                     f"then exits {peers.LOST_PROCESS_EXIT_CODE} (default "
                     f"{peers.DEFAULT_HEARTBEAT_TIMEOUT})")


def resolve(coordinator_address: str | None, num_processes: int | None,
            process_id: int | None, env: Mapping[str, str], *,
            tpu_vm: bool | None = None) -> Cluster | None:
  """The job this process belongs to (None: a single process). Raises DistributedSetupError
  for flags that cannot describe a job."""
  if num_processes is not None and num_processes < 1:
    raise DistributedSetupError(f"--num_processes must be >= 1, got {num_processes}")
  if num_processes == 1 and coordinator_address is None:
    return None  # said explicitly: no detection
  given = (coordinator_address, num_processes, process_id)
  if all(v is not None for v in given):
    found = Cluster("flags", *given)
  else:
    detected = detect(env, tpu_vm=tpu_vm_present() if tpu_vm is None else tpu_vm)
    if detected is None and all(v is None for v in given):
      return None
    base = detected or Cluster("flags", None, None, None)
    found = Cluster(base.kind if detected else "flags",
                    coordinator_address or base.coordinator_address,
                    num_processes if num_processes is not None else base.num_processes,
                    process_id if process_id is not None else base.process_id)
  return _checked(found)


def _checked(cluster: Cluster) -> Cluster | None:
  if cluster.kind == "tpu_vm" and cluster.num_processes is None:
    return cluster  # JAX reads the rest from the TPU VM metadata server
  n, i, address = cluster.num_processes, cluster.process_id, cluster.coordinator_address
  if n is None or i is None or address is None:
    missing = [flag for flag, value in (("--coordinator_address", address),
                                        ("--num_processes", n), ("--process_id", i))
               if value is None]
    if n == 1 and address is None:
      return None
    raise DistributedSetupError(
        f"a multi-process job needs {', '.join(missing)} ({cluster.describe()}); pass all of "
        "--coordinator_address, --num_processes and --process_id, or none of them inside a "
        "TPU pod, SLURM srun step, JobSet or mpirun")
  if not 0 <= i < n:
    raise DistributedSetupError(f"process id {i} is not in 0..{n - 1} ({n} processes)")
  if ":" not in address or not address.rsplit(":", 1)[1].isdigit():
    raise DistributedSetupError(f"coordinator address {address!r} is not HOST:PORT")
  return None if n == 1 else cluster


def _split(address: str) -> tuple[str, int]:
  host, port = address.rsplit(":", 1)
  return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, deadline: float) -> None:
  """Returns once HOST:PORT accepts a TCP connection; raises DistributedSetupError when the
  deadline (time.monotonic()) passes first. The host may not resolve yet (a pod starting)."""
  host, port = _split(address)
  error = None
  while True:
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline
                                                                         - time.monotonic()))):
        return
    except OSError as e:
      error = e
    if time.monotonic() >= deadline:
      raise DistributedSetupError(
          f"could not reach the coordinator at {address} ({type(error).__name__}: {error}); "
          "is process 0 running, is the address process 0's host and reachable from here, and "
          "is the port free on it? (--initialization_timeout gives it longer)")
    time.sleep(0.2)


def _watchdog(seconds: float, message: str) -> threading.Timer:
  """Ends the process with `message` and exit code 2 unless cancelled within `seconds`."""
  def fire():
    print(f"t5lite: error: {message}", file=sys.stderr, flush=True)
    os._exit(SETUP_EXIT_CODE)
  timer = threading.Timer(seconds, fire)
  timer.daemon = True
  timer.start()
  return timer


def initialize(cluster: Cluster | None, timeout: float = DEFAULT_TIMEOUT,
               log: Callable[[str], None] | None = None,
               heartbeat_timeout: float = peers.DEFAULT_HEARTBEAT_TIMEOUT) -> None:
  """Starts jax.distributed for `cluster` (see the module docstring); None: a single process.
  Call before anything touches a JAX device. Once the job has formed, the loss of any
  process ends the others with exit 43 (t5lite.launch.peers)."""
  log = log or (lambda text: print(text, file=sys.stderr, flush=True))
  if cluster is None:
    log("t5lite: single process (no --coordinator_address, and no TPU pod, SLURM srun step, "
        "JobSet or mpirun environment detected)")
    return
  import jax
  # t5lite agrees on preemption itself (trainer.py); JAX's service would catch SIGTERM in C++
  # outside the training loop, where the default (stop now, nothing to save) is right.
  try:
    jax.config.update("jax_enable_preemption_service", False)
  except (AttributeError, KeyError, ValueError):
    pass  # a JAX without that option has no such service
  started = time.monotonic()
  deadline = started + timeout
  if not heartbeat_timeout >= 1:
    raise DistributedSetupError(f"--heartbeat_timeout must be at least 1 second, got "
                                f"{heartbeat_timeout:g}")
  known = None not in (cluster.coordinator_address, cluster.num_processes, cluster.process_id)
  separate = known and cluster.process_id == 0 and peers.start_service(
      cluster.coordinator_address, cluster.num_processes, heartbeat_timeout)
  if separate:
    # Starting the service process (an interpreter importing jaxlib) is this host's own cost,
    # slow on a loaded host: it has a budget of its own and the job's wait counts after it.
    peers.wait_for_service(cluster.coordinator_address.rsplit(":", 1)[1],
                           time.monotonic() + max(timeout, peers.SERVICE_START_SECONDS))
    deadline = time.monotonic() + timeout
  elif cluster.process_id not in (None, 0):
    wait_for_coordinator(cluster.coordinator_address, deadline)
  count = cluster.num_processes or "all"
  timer = _watchdog(max(0.0, deadline - time.monotonic()), (
      f"the job did not form within {timeout:g}s ({cluster.describe()}): not every one of the "
      f"{count} processes joined. Start all of them, with the same --num_processes and "
      "distinct --process_id; a process started with another --num_processes waits like "
      "this too"))
  try:
    # JAX's own timeout is a fatal abort: leave it to the watchdog, a little later.
    with peers.without_inprocess_service(separate):
      jax.distributed.initialize(cluster.coordinator_address, cluster.num_processes,
                                 cluster.process_id, initialization_timeout=int(timeout) + 30,
                                 heartbeat_timeout_seconds=int(heartbeat_timeout),
                                 **_detection_arguments(cluster))
    _check_agreement(deadline, cluster.num_processes)
  finally:
    timer.cancel()
  if known:
    peers.watch(_coordination_client(), heartbeat_timeout)
  if jax.process_index() == 0:
    log(f"t5lite: {jax.process_count()} processes, {jax.device_count()} devices "
        f"({jax.local_device_count()} per process) via {cluster.describe()} "
        f"in {time.monotonic() - started:.1f}s")


def _detection_arguments(cluster: Cluster) -> dict:
  """Turns JAX's own cluster detection off when the job is fully known. Left on, it runs
  even with coordinator, count and id given: in an srun step or under mpirun it sets
  local_device_ids=[SLURM_LOCALID] (or the Open MPI local rank), one GPU per process, while
  t5lite runs one process per host on all of its GPUs. On a Cloud TPU VM (count unknown
  here) JAX's detection is what reads the worker list from the metadata server."""
  known = None not in (cluster.coordinator_address, cluster.num_processes, cluster.process_id)
  return {"cluster_detection_method": "deactivate"} if known else {}


def _check_agreement(deadline: float, expected: int | None) -> None:
  """Each process compares its process count with process 0's, and process 0 with everyone's,
  through the coordination service's key-value store: before any device exists, since a
  process that expects more processes than joined would wait for them when JAX builds its
  devices. `expected`: this process's --num_processes (None: JAX detected it)."""
  found = _coordination_client()
  if found is None:
    _check_agreement_by_allgather(expected)
    return
  index, count, client = found

  def read(other: int) -> int:
    milliseconds = max(1, int((deadline - time.monotonic()) * 1000))
    try:
      return int(client.blocking_key_value_get(f"t5lite/num_processes/{other}", milliseconds))
    except Exception as e:  # the runtime's timeout error (a type private to jaxlib)
      raise DistributedSetupError(f"process {other} did not report its process count in "
                                  f"time: {e}") from e

  # Process 0 hosts the service: every other process reads process 0's count before it
  # reports its own (reading after reporting raced process 0's exit: a connection error
  # instead of the disagreement), and a process that disagrees says so before it reports.
  if index != 0:
    theirs = read(0)
    if theirs != count:
      _stop_now(_disagreement(0, theirs, index, count), report=(client, index, count))
  client.key_value_set(f"t5lite/num_processes/{index}", str(count))
  for other in range(1, count) if index == 0 else ():
    theirs = read(other)
    if theirs != count:
      _stop_now(_disagreement(other, theirs, index, count))


def _stop_now(error: DistributedSetupError, report=None) -> None:
  """Prints the error and exits 2 at once, after reporting this process's count (report:
  (client, index, count)) so that process 0 reads it. Not through the CLI's error path:
  Python's exit runs jax.distributed.shutdown, a barrier the other processes never reach, and
  a process still in it when process 0 (and the coordination service with it) is gone is
  aborted by JAX (SIGABRT, no message) instead of exiting 2."""
  print(f"t5lite: error: {error}", file=sys.stderr, flush=True)
  if report is not None:
    client, index, count = report
    client.key_value_set(f"t5lite/num_processes/{index}", str(count))
  leave_job()  # exiting at once, process 0 could take the service down under the other
  os._exit(SETUP_EXIT_CODE)


EXIT_BARRIER_SECONDS = 30


def leave_job() -> None:
  """Before a process of a multi-process job exits on a setup error (the CLI's exit 2): waits
  (up to EXIT_BARRIER_SECONDS) for the other processes to reach the same point, then leaves
  the coordination service in order (jax.distributed.shutdown). Exiting at once raced: process
  0 hosts the service, and a process still starting when it went was aborted by JAX (SIGABRT,
  no message) instead of printing its own error. A bad setup that every process finds (a mesh
  that does not fit, a batch that does not split) passes the barrier at once; an error only
  some processes meet waits out the barrier and exits as before."""
  found = _coordination_client()
  if found is None or found[1] <= 1:
    return
  _, _, client = found
  peers.leave(found)  # leaving on purpose: not a lost process to the others
  try:
    client.wait_at_barrier("t5lite/exit_on_setup_error", EXIT_BARRIER_SECONDS * 1000)
  except Exception:  # the runtime's timeout error (a type private to jaxlib)
    return
  import jax
  jax.distributed.shutdown()  # every process is here: its shutdown barrier passes at once


def _coordination_client():
  """(process id, process count, client) of JAX's coordination service, or None where this
  JAX keeps it elsewhere: jax 0.4 to 0.10 hold it in jax._src.distributed.global_state, a
  private module that a later JAX may change."""
  try:
    from jax._src import distributed as jax_distributed
    state = jax_distributed.global_state
    index, count, client = state.process_id, state.num_processes, state.client
  except (ImportError, AttributeError):
    return None
  methods = ("key_value_set", "blocking_key_value_get")
  if client is None or count is None or not all(hasattr(client, m) for m in methods):
    return None
  return index, count, client


def _check_agreement_by_allgather(expected: int | None) -> None:
  """The same comparison with one all-gather, once the devices exist (the fallback where the
  coordination client is out of reach). Weaker: a process that expects more processes than
  joined waits for them while JAX builds its devices, until the watchdog ends it."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  mine = expected if expected is not None else jax.process_count()
  counts = np.asarray(multihost_utils.process_allgather(np.array([mine], np.int32))).reshape(-1)
  for other, theirs in enumerate(counts.tolist()):
    if theirs != mine:
      raise _disagreement(other, theirs, jax.process_index(), mine)


def _disagreement(other: int, theirs: int, index: int, count: int) -> DistributedSetupError:
  return DistributedSetupError(
      f"process {other} was started with --num_processes={theirs}, process {index} with "
      f"{count}; give every process the same --num_processes")
