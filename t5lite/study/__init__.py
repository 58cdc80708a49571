"""`t5lite study NAME`: a paper's comparison run end to end, over seeds, with its table.

  t5lite study list
  t5lite study NAME [--seeds 1] [--scale tiny|small|smoke] [--out runs/study/NAME]
                    [--arms A,B]

Each arm of the preset pretrains on the same embedded data at equal compute (the cost model's
FLOPs, both networks of a two-network recipe counted), finetunes on the same downstream tasks
with the same recipe, and is evaluated (t5lite/study/runner.py: real `t5lite train` and
`export` subprocesses, a log beside each MODEL_DIR). The report (t5lite/study/report.py) gives
mean ± std over the seeds per arm beside the paper's figure and says for each of the paper's
orderings whether it held, in OUT/study.md, OUT/study.json and OUT/study.png; the last line
printed is one JSON object. Rerunning the same command continues an interrupted study and
reruns no arm-seed already done; a larger --seeds adds seeds. --arms runs some arms only (the
table then shows those and the orderings between them); a later run without it adds the rest.

Scales: `tiny` (the default) fits a 2-core CPU in about 30 minutes a seed; `small` sizes the
arms as the papers' small models (batch 128) for a GPU or TPU; `smoke` runs tiny's models for
a few steps on one task (a check of the plumbing). Presets: t5lite/study/presets/.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from t5lite.errors import ConfigError
from t5lite.study import presets, report, runner, spec  # noqa: F401 (presets: registration)
from t5lite.util import atomic

PLAN_FILE = "plan.json"


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="t5lite study", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="example: t5lite study electra_vs_mlm --seeds 2 --out runs/study/electra")
  parser.add_argument("name", help="a preset (`t5lite study list`), or `list`")
  parser.add_argument("--seeds", type=int, default=1, help="seeds 0 .. N-1 of every arm")
  parser.add_argument("--scale", default="tiny",
                      help="tiny (2 CPU cores), small (GPU/TPU) or smoke")
  parser.add_argument("--out", default=None, help="default: runs/study/NAME")
  parser.add_argument("--arms", default="",
                      help="comma-separated arms to run (and those they need: a teacher, a "
                      "shared pretraining); default: all. Steps stay the whole study's")
  return parser


def _check_plan(out: str, plan: dict) -> None:
  """An OUT folder holds one study at one scale: a rerun continues it, another is refused."""
  path = os.path.join(out, PLAN_FILE)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      earlier = json.load(f)
    if earlier != plan:
      raise ConfigError(f"--out {out} holds study {earlier.get('study')!r} at scale "
                        f"{earlier.get('scale')!r} with other arms or steps: choose another "
                        "--out, or remove it to start over")
    return
  os.makedirs(out, exist_ok=True)
  atomic.write_file(path, json.dumps(plan, indent=1))


def main(argv: list[str]) -> int:
  args = _parser().parse_args(argv)
  if args.name == "list":
    for name in spec.names():
      study = spec.get(name)
      print(f"{name:22s} {study.title} ({study.paper}); scales: {', '.join(study.scales)}")
    return 0
  if args.seeds < 1:
    raise ConfigError(f"--seeds must be at least 1, got {args.seeds}")
  study = spec.get(args.name)
  scale = study.scale(args.scale)
  arms = tuple(name for name in args.arms.split(",") if name)
  chosen = study.only(arms) if arms else study
  out = args.out or os.path.join("runs", "study", study.name)
  started = time.time()

  def say(line: str) -> None:
    print(f"[study {study.name} {time.strftime('%H:%M:%S')}] {line}", flush=True)

  plan = runner.pretraining_plan(study, scale)
  _check_plan(out, {"study": study.name, "scale": args.scale,
                    "plan": {arm: entry["steps"] for arm, entry in plan.items()},
                    "finetune_steps": scale.finetune_steps,
                    "downstream": [task.task for task in scale.downstream]})
  for arm in chosen.arms:
    steps = plan.get(arm.name, {}).get("steps", 0)
    method = ("" if arm.finetuning.method == "full"
              else f"; finetuned by {arm.finetuning.method}")
    if arm.pretrained_by:
      say(f"arm {arm.label}: the pretrained model of arm "
          f"{study.arm(arm.pretrained_by).label}{method}")
    else:
      say(f"arm {arm.label}: {steps:,} pretraining steps"
          + (f" ({plan[arm.name]['flops']:.3g} FLOPs)" if steps else " (none: from scratch)")
          + method)
  results = runner.run(study, args.scale, args.seeds, out, say, arms)
  summary = report.summarize(chosen, results, args.scale)
  paths = report.write(chosen, results, summary, out)
  print()
  print(report.markdown(chosen, summary))
  # Not bench.machine.describe(): it starts JAX's backend, which on a GPU would take the
  # memory the training subprocesses need.
  from t5lite.bench.machine import cpu_info
  line = {"study": study.name, "scale": args.scale, "seeds": args.seeds,
          "arms": {name: {k: a[k] for k in ("score_mean", "score_std", "published")}
                   for name, a in summary["arms"].items()},
          "orderings": summary["orderings"], "seconds": round(time.time() - started, 1),
          "machine": {"cpu": cpu_info(), "cores": os.cpu_count()},
          **{f"{kind}_path": path for kind, path in paths.items()}}
  sys.stdout.write(json.dumps(line) + "\n")
  return 0
