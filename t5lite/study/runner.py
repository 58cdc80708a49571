"""Runs a study's arms: for each seed, pretrain (at equal FLOPs), export where the arm says,
finetune on each downstream task, and record the figures in OUT/ARM/seedN/result.json.

Every run is a real `t5lite train` / `export hf` subprocess (its output in a .log beside its
MODEL_DIR; its command line printed first), so an arm is exactly what a user would run. A
result.json is written last and atomically: an arm-seed that has one is done and is not
rerun; an interrupted one starts again where its runs stopped (`t5lite train` resumes a
MODEL_DIR from its newest checkpoint, and a finished run is left as it is).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time

from t5lite.cli.plot import last_value, read_metrics
from t5lite.study.spec import Arm, Finetuning, Scale, Study
from t5lite.util import atomic

RESULT_FILE = "result.json"


def pretraining_gin(arm: Arm, scale: Scale) -> tuple[list[str], list[str]]:
  """(gin files, bindings) of an arm's pretraining run at a scale, before its seed, schedule
  and teacher (what its model and batch follow from)."""
  return ([scale.model_file, arm.pretraining.run_file],
          [*scale.model_bindings, *scale.pretrain_bindings, *arm.model_bindings,
           *scale.bindings_of(arm.name), *arm.pretraining.bindings])


def pretraining_cost(arm: Arm, scale: Scale) -> tuple[float, int]:
  """(FLOPs per example of the arm's pretraining: both networks of a pair, the cost model of
  Family.flops_per_example; its batch size)."""
  import gin

  from t5lite.cli import gin_config
  from t5lite.families import family_of
  gin_config.parse(*pretraining_gin(arm, scale))
  lengths = gin.query_parameter("TASK_FEATURE_LENGTHS/macro.value")
  batch = gin.query_parameter("BATCH_SIZE/macro.value")
  family = family_of(gin_config.model_config())
  return family.flops_per_example(family.converter().model_feature_lengths(lengths)), batch


def pretraining_plan(study: Study, scale: Scale) -> dict[str, dict]:
  """{arm: {steps, flops_per_example, batch, flops}} for the arms that pretrain: the
  reference arm for scale.pretrain_steps, the others for as many FLOPs (or steps)."""
  plan = {}
  for arm in study.arms:
    if arm.pretraining:
      flops, batch = pretraining_cost(arm, scale)
      plan[arm.name] = {"flops_per_example": flops, "batch": batch}
  ref = plan[study.reference.name]
  budget = scale.pretrain_steps * ref["flops_per_example"] * ref["batch"]
  for entry in plan.values():
    steps = (round(budget / (entry["flops_per_example"] * entry["batch"])) if study.equal_flops
             else scale.pretrain_steps)
    entry.update(steps=max(1, steps),
                 flops=max(1, steps) * entry["flops_per_example"] * entry["batch"])
  return plan


def schedule(steps: int, start: int = 0) -> list[str]:
  """Linear warmup over 10% of the steps, then linear decay to 0, whatever the length; one
  eval at the end; checkpoints every quarter (an interrupted run resumes from one), at least 4
  steps apart (a smoke run of a few steps would otherwise save at every one)."""
  warmup = max(1, steps // 10)
  return [f"TRAIN_STEPS={start + steps}", f"ScheduleConfig.warmup_steps={warmup}",
          f"ScheduleConfig.decay_steps={max(1, steps - warmup)}", f"EVAL_PERIOD={start + steps}",
          f"CheckpointConfig.period={max(4, steps // 4)}", "CheckpointConfig.keep_period=None"]


def run_t5lite(argv: list[str], log_path: str, say) -> None:
  """`t5lite ARGV` in a subprocess, its output appended to log_path; raises with the log's
  tail if it fails."""
  say(f"$ t5lite {shlex.join(argv)}")
  started = time.time()
  with open(log_path, "a", encoding="utf-8") as log:
    code = subprocess.run([sys.executable, "-m", "t5lite.cli", *argv], stdout=log,
                          stderr=subprocess.STDOUT).returncode
  if code:
    with open(log_path, encoding="utf-8") as log:
      tail = "".join(log.readlines()[-15:])
    raise RuntimeError(f"t5lite {argv[0]} failed (exit {code}); the end of {log_path}:\n{tail}")
  say(f"  done in {time.time() - started:.0f}s")


def _train(model_dir: str, gin_files: list[str], bindings: list[str], say) -> None:
  run_t5lite(["train", *[f"--gin_file={f}" for f in gin_files], f"--gin.MODEL_DIR='{model_dir}'",
              *[f"--gin.{b}" for b in bindings]], model_dir + ".log", say)


def _export(kind: str, checkpoint: str, out: str, flags: list[str], log: str, say) -> str:
  """`t5lite export KIND` of checkpoint into out, once: a marker written after it says done
  (an export cut short is removed and redone)."""
  if not os.path.exists(os.path.join(out, ".complete")):
    if os.path.exists(out):
      import shutil
      shutil.rmtree(out)
    run_t5lite(["export", kind, "--checkpoint", checkpoint, "--out", out, *flags], log, say)
    atomic.write_file(os.path.join(out, ".complete"), "")
  return out


def _teacher_bindings(arm: Arm, out: str, seed: int, folder: str, say) -> list[str]:
  """TEACHER (the teacher arm's pretraining at this seed) and, with teacher_layers, the
  student's start made of the teacher's layers."""
  if not arm.pretraining.teacher:
    return []
  teacher = os.path.join(out, arm.pretraining.teacher, f"seed{seed}", "pretrain")
  bindings = [f"TEACHER={teacher!r}"]
  if arm.pretraining.teacher_layers:
    init = _export("student", teacher, os.path.join(folder, "student_init"),
                   ["--layers", arm.pretraining.teacher_layers, "--keep_token_types",
                    "--keep_pooler"], os.path.join(folder, "pretrain.log"), say)
    bindings.append(f"INITIAL_CHECKPOINT_PATH={init!r}")
  return bindings


def _finetuning_start(arm: Arm, pretrain: str, steps: int, say) -> tuple[str, int]:
  """(what finetuning starts from, its step) after `arm`'s pretraining in `pretrain`: the
  MODEL_DIR itself, or a part of its HF export (Pretraining.finetune_from)."""
  source = arm.pretraining.finetune_from
  if source.startswith("hf:"):
    exported = _export("hf", pretrain, pretrain + "_hf", [], pretrain + ".log", say)
    return os.path.join(exported, source[3:]), 0
  return pretrain, steps


def _method_bindings(finetuning: Finetuning, start: str) -> list[str]:
  """Full finetuning starts from `start` ('None': a random init); a PEFT method adapts it,
  frozen, as its BASE (as gin/runs/lora.gin does)."""
  if finetuning.method == "full":
    return [f"INITIAL_CHECKPOINT_PATH={start if start == 'None' else repr(start)}"]
  return ["INITIAL_CHECKPOINT_PATH=None", "TrainConfig.peft=@PeftConfig()",
          f"PeftConfig.base={start!r}", "PeftConfig.adapter=@AdapterConfig()",
          f"AdapterConfig.method={finetuning.method!r}"]


def _pretraining_figures(model_dir: str) -> dict:
  """The run's training-loss curve [[step, loss], ...] and its last eval row
  {'TASK/METRIC': value} (its pretraining task's loss, say), from one read of its metrics."""
  records = read_metrics(model_dir)
  evals = [r for r in records if any(k.startswith("eval/") for k in r)]
  return {"curve": [[r["step"], r["loss"]] for r in records if "loss" in r and "step" in r],
          "pretrain_eval": ({k[len("eval/"):]: v for k, v in evals[-1].items()
                             if k.startswith("eval/")} if evals else {})}


def pretraining_loss(result: dict) -> float | None:
  """The pretraining task's eval loss in a result (comparable between arms of one objective
  only); a distilled run's MLM part (its hard loss), not its whole distillation loss."""
  figures = result.get("pretrain_eval", {})
  for suffix in ("/distill_hard_loss", "/loss"):
    found = [v for k, v in figures.items() if k.endswith(suffix)]
    if found:
      return found[0]
  return None


def run_arm(study: Study, arm: Arm, scale: Scale, plan: dict, seed: int, out: str,
            say=print) -> dict:
  """The figures of one arm at one seed (read back if already done)."""
  folder = os.path.join(out, arm.name, f"seed{seed}")
  result_path = os.path.join(folder, RESULT_FILE)
  if os.path.exists(result_path):
    say(f"{arm.name} seed {seed}: done earlier ({result_path})")
    with open(result_path, encoding="utf-8") as f:
      return json.load(f)
  os.makedirs(folder, exist_ok=True)
  seed_binding = f"RANDOM_SEED={seed}"
  result = {"arm": arm.name, "seed": seed, "pretrain_steps": 0, "pretrain_flops": 0.0,
            "curve": [], "pretrain_eval": {}, "downstream": {}}
  start, start_step = "None", 0
  if arm.pretraining:
    steps = plan[arm.name]["steps"]
    pretrain = os.path.join(folder, "pretrain")
    say(f"{arm.name} seed {seed}: pretraining {steps} steps")
    files, bindings = pretraining_gin(arm, scale)
    _train(pretrain, files, [*bindings, *_teacher_bindings(arm, out, seed, folder, say),
                             seed_binding, *schedule(steps)], say)
    result.update(pretrain_steps=steps, pretrain_flops=plan[arm.name]["flops"],
                  **_pretraining_figures(pretrain))
    start, start_step = _finetuning_start(arm, pretrain, steps, say)
  elif arm.pretrained_by:  # an earlier arm of this seed pretrained the model
    owner = study.arm(arm.pretrained_by)
    pretrain = os.path.join(out, owner.name, f"seed{seed}", "pretrain")
    steps = plan[owner.name]["steps"]
    result.update(pretrain_steps=steps, pretrain_flops=plan[owner.name]["flops"],
                  **_pretraining_figures(pretrain))
    start, start_step = _finetuning_start(owner, pretrain, steps, say)
  if study.scored_by_pretraining:
    loss = pretraining_loss(result)
    if loss is None:
      raise RuntimeError(f"{folder}/pretrain logged no eval loss to score the arm by")
    result["score"] = -loss
    atomic.write_file(result_path, json.dumps(result, indent=1))
    return result
  for task in scale.downstream:
    finetune = os.path.join(folder, f"finetune_{task.task}")
    say(f"{arm.name} seed {seed}: finetuning on {task.task}")
    _train(finetune, [scale.model_file, study.finetune_run],
           [*scale.model_bindings, *arm.model_bindings, *scale.bindings_of(arm.name),
            *study.finetune_bindings, *scale.finetune_bindings, seed_binding,
            f"MIXTURE_OR_TASK_NAME='{task.task}'",
            *([f"ModelConfig.num_labels={task.num_labels}"] if task.num_labels else []),
            *_method_bindings(arm.finetuning, start), *arm.finetuning.bindings,
            "TrainConfig.run_eval_before_training=False",
            *schedule(scale.finetune_steps, 0 if arm.finetuning.method != "full"
                      else start_step)], say)
    value = last_value(finetune, f"eval/{task.task}/{task.metric}")
    if value is None:
      raise RuntimeError(f"{finetune} logged no eval/{task.task}/{task.metric}")
    result["downstream"][task.task] = value
  result["score"] = sum(result["downstream"].values()) / len(result["downstream"])
  atomic.write_file(result_path, json.dumps(result, indent=1))
  return result


def run(study: Study, scale_name: str, seeds: int, out: str, say=print,
        arms: tuple[str, ...] = ()) -> dict:
  """{arm: [result per seed]} of the whole study, or of `arms` (Study.only), seed by seed
  (every arm's seed 0 first, so that an early stop still compares all arms). The steps are
  the whole study's plan either way."""
  scale = study.scale(scale_name)
  plan = pretraining_plan(study, scale)
  chosen = study.only(arms).arms if arms else study.arms
  results = {arm.name: [] for arm in chosen}
  for seed in range(seeds):
    for arm in chosen:
      results[arm.name].append(run_arm(study, arm, scale, plan, seed, out, say))
  return results
