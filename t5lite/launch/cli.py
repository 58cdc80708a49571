"""`t5lite launch`: the per-host commands of a pod job, printed (--dry-run) or started.

    t5lite launch --dry-run                       # a worked example: 2 hosts x 8 GPUs over ssh
    t5lite launch --kind=slurm --num_hosts=4 --dry-run -- --gin_file=... --gin.MODEL_DIR=...
    t5lite launch --kind=local --num_hosts=2 --devices_per_host=2 -- --gin_file=...

Without --dry-run the plan runs: `local` and `ssh` start one process per host here and wait
for all of them; tpu_vm, slurm and jobset run their one submit command (gcloud, sbatch,
kubectl), which must be on PATH. The exit code is the worst of the processes' (42 when they
were preempted and saved).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

from t5lite.launch import commands

EPILOG = """After `--`: the verb and its flags (default verb: train), e.g.
  t5lite launch --kind=tpu_vm --name=my-v5e --zone=ZONE --num_hosts=8 --devices_per_host=4 \\
    --dry-run -- --gin_file=gin/runs/pods/t5_1_1_xl_v5e.gin \\
    --gin.MIXTURE_OR_TASK_NAME=c4_span_corruption --gin.MODEL_DIR=gs://my-bucket/run
Without them, example flags (T5 1.1 base on C4), printed only. With no flags at all: a
worked 2-host example. MODEL_DIR: a gs:// URL (the gcs extra on every host), or a folder
every host sees at the same path (NFS, Filestore).
Recipes: t5lite/launch/recipes/; choosing mesh shapes: t5lite/launch/README.md."""


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="t5lite launch", description="Print (--dry-run) or start the per-host commands of "
      "a multi-host job.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                      help="print the commands; start nothing")
  parser.add_argument("--kind", choices=commands.KINDS, default="ssh",
                      help="ssh: explicit flags per host; local: processes on this machine; "
                      "tpu_vm: gcloud on a TPU VM pod; slurm: sbatch; jobset: a Kubernetes "
                      "JobSet (default ssh)")
  parser.add_argument("--num_hosts", type=int, default=2, help="hosts, one process each")
  parser.add_argument("--devices_per_host", type=int, default=8)
  parser.add_argument("--hosts", default="", help="ssh: comma-separated host names, process 0 "
                      "first (default host0,host1,...)")
  parser.add_argument("--port", type=int, default=None, help="coordinator port")
  parser.add_argument("--name", default="t5lite", help="TPU VM, JobSet or SLURM job name")
  parser.add_argument("--zone", default="us-central2-b", help="tpu_vm: the TPU's zone")
  parser.add_argument("--project", default=None, help="tpu_vm: the GCP project")
  parser.add_argument("--image", default="REGISTRY/t5lite:latest", help="jobset: the image")
  parser.add_argument("--workdir", default="t5lite",
                      help="ssh, tpu_vm: the repo's checkout on each host")
  parser.add_argument("--python", default="python3", help="the Python that has t5lite")
  return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
  if "--" in argv:
    i = argv.index("--")
    return argv[:i], argv[i + 1:]
  return argv, []


def main(argv: list[str]) -> int:
  own, verb_args = _split(list(argv))
  args = _parser().parse_args(own)
  example = not verb_args
  worked_example = example and all(a in ("--dry-run", "--dry_run") for a in own)
  if example:
    verb_args = list(commands.EXAMPLE_ARGS)
  topology = commands.Topology(
      kind=args.kind, num_hosts=args.num_hosts, devices_per_host=args.devices_per_host,
      hosts=tuple(h for h in args.hosts.split(",") if h), port=args.port, name=args.name,
      zone=args.zone, project=args.project, image=args.image, workdir=args.workdir,
      python=args.python)
  plan = commands.make_plan(topology, verb_args)
  if worked_example:
    print("# A worked example: a 2-host job over ssh (pass --kind, --num_hosts, ... and `-- "
          "<flags>` for yours).")
  if args.dry_run or example:
    print(commands.render(plan), end="")
    if example and not args.dry_run:
      print("# (example flags: printed, not run; pass yours after `--`)")
    return 0
  return run(plan)


def run(plan: commands.Plan) -> int:
  """Starts the plan; returns the worst exit code (the submit command's, or the processes')."""
  if plan.submit:
    tool = plan.submit[0]
    if shutil.which(tool) is None:
      raise FileNotFoundError(f"{tool} is not on PATH; `t5lite launch --dry-run` prints the "
                              "commands to run where it is")
    return subprocess.run(plan.submit, input=plan.stdin, text=True).returncode
  if plan.topology.kind == "ssh" and shutil.which("ssh") is None:
    raise FileNotFoundError("ssh is not on PATH")
  processes = [subprocess.Popen(h.argv, env=commands.environment(h)) for h in plan.hosts]
  codes = [p.wait() for p in processes]
  print(f"t5lite launch: exit codes {codes}", file=sys.stderr)
  return worst(codes)


def worst(codes: list[int]) -> int:
  """0 when all are 0; else the first failure that is not a preemption, else the preemption."""
  failures = [c for c in codes if c != 0]
  if not failures:
    return 0
  others = [c for c in failures if c != commands.PREEMPTED_EXIT_CODE]
  code = others[0] if others else failures[0]
  return code if code > 0 else 128 - code  # killed by a signal: as a shell reports it

