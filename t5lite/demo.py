"""The README's main job: the embedded default, end to end, with the real CLI commands.

  python -m t5lite.demo [--out runs/demo] [--steps 300]
  python -m t5lite.demo --recipe bert [--out runs/demo_bert]

1. pretrain a tiny T5 with span corruption on the standard library's prose (gin/runs/demo.gin;
   the dataset and its SentencePiece vocabulary are built on first use), stopping halfway;
2. rerun the same command with the full TRAIN_STEPS: it resumes from the checkpoint;
3. finetune on the embedded supervised task (docstring body -> first line) from the
   pretrained checkpoint (gin/runs/demo_finetune.gin), with the task's real metric (ROUGE on
   greedy decodes) before and after;
4. evaluate the finetuned checkpoint that is best by ROUGE-Lsum (the run keeps it:
   best_checkpoint.json) with `t5lite eval` and show a few decoded examples next to their
   references;
5. plot both runs' loss curves (PNG).

Each command is printed before it runs, so the demo doubles as a walkthrough. Fails (exit 1)
unless the pretraining loss falls and finetuning lowers the eval loss (at its lowest) and
raises ROUGE (at the best checkpoint). The finetuning eval loss rises again after its lowest
point while ROUGE still improves (many epochs of a small task); the demo says so.
`make demo` runs it with the defaults, in about four minutes on 2 quiet cores.

--recipe bert is BERT's chain on the same embedded text (docs/finetuning.md): pretrain
gin/models/bert/tiny.gin with MLM + next-sentence prediction on sentence pairs
(gin/runs/stdlib_bert_pretrain.gin), finetune a classification head from that checkpoint on
the embedded 8-way task (which module's docstring a sentence is from;
gin/runs/bert_finetune.gin), with its accuracy before (the new head untrained) and after,
then `t5lite eval`. Fails unless the pretraining loss falls and finetuning raises accuracy.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Sequence

from t5lite.cli.plot import read_metrics

TASK = "stdlib_docstring_summary"
LENGTHS = "{'inputs': 256, 'targets': 32}"  # as in gin/runs/demo_finetune.gin


def _run(argv: list[str]) -> None:
  print(f"\n$ t5lite {shlex.join(argv)}", flush=True)
  started = time.time()
  subprocess.run([sys.executable, "-m", "t5lite.cli", *argv], check=True)
  print(f"  ({time.time() - started:.0f}s)", flush=True)


def _mean(values: list[float]) -> float:
  return sum(values) / len(values)


def _train_losses(model_dir: str) -> list[float]:
  return [r["loss"] for r in read_metrics(model_dir) if r.get("loss") is not None]


def _eval_series(model_dir: str, suffix: str) -> list[tuple[int, float]]:
  """(step, value) of every eval/<task><suffix> figure in MODEL_DIR/metrics.jsonl."""
  return [(r["step"], v) for r in read_metrics(model_dir) for k, v in r.items()
          if k.startswith("eval/") and k.endswith(suffix) and v is not None]


def _show_examples(eval_dir: str, count: int = 3) -> None:
  path = max((os.path.join(eval_dir, f) for f in os.listdir(eval_dir)
              if f.startswith(TASK) and f.endswith(".jsonl")), key=os.path.getmtime)
  with open(path, encoding="utf-8") as f:
    records = [json.loads(line) for line in f][:count]
  print(f"\nA few validation examples ({path}):")
  for record in records:
    print(f"  input:      {record['inputs'][:110]}...")
    print(f"  reference:  {record['target']}")
    print(f"  prediction: {record['prediction']}\n")


BERT_TASK = "stdlib_docstring_module_head"


def bert_recipe(out: str, steps: int, finetune_steps: int) -> int:
  """BERT: pretrain (MLM + NSP) -> finetune a classifier -> eval; see the module docstring."""
  pretrain, finetune = os.path.join(out, "pretrain"), os.path.join(out, "finetune")
  shutil.rmtree(out, ignore_errors=True)
  started = time.time()
  model = "--gin_file=gin/models/bert/tiny.gin"
  _run(["train", model, "--gin_file=gin/runs/stdlib_bert_pretrain.gin",
        f"--gin.MODEL_DIR={pretrain}", f"--gin.TRAIN_STEPS={steps}"])
  _run(["train", model, "--gin_file=gin/runs/bert_finetune.gin", f"--gin.MODEL_DIR={finetune}",
        f"--gin.INITIAL_CHECKPOINT_PATH={pretrain}",
        f"--gin.TRAIN_STEPS={steps + finetune_steps}",
        f"--gin.EVAL_PERIOD={max(1, finetune_steps // 3)}"])
  _run(["eval", "--gin_file=gin/runs/eval.gin", f"--gin.CHECKPOINT_PATH={finetune}",
        f"--gin.MIXTURE_OR_TASK_NAME={BERT_TASK}", "--gin.TASK_FEATURE_LENGTHS={'inputs': 64}"])
  losses = _train_losses(pretrain)
  k = max(1, min(3, len(losses) // 2))
  first, last = _mean(losses[:k]), _mean(losses[-k:])
  accuracy = _eval_series(finetune, f"{BERT_TASK}/accuracy")
  summary = {"pretrain_loss_first": round(first, 4), "pretrain_loss_last": round(last, 4),
             "finetune_accuracy": [[s, round(v, 2)] for s, v in accuracy],
             "seconds": round(time.time() - started, 1)}
  print("\ndemo: " + json.dumps(summary))
  if not last < first:
    print("demo: FAILED, the pretraining loss did not fall", file=sys.stderr)
    return 1
  if len(accuracy) < 2 or not accuracy[-1][1] > accuracy[0][1]:
    print("demo: FAILED, finetuning did not raise the accuracy", file=sys.stderr)
    return 1
  print(f"demo: BERT pretraining loss {first:.2f} -> {last:.2f}; {BERT_TASK} accuracy "
        f"{accuracy[0][1]:.1f} -> {accuracy[-1][1]:.1f}; model dirs {pretrain}, {finetune}")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m t5lite.demo", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--recipe", choices=("t5", "bert"), default="t5",
                      help="t5 (the default) or bert (pretrain -> finetune a classifier)")
  parser.add_argument("--out", default=None, help="folder of the two MODEL_DIRs (emptied "
                      "first; default runs/demo, or runs/demo_bert)")
  parser.add_argument("--steps", type=int, default=400, help="pretraining steps")
  parser.add_argument("--finetune_steps", type=int, default=300)
  args = parser.parse_args(argv)
  if args.recipe == "bert":
    return bert_recipe(args.out or "runs/demo_bert", args.steps, args.finetune_steps)
  args.out = args.out or "runs/demo"
  pretrain, finetune = os.path.join(args.out, "pretrain"), os.path.join(args.out, "finetune")
  shutil.rmtree(args.out, ignore_errors=True)
  started = time.time()

  base = ["train", "--gin_file=gin/runs/demo.gin", f"--gin.MODEL_DIR={pretrain}"]
  _run(base + [f"--gin.TRAIN_STEPS={args.steps // 2}"])   # stops halfway, checkpointed
  _run(base + [f"--gin.TRAIN_STEPS={args.steps}"])        # resumes there, to the end
  _run(["train", "--gin_file=gin/runs/demo_finetune.gin", f"--gin.MODEL_DIR={finetune}",
        f"--gin.INITIAL_CHECKPOINT_PATH={pretrain}",
        f"--gin.TRAIN_STEPS={args.steps + args.finetune_steps}"])
  # The checkpoint with the best ROUGE-Lsum (CheckpointConfig.best_metric), not the last.
  best = _best_checkpoint(finetune)
  _run(["eval", "--gin_file=gin/runs/eval.gin",
        f"--gin.CHECKPOINT_PATH={os.path.join(finetune, 'checkpoints', str(best['step']))}",
        f"--gin.MIXTURE_OR_TASK_NAME={TASK}", f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}"])
  _show_examples(os.path.join(finetune, "eval"))
  for model_dir in (pretrain, finetune):
    _run(["plot", model_dir])

  losses = _train_losses(pretrain)
  k = max(1, min(3, len(losses) // 2))
  first, last = _mean(losses[:k]), _mean(losses[-k:])
  evals = _eval_series(finetune, "/loss")
  rouge = _eval_series(finetune, "/rougeLsum")
  lowest = min(evals, key=lambda point: point[1]) if evals else None
  summary = {"pretrain_loss_first": round(first, 4), "pretrain_loss_last": round(last, 4),
             "finetune_eval_loss": [[s, round(v, 4)] for s, v in evals],
             "finetune_rougeLsum": [[s, round(v, 2)] for s, v in rouge],
             "best_checkpoint": best, "seconds": round(time.time() - started, 1)}
  print("\ndemo: " + json.dumps(summary))
  if not last < first:
    print("demo: FAILED, the pretraining loss did not fall", file=sys.stderr)
    return 1
  if len(evals) < 2 or not lowest[1] < evals[0][1]:
    print("demo: FAILED, finetuning did not lower the eval loss", file=sys.stderr)
    return 1
  if len(rouge) < 2 or not best["value"] > rouge[0][1]:
    print("demo: FAILED, finetuning did not raise ROUGE-Lsum", file=sys.stderr)
    return 1
  if evals[-1][1] > lowest[1]:
    print(f"demo: what to expect: the eval loss is lowest at step {lowest[0]} and rises after "
          "it while ROUGE-Lsum still improves. 300 steps are many epochs of this small task: "
          "the model grows more confident on the tokens it still gets wrong (a higher loss) "
          "while its greedy summaries get better. Keep the checkpoint that is best by the "
          f"task's metric: best_checkpoint.json names it (step {best['step']}).")
  print(f"demo: pretraining loss {first:.2f} -> {last:.2f}; finetuning eval loss "
        f"{evals[0][1]:.2f} -> {lowest[1]:.2f} at its lowest (step {lowest[0]}), ROUGE-Lsum "
        f"{rouge[0][1]:.1f} -> {best['value']:.1f} at the best checkpoint (step "
        f"{best['step']}); model dirs {pretrain}, {finetune}")
  return 0


def _best_checkpoint(model_dir: str) -> dict:
  """MODEL_DIR/best_checkpoint.json: {"step", "metric", "value"} of the best checkpoint."""
  with open(os.path.join(model_dir, "best_checkpoint.json"), encoding="utf-8") as f:
    return json.load(f)


if __name__ == "__main__":
  sys.exit(main())
