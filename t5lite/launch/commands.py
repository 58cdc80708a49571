"""The commands of a pod job, per launcher: what `t5lite launch` prints (--dry-run) or runs.

    plan = make_plan(Topology(kind="ssh", hosts=("host0", "host1")), ["train", "--gin_file=..."])
    print(render(plan))

A Plan is data: an optional submit command (gcloud, sbatch, kubectl with a manifest on stdin)
and one entry per host or process saying what runs there. Nothing here starts anything.

  ssh     one `ssh HOST '...'` per host, with explicit --coordinator_address / --num_processes /
          --process_id (any machines that can reach each other)
  local   N processes on this machine, fake CPU devices each: the multi-host path on a laptop
  tpu_vm  recipes/tpu_vm_pod.sh: one gcloud command runs the same command on every worker,
          which finds its place itself (TPU VM metadata)
  slurm   recipes/slurm_gpu.sbatch through sbatch; each srun task finds its place itself
  jobset  recipes/jobset.yaml rendered, for `kubectl apply -f -`; each pod finds its place
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import shlex
import string
import textwrap

from t5lite.errors import ConfigError
from t5lite.launch import PREEMPTED_EXIT_CODE
from t5lite.launch.cluster import DEFAULT_COORDINATOR_PORT, TPU_COORDINATOR_PORT

RECIPES = pathlib.Path(__file__).resolve().parent / "recipes"
KINDS = ("ssh", "local", "tpu_vm", "slurm", "jobset")
VERBS = ("train", "eval", "infer")
EXAMPLE_ARGS = ("train", "--gin_file=gin/runs/pretrain.gin",
                "--gin_file=gin/models/t5_1_1/base.gin",
                "--gin.MIXTURE_OR_TASK_NAME=c4_span_corruption",
                "--gin.MODEL_DIR=gs://my-bucket/t5_1_1_base")


@dataclasses.dataclass(frozen=True)
class Topology:
  """Where a job runs; fields a kind does not use are ignored."""

  kind: str = "ssh"
  num_hosts: int = 2
  """Hosts (one process each); ssh takes the count from `hosts` when given."""
  devices_per_host: int = 8
  """Accelerators per host (GPUs, TPU chips; fake CPU devices for local)."""
  hosts: tuple[str, ...] = ()
  """ssh: host names, process 0 first (default host0, host1, ...)."""
  port: int | None = None
  """Coordinator port (default: 8476; TPU VMs 8482; SLURM derives it from the job id)."""
  name: str = "t5lite"
  """tpu_vm: the TPU VM's name; jobset: the JobSet's name; slurm: the job name."""
  zone: str = "us-central2-b"
  project: str | None = None
  image: str = "REGISTRY/t5lite:latest"
  """jobset: the container image (t5lite installed)."""
  workdir: str = "t5lite"
  """ssh / tpu_vm: the repo's checkout on every host (relative to the login folder)."""
  python: str = "python3"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ConfigError(f"unknown launch kind {self.kind!r}; one of {', '.join(KINDS)}")
    if self.num_hosts < 1 or self.devices_per_host < 1:
      raise ConfigError("--num_hosts and --devices_per_host must be >= 1")

  @property
  def host_names(self) -> tuple[str, ...]:
    return self.hosts or tuple(f"host{i}" for i in range(self.num_hosts))

  @property
  def process_count(self) -> int:
    return len(self.hosts) if self.kind == "ssh" and self.hosts else self.num_hosts


@dataclasses.dataclass(frozen=True)
class HostCommand:
  """What one host (or local process) runs: argv, and environment variables it adds."""

  host: str
  argv: tuple[str, ...]
  env: tuple[tuple[str, str], ...] = ()
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Plan:
  topology: Topology
  hosts: tuple[HostCommand, ...]
  submit: tuple[str, ...] | None = None
  """The one command that starts the job (gcloud, sbatch, kubectl); None: run `hosts`."""
  stdin: str | None = None
  """What `submit` reads (the JobSet manifest)."""
  notes: tuple[str, ...] = ()


def split_verb(args: list[str] | tuple[str, ...]) -> tuple[str, list[str]]:
  """('train', flags) from the words after `--`; the verb defaults to train."""
  args = list(args)
  if args and args[0] in VERBS:
    return args[0], args[1:]
  return "train", args


def _t5lite(topology: Topology, verb: str, flags: list[str]) -> list[str]:
  return [topology.python, "-m", "t5lite.cli", verb, *flags]


def _explicit(topology: Topology, coordinator: str, index: int) -> list[str]:
  return [f"--coordinator_address={coordinator}", f"--num_processes={topology.process_count}",
          f"--process_id={index}"]


def _ssh_plan(topology: Topology, verb: str, flags: list[str]) -> Plan:
  hosts = topology.host_names[:topology.process_count]
  coordinator = f"{hosts[0]}:{topology.port or DEFAULT_COORDINATOR_PORT}"
  commands = []
  for i, host in enumerate(hosts):
    remote = (f"cd {shlex.quote(topology.workdir)} && "
              + shlex.join(_t5lite(topology, verb, flags + _explicit(topology, coordinator, i))))
    commands.append(HostCommand(host, ("ssh", host, remote),
                                note="process 0: the coordinator" if i == 0 else f"process {i}"))
  return Plan(topology, tuple(commands))


def _local_plan(topology: Topology, verb: str, flags: list[str]) -> Plan:
  coordinator = f"127.0.0.1:{topology.port or DEFAULT_COORDINATOR_PORT}"
  env = (("JAX_PLATFORMS", "cpu"),
         ("XLA_FLAGS", f"--xla_force_host_platform_device_count={topology.devices_per_host}"))
  commands = tuple(
      HostCommand(f"process {i}", tuple(_t5lite(topology, verb,
                                                flags + _explicit(topology, coordinator, i))),
                  env)
      for i in range(topology.num_hosts))
  return Plan(topology, commands, notes=(
      "local: every process on this machine with fake CPU devices; pick a free port with "
      "--port when 8476 is taken",))


def _detected(topology: Topology, verb: str, flags: list[str], where: str) -> tuple:
  """One entry per host for launchers whose processes find their place themselves; `where`
  may name the host's index as {i}."""
  argv = tuple(_t5lite(topology, verb, flags))
  return tuple(HostCommand(f"host {i}", argv, note=f"process {i} of {topology.num_hosts}; "
                           + where.format(i=i)) for i in range(topology.num_hosts))


def _tpu_vm_plan(topology: Topology, verb: str, flags: list[str]) -> Plan:
  command = f"cd {shlex.quote(topology.workdir)} && " + shlex.join(_t5lite(topology, verb, flags))
  submit = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", topology.name,
            f"--zone={topology.zone}", *([f"--project={topology.project}"]
                                         if topology.project else []),
            "--worker=all", f"--command={command}"]
  where = f"coordinator: worker 0, port {TPU_COORDINATOR_PORT} (TPU VM metadata)"
  return Plan(topology, _detected(topology, verb, flags, where), tuple(submit), notes=(
      f"the same as: TPU_NAME={topology.name} ZONE={topology.zone} "
      f"{RECIPES / 'tpu_vm_pod.sh'} <flags>; with GCS_BUCKET=BUCKET the script first mounts "
      "the bucket at /gcs/BUCKET on every worker (gcsfuse)",))


def _slurm_plan(topology: Topology, verb: str, flags: list[str]) -> Plan:
  if verb != "train":
    raise ConfigError("the SLURM recipe runs `t5lite train`; use --kind=ssh for other verbs")
  submit = ["sbatch", f"--job-name={topology.name}", f"--nodes={topology.num_hosts}",
            "--ntasks-per-node=1", f"--gpus-per-node={topology.devices_per_host}",
            str(RECIPES / "slurm_gpu.sbatch"), *flags]
  where = ("srun task; coordinator: the first node, port from the job id; exit "
           f"{PREEMPTED_EXIT_CODE} requeues the job")
  return Plan(topology, _detected(topology, verb, flags, where), tuple(submit))


def jobset_manifest(topology: Topology, verb: str, flags: list[str]) -> str:
  """recipes/jobset.yaml with this topology and command filled in."""
  template = string.Template((RECIPES / "jobset.yaml").read_text(encoding="utf-8"))
  return template.safe_substitute(
      NAME=topology.name, NUM_HOSTS=topology.num_hosts, GPUS_PER_HOST=topology.devices_per_host,
      IMAGE=topology.image, PORT=topology.port or DEFAULT_COORDINATOR_PORT,
      COMMAND=shlex.join(_t5lite(topology, verb, flags)))


def _jobset_plan(topology: Topology, verb: str, flags: list[str]) -> Plan:
  where = (f"pod {topology.name}-workers-0-{{i}}; coordinator: {topology.name}-workers-0-0."
           f"{topology.name}:{topology.port or DEFAULT_COORDINATOR_PORT}")
  return Plan(topology, _detected(topology, verb, flags, where), ("kubectl", "apply", "-f", "-"),
              stdin=jobset_manifest(topology, verb, flags))


PLANNERS = {"ssh": _ssh_plan, "local": _local_plan, "tpu_vm": _tpu_vm_plan,
            "slurm": _slurm_plan, "jobset": _jobset_plan}


def make_plan(topology: Topology, args: list[str] | tuple[str, ...]) -> Plan:
  """The plan for running `t5lite VERB FLAGS` (args: [VERB] FLAGS) on `topology`."""
  verb, flags = split_verb(args)
  taken = [f for f in flags if f.split("=")[0] in ("--coordinator_address", "--num_processes",
                                                   "--process_id")]
  if taken:
    raise ConfigError(f"t5lite launch sets the multi-host flags itself; drop {', '.join(taken)}")
  return PLANNERS[topology.kind](topology, verb, flags)


def _shell(argv, env=()) -> str:
  return " ".join([f"{k}={shlex.quote(v)}" for k, v in env] + [shlex.quote(a) for a in argv])


def render(plan: Plan) -> str:
  """The plan as text: comments, the submit command (and its manifest), one line per host."""
  t = plan.topology
  total = t.process_count * t.devices_per_host
  notes = [f"{t.kind}: {t.process_count} hosts x {t.devices_per_host} devices = {total} "
           "devices, one process per host.",
           f"The default mesh (data=-1) is data parallelism over all {total} devices: "
           f"BATCH_SIZE must be a multiple of {total} (other meshes: a multiple of data x "
           "fsdp; t5lite/launch/README.md).",
           f"Exit code {PREEMPTED_EXIT_CODE}: preempted, every process saved the same step; "
           "rerun to resume.",
           "MODEL_DIR: a gs:// URL (the gcs extra on every host), or a folder "
           "every host sees at the same path (NFS, Filestore).", *plan.notes]
  lines = [line for note in notes for line in textwrap.wrap(
      note, 96, initial_indent="# ", subsequent_indent="#   ")]
  if plan.submit:
    lines += ["", "# submit:", _shell(plan.submit)]
    if plan.stdin:
      lines += ["# with this manifest on stdin:", plan.stdin.rstrip()]
    lines += ["", "# what then runs on each host:"]
  else:
    lines += ["", "# run on each host (process 0 first; all within --initialization_timeout):"]
  for h in plan.hosts:
    lines.append(f"# {h.host}" + (f" ({h.note})" if h.note else ""))
    lines.append(_shell(h.argv, h.env))
  return "\n".join(lines) + "\n"


def environment(command: HostCommand) -> dict[str, str]:
  return {**os.environ, **dict(command.env)}
