"""Which cluster a process runs in, from its environment variables alone.

Every detector is a pure function of an env mapping, so each cluster is unit-testable here:

    detect({"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2",
            "SLURM_PROCID": "1", "SLURM_LOCALID": "0"})
    -> Cluster(kind='slurm', coordinator_address='gpu07:61586', num_processes=2, process_id=1)

Detected, in this order (the first that matches wins):
  tpu      TPU pods with TPU_WORKER_HOSTNAMES (or TPU_PROCESS_ADDRESSES) and TPU_WORKER_ID, as
           GKE and queued resources set them; multislice through MEGASCALE_* variables
  jobset   a Kubernetes JobSet whose pods carry the JOBSET_* variables of recipes/jobset.yaml
           (downward API) and JOB_COMPLETION_INDEX (set by Indexed Jobs)
  openmpi  mpirun: OMPI_COMM_WORLD_SIZE / _RANK, the launcher's address in OMPI_MCA_orte_hnp_uri
  slurm    an srun step: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID
  tpu_vm   a Cloud TPU VM without those variables (GCE): JAX reads the worker list from the
           metadata server, so only the kind is known here
Open MPI comes before SLURM (as in JAX's own detection): mpirun inside a SLURM allocation
starts its ranks through per-node daemons, which pass on the allocation's SLURM_PROCID and
SLURM_NTASKS (one task per node), so the SLURM variables there describe the daemons, not the
ranks.
The coordinator is process 0's host. Its port: T5LITE_COORDINATOR_PORT when set; else derived
from the job id on SLURM and Open MPI (several jobs may share a node), else fixed.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from t5lite.errors import ConfigError

# JAX's own choice for TPU pods; one fixed port elsewhere (each pod or VM has its own address).
TPU_COORDINATOR_PORT = 8482
DEFAULT_COORDINATOR_PORT = 8476
PORT_OVERRIDE = "T5LITE_COORDINATOR_PORT"

GOOGLE_PCI_VENDOR_ID = "0x1ae0"
# TPU chips' PCI device ids (v3, plc, v4, v5p, v5e, v6e, 7x), as jax/_src/hardware_utils.py
# lists them (a private module, so copied); gVNIC, Google's network card, is 0x0042.
TPU_PCI_DEVICE_IDS = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
                                "0x0076"})

# The variables recipes/jobset.yaml sets from the JobSet's pod labels (downward API).
JOBSET_VARIABLES = ("JOBSET_NAME", "JOBSET_REPLICATED_JOB", "JOBSET_REPLICAS", "JOBSET_JOB_INDEX",
                    "JOBSET_PODS_PER_JOB")

KIND_NAMES = {
    "flags": "command-line flags",
    "tpu": "TPU pod (TPU_WORKER_HOSTNAMES / TPU_WORKER_ID)",
    "tpu_vm": "Cloud TPU VM pod (worker list from the metadata server)",
    "jobset": "Kubernetes JobSet (JOBSET_* / JOB_COMPLETION_INDEX)",
    "slurm": "SLURM srun step",
    "openmpi": "Open MPI (mpirun)",
}


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Where this process stands in a job; None where the environment does not say."""

  kind: str
  """A KIND_NAMES key."""
  coordinator_address: str | None
  """HOST:PORT of process 0, where the coordination service listens."""
  num_processes: int | None
  process_id: int | None

  def describe(self) -> str:
    where = KIND_NAMES.get(self.kind, self.kind)
    if self.num_processes is None:
      return where
    return (f"{where}: process {self.process_id} of {self.num_processes}, coordinator "
            f"{self.coordinator_address}")


class ClusterEnvError(ConfigError):
  """A cluster environment that is detected but inconsistent (the message says what to fix)."""


def _int(env: Mapping[str, str], name: str) -> int:
  try:
    return int(env[name])
  except ValueError:
    raise ClusterEnvError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _port(env: Mapping[str, str], default: int) -> int:
  return _int(env, PORT_OVERRIDE) if env.get(PORT_OVERRIDE) else default


def first_slurm_host(node_list: str) -> str:
  """The first host of a SLURM node list: 'gpu[007-009,012],cpu1' -> 'gpu007'."""
  match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", node_list)
  if not match:
    raise ClusterEnvError(f"cannot read a host name from SLURM_STEP_NODELIST={node_list!r}")
  prefix, first_index = match.groups()
  return prefix + (first_index or "")


def _job_port(job_id: int) -> int:
  """A port in [61440, 65535] from a job id, as JAX picks it: jobs sharing a node differ."""
  return job_id % 4096 + 61440


def detect_tpu(env: Mapping[str, str]) -> Cluster | None:
  hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
  if not hosts or "TPU_WORKER_ID" not in env:
    return None
  hosts = [h.split(":")[0] for h in hosts.split(",") if h]
  slices = _int(env, "MEGASCALE_NUM_SLICES") if env.get("MEGASCALE_NUM_SLICES") else 1
  slice_id = _int(env, "MEGASCALE_SLICE_ID") if env.get("MEGASCALE_SLICE_ID") else 0
  # Across slices, process 0 is worker 0 of slice 0: MEGASCALE_COORDINATOR_ADDRESS names it.
  host = (env.get("MEGASCALE_COORDINATOR_ADDRESS") or hosts[0]).split(":")[0]
  return Cluster("tpu", f"{host}:{_port(env, TPU_COORDINATOR_PORT)}", len(hosts) * slices,
                 _int(env, "TPU_WORKER_ID") + slice_id * len(hosts))


def detect_jobset(env: Mapping[str, str]) -> Cluster | None:
  """Process id = job index x pods per job + completion index; process 0 is pod 0 of job 0,
  reachable as <jobset>-<replicated job>-0-0.<subdomain> (JobSet's DNS hostnames)."""
  if not all(env.get(name) for name in ("JOBSET_NAME", "JOB_COMPLETION_INDEX")):
    return None
  missing = [name for name in JOBSET_VARIABLES if not env.get(name)]
  if missing:
    raise ClusterEnvError(f"JobSet pod without {', '.join(missing)}: set them as "
                          "t5lite/launch/recipes/jobset.yaml does")
  pods = _int(env, "JOBSET_PODS_PER_JOB")
  name, job = env["JOBSET_NAME"], env["JOBSET_REPLICATED_JOB"]
  subdomain = env.get("JOBSET_SUBDOMAIN") or name
  host = f"{name}-{job}-0-0.{subdomain}"
  return Cluster("jobset", f"{host}:{_port(env, DEFAULT_COORDINATOR_PORT)}",
                 _int(env, "JOBSET_REPLICAS") * pods,
                 _int(env, "JOBSET_JOB_INDEX") * pods + _int(env, "JOB_COMPLETION_INDEX"))


def detect_slurm(env: Mapping[str, str]) -> Cluster | None:
  needed = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
  if not all(env.get(name) for name in needed):
    return None  # e.g. the batch script itself, outside srun: one process
  host = first_slurm_host(env["SLURM_STEP_NODELIST"])
  port = _port(env, _job_port(_int(env, "SLURM_JOB_ID")))
  return Cluster("slurm", f"{host}:{port}", _int(env, "SLURM_NTASKS"),
                 _int(env, "SLURM_PROCID"))


def detect_openmpi(env: Mapping[str, str]) -> Cluster | None:
  """Open MPI 4 names the launcher in OMPI_MCA_orte_hnp_uri, e.g.
  '1531576320.0;tcp://10.96.0.1,10.148.0.1:34911'; Open MPI 5 does not: the coordinator then
  comes from --coordinator_address."""
  if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_COMM_WORLD_RANK" not in env:
    return None
  address = None
  uri = env.get("OMPI_MCA_orte_hnp_uri")
  if uri:
    match = re.search(r"tcp://([^,:]+)|tcp6://\[([^,\]]+)", uri)
    if match is None:
      raise ClusterEnvError(f"cannot read the launcher address from OMPI_MCA_orte_hnp_uri={uri!r}")
    job_id = int(uri.split(".", 1)[0]) // 4096  # Open MPI job ids are multiples of 2^12
    host = match.group(1) or f"[{match.group(2)}]"
    address = f"{host}:{_port(env, _job_port(job_id))}"
  return Cluster("openmpi", address, _int(env, "OMPI_COMM_WORLD_SIZE"),
                 _int(env, "OMPI_COMM_WORLD_RANK"))


# Open MPI before SLURM: see the module docstring.
DETECTORS = (detect_tpu, detect_jobset, detect_openmpi, detect_slurm)


def detect(env: Mapping[str, str], *, tpu_vm: bool = False) -> Cluster | None:
  """The cluster described by `env`, or None. tpu_vm: this machine is a Cloud TPU VM (see
  tpu_vm_present), whose pod layout only the metadata server knows."""
  for detector in DETECTORS:
    found = detector(env)
    if found is not None:
      return found
  if tpu_vm:
    return Cluster("tpu_vm", None, None, None)
  return None


def tpu_vm_present(sys_pci: str = "/sys/bus/pci/devices") -> bool:
  """True on a machine with Google TPU chips and libtpu installed."""
  import importlib.util
  return importlib.util.find_spec("libtpu") is not None and tpu_chips_present(sys_pci)


def tpu_chips_present(sys_pci: str = "/sys/bus/pci/devices") -> bool:
  """Whether a PCI device is a TPU chip: Google's vendor id and a TPU device id. The vendor
  id alone also matches GCE's gVNIC network card, on every GCE VM."""
  import os
  try:
    devices = os.listdir(sys_pci)
  except OSError:
    return False
  for device in devices:
    try:
      with open(os.path.join(sys_pci, device, "vendor"), encoding="ascii") as f:
        if f.read().strip() != GOOGLE_PCI_VENDOR_ID:
          continue
      with open(os.path.join(sys_pci, device, "device"), encoding="ascii") as f:
        if f.read().strip() in TPU_PCI_DEVICE_IDS:
          return True
    except OSError:
      continue
  return False
