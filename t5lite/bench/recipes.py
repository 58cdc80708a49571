"""`t5lite bench recipes`: ELECTRA vs BERT at equal compute, a distilled student vs the same
student from scratch, and the memory both recipes cost, side by side on the embedded data.

  t5lite bench recipes [--out runs/bench_recipes] [--pretrain_steps 600]
                       [--finetune_steps 200] [--teacher_layers 4] [--student_layers 0,2]
                       [--parts electra,distill] [--overwrite]

Every run is a real `t5lite train` / `export` command (printed before it runs):

electra   ELECTRA (gin/models/electra/tiny.gin: discriminator d 128, a quarter-width generator)
          pretrains --pretrain_steps on stdlib_electra_pretrain; BERT's MLM (the very same
          network, its MLM head in place of the replaced-token head) pretrains on stdlib_mlm
          for as many steps as give equal pretraining FLOPs (both ELECTRA networks counted,
          Family.flops_per_example). Both are exported to HF and finetuned alike (the same
          first-token classification head, --finetune_steps) on the 8-way
          stdlib_docstring_module_head; the figure is each one's validation accuracy.
distill   a BERT-tiny-wide teacher of --teacher_layers layers pretrains (MLM, lr 1e-3) --pretrain_steps;
          a student of its --student_layers (`t5lite export student`) trains with DistilBERT's
          loss (5 soft at T=2, 2 MLM, 1 cosine) for --pretrain_steps, and the same student
          shape from a random init with MLM alone for as many steps; the figures are each
          one's validation MLM loss and accuracy, and their gaps to the teacher's.
memory    XLA's estimate for each compiled train step (t5lite logs it in the first metrics
          row): ELECTRA's pair vs the BERT run of its discriminator's size, and the
          distillation step (student + teacher) vs the teacher's own run.

Prints a table, writes OUT/recipes.json and OUT/recipes.png, and ends with one JSON line
(ratio_vs_hf null: these compare t5lite recipes with each other). Tiny models and a few
hundred steps: a check that the recipes work and how they compare here, not the papers'
numbers. About 25 minutes on 2 CPU cores with the defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from t5lite.bench import fresh_out, machine, run_t5lite
from t5lite.cli.plot import last_value, read_metrics

ELECTRA_MODEL = "gin/models/electra/tiny.gin"
MLM_ONLY = ["ModelConfig.electra=None"]
FINETUNE_TASK = "stdlib_docstring_module_head"
LENGTH = 128  # the pretraining runs' inputs length (gin/runs/stdlib_mlm.gin)
PARTS = ("electra", "distill")
DISTILL_LEARNING_RATE = 1e-3  # a 4-layer post-LN BERT at stdlib_mlm.gin's 2e-3 collapses


def _train(model_dir: str, gin_files: list[str], bindings: list[str]) -> None:
  run_t5lite(["train", *[f"--gin_file={f}" for f in gin_files], f"--gin.MODEL_DIR='{model_dir}'",
        *[f"--gin.{b}" for b in bindings]])


def _schedule(steps: int) -> list[str]:
  """The same linear warmup-and-decay shape for every run, whatever its length."""
  warmup = max(1, steps // 10)
  return [f"TRAIN_STEPS={steps}", f"ScheduleConfig.warmup_steps={warmup}",
          f"ScheduleConfig.decay_steps={steps - warmup}", f"EVAL_PERIOD={steps}",
          f"CheckpointConfig.period={steps}"]


def _first_row(model_dir: str) -> dict:
  return next(r for r in read_metrics(model_dir) if "loss" in r)


def _pretraining_flops(overrides: list[str]) -> float:
  from t5lite.cli import gin_config
  from t5lite.families import family_of
  gin_config.parse([ELECTRA_MODEL], overrides)
  family = family_of(gin_config.model_config())
  return family.flops_per_example({"encoder_input_tokens": LENGTH})


def electra_vs_bert(out: str, steps: int, finetune_steps: int) -> dict:
  electra_flops = _pretraining_flops([])
  bert_flops = _pretraining_flops(MLM_ONLY)
  bert_steps = round(steps * electra_flops / bert_flops)
  runs = {"electra": (steps, "gin/runs/stdlib_electra_pretrain.gin", []),
          "bert": (bert_steps, "gin/runs/stdlib_mlm.gin", MLM_ONLY)}
  result = {"flops_per_example": {"electra": electra_flops, "bert": bert_flops}}
  for name, (run_steps, run_file, overrides) in runs.items():
    pretrain = os.path.join(out, f"{name}_pretrain")
    _train(pretrain, [ELECTRA_MODEL, run_file], overrides + _schedule(run_steps))
    exported = os.path.join(out, f"{name}_hf")
    run_t5lite(["export", "hf", "--checkpoint", pretrain, "--out", exported])
    start = os.path.join(exported, "discriminator") if name == "electra" else exported
    finetune = os.path.join(out, f"{name}_finetune")
    _train(finetune, [ELECTRA_MODEL, "gin/runs/bert_finetune.gin"], MLM_ONLY + [
        f"INITIAL_CHECKPOINT_PATH='{start}'", "ModelConfig.classifier_activation='gelu_exact'",
        "ModelConfig.pooler=False", "TrainConfig.run_eval_before_training=False"]
        + _schedule(finetune_steps))
    result[name] = {
        "pretrain_steps": run_steps,
        "pretrain_flops": run_steps * _batch_size() * (electra_flops if name == "electra"
                                                       else bert_flops),
        "finetune_accuracy": last_value(finetune, f"eval/{FINETUNE_TASK}/accuracy"),
        "step_memory_bytes": _first_row(pretrain).get("step_memory_bytes"),
    }
  return result


def _batch_size() -> int:
  return 16  # gin/runs/stdlib_mlm.gin's BATCH_SIZE, which every pretraining run here keeps


def distilled_vs_scratch(out: str, steps: int, teacher_layers: int,
                         student_layers: list[int]) -> dict:
  model, run = "gin/models/bert/tiny.gin", "gin/runs/stdlib_mlm.gin"
  teacher = os.path.join(out, "teacher")
  schedule = _schedule(steps) + [f"ScheduleConfig.value={DISTILL_LEARNING_RATE}"]
  _train(teacher, [model, run], [f"ModelConfig.num_encoder_layers={teacher_layers}"] + schedule)
  init = os.path.join(out, "student_init")
  run_t5lite(["export", "student", "--checkpoint", teacher, "--out", init, "--layers",
        ",".join(map(str, student_layers)), "--keep_token_types", "--keep_pooler"])
  shape = [f"ModelConfig.num_encoder_layers={len(student_layers)}"]
  distilled = os.path.join(out, "student_distilled")
  _train(distilled, [model, run], shape + schedule + [
      f"INITIAL_CHECKPOINT_PATH='{init}'", "TrainConfig.distillation=@DistillationConfig()",
      f"DistillationConfig.teacher='{teacher}'", "DistillationConfig.temperature=2.0",
      "DistillationConfig.soft_weight=5.0", "DistillationConfig.hard_weight=2.0",
      "DistillationConfig.cosine_weight=1.0"])
  scratch = os.path.join(out, "student_scratch")
  _train(scratch, [model, run], shape + schedule)
  task = "stdlib_mlm"
  figures = {}
  for name, path in (("teacher", teacher), ("distilled", distilled), ("scratch", scratch)):
    # The distilled run's eval loss holds the distillation terms: its MLM part is the hard loss.
    mlm_loss = last_value(path, f"eval/{task}/distill_hard_loss" if name == "distilled"
                          else f"eval/{task}/loss")
    figures[name] = {"eval_mlm_loss": mlm_loss,
                     "eval_accuracy": last_value(path, f"eval/{task}/token_accuracy"),
                     "step_memory_bytes": _first_row(path).get("step_memory_bytes")}
  for name in ("distilled", "scratch"):
    figures[name]["accuracy_gap_to_teacher"] = (figures["teacher"]["eval_accuracy"]
                                                - figures[name]["eval_accuracy"])
  figures["layers"] = {"teacher": teacher_layers, "student": student_layers}
  return figures


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  e, d = result["electra_vs_bert"], result["distilled_vs_scratch"]
  memory = {}
  if e:
    axes[0].bar(["ELECTRA", "BERT (MLM)"], [e["electra"]["finetune_accuracy"],
                                            e["bert"]["finetune_accuracy"]], color=["C0", "C1"])
    axes[0].set_title(f"{FINETUNE_TASK}\naccuracy (%) after equal pretraining FLOPs")
    memory.update(ELECTRA=e["electra"]["step_memory_bytes"], BERT=e["bert"]["step_memory_bytes"])
  if d:
    names = ["teacher", "distilled", "scratch"]
    axes[1].bar(names, [d[n]["eval_accuracy"] for n in names], color=["C2", "C0", "C1"])
    axes[1].set_title("stdlib_mlm validation MLM accuracy")
    memory.update(distill=d["distilled"]["step_memory_bytes"],
                  teacher=d["teacher"]["step_memory_bytes"])
  axes[2].bar(list(memory), [(v or 0) / 2**20 for v in memory.values()],
              color=["C0", "C1", "C0", "C2"][:len(memory)])
  axes[2].set_title("XLA's train-step memory estimate (MiB)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def run(out: str, pretrain_steps: int, finetune_steps: int, teacher_layers: int,
        student_layers: list[int], overwrite: bool = False,
        parts: tuple[str, ...] = PARTS) -> dict:
  fresh_out(out, overwrite)
  started = time.time()
  result = {"bench": "recipes",
            "electra_vs_bert": (electra_vs_bert(out, pretrain_steps, finetune_steps)
                                if "electra" in parts else None),
            "distilled_vs_scratch": (distilled_vs_scratch(out, pretrain_steps, teacher_layers,
                                                          student_layers)
                                     if "distill" in parts else None)}
  from t5lite.bench.machine import cpu_model
  result.update(seconds=round(time.time() - started, 1), cpu=cpu_model(),
                cores=os.cpu_count(), ratio_vs_hf=None)
  with open(os.path.join(out, "recipes.json"), "w") as f:
    json.dump(result, f, indent=2)
  plot(result, os.path.join(out, "recipes.png"))
  return result


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="t5lite bench recipes", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="runs/bench_recipes")
  parser.add_argument("--pretrain_steps", type=int, default=600)
  parser.add_argument("--finetune_steps", type=int, default=200)
  parser.add_argument("--teacher_layers", type=int, default=4)
  parser.add_argument("--student_layers", default="0,2",
                      help="the teacher's layers the student keeps (DistilBERT: every other)")
  parser.add_argument("--parts", default=",".join(PARTS),
                      help="which comparisons to run: electra, distill or both")
  parser.add_argument("--overwrite", action="store_true",
                      help="empty a non-empty --out first (its runs are deleted)")
  args = parser.parse_args(argv)
  layers = [int(x) for x in args.student_layers.split(",")]
  parts = tuple(p for p in args.parts.split(",") if p)
  if not parts or set(parts) - set(PARTS):
    parser.error(f"--parts {args.parts!r}: a comma-separated choice of {', '.join(PARTS)}")
  result = run(args.out, args.pretrain_steps, args.finetune_steps, args.teacher_layers, layers,
               args.overwrite, parts)
  e, d = result["electra_vs_bert"], result["distilled_vs_scratch"]
  print(f"\n{'run':28s} {'steps':>6s} {'accuracy':>9s} {'step memory MiB':>16s}")
  for name in ("electra", "bert") if e else ():
    print(f"{name + ' -> finetuned (%)':28s} {e[name]['pretrain_steps']:6d} "
          f"{e[name]['finetune_accuracy'] or 0:9.3f} "
          f"{(e[name]['step_memory_bytes'] or 0) / 2**20:16.1f}")
  for name in ("teacher", "distilled", "scratch") if d else ():
    print(f"{name + ' (MLM accuracy)':28s} {args.pretrain_steps:6d} "
          f"{d[name]['eval_accuracy'] or 0:9.3f} {(d[name]['step_memory_bytes'] or 0) / 2**20:16.1f}")
  print(json.dumps({**result, "machine": machine.describe()}))
  return 0
