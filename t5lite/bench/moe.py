"""`t5lite bench moe`: a dense T5 against its Switch version at equal FLOPs per token, on the
embedded span-corruption task, same steps, same data.

  t5lite bench moe [--out runs/bench_moe] [--steps 400] [--experts 8] [--overwrite]

Both runs are real `t5lite train` commands (printed before they run) of gin/runs/demo.gin
(T5 v1.1-style, d_model 128, d_ff 512, 3 + 3 layers, batch 16 of 128 / 32 tokens,
stdlib_span_corruption, the same seed, so the same batches): `dense` as it is, `switch` with
every second MLP of each stack routed top-1 over --experts experts of the same d_ff (the
Switch recipe: capacity factor 1.25 in training and 2.0 in evaluation, jitter 0.01, per-layer
load-balancing loss 1e-2 and z-loss 1e-3). A token passes one expert, so both spend the same
FLOPs per token but for the router (Family.flops_per_example counts it); the Switch model has
about --experts times the MLP parameters of its sparse layers.

Figures of each run: the last logged training loss (the Switch one's includes its router
losses, reported apart too) and the validation loss at the end (token cross entropy alone, the
comparable figure), median tokens/s of the logged steps after the first, parameters, FLOPs per
example, and the Switch run's dropped fraction. Writes OUT/moe.json and OUT/moe.png (both
training curves, the validation losses, tokens/s) and ends with one JSON line (ratio_vs_hf
null: it compares two t5lite models). Tiny models and a few hundred steps on a CPU: whether
the extra parameters pay here, not the paper's numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from t5lite.bench import fresh_out, machine, run_t5lite
from t5lite.cli.plot import read_metrics

RUN = "gin/runs/demo.gin"
TASK = "stdlib_span_corruption"
LENGTHS = {"encoder_input_tokens": 128, "decoder_target_tokens": 32}


def switch_bindings(experts: int) -> list[str]:
  return ["ModelConfig.moe=@MoeConfig()", f"MoeConfig.num_experts={experts}",
          "MoeConfig.top_k=1", "MoeConfig.capacity_factor=1.25",
          "MoeConfig.eval_capacity_factor=2.0", "MoeConfig.encoder_sparse_step=2",
          "MoeConfig.decoder_sparse_step=2", "MoeConfig.jitter_noise=0.01",
          "MoeConfig.aux_loss_coef=0.01", "MoeConfig.z_loss_coef=0.001",
          "MoeConfig.router_losses='per_layer'"]


def _model(bindings: list[str]):
  from t5lite.cli import gin_config
  gin_config.parse([RUN], bindings)
  return gin_config.model_config()


def _figures(model_dir: str, bindings: list[str]) -> dict:
  from t5lite import count_params
  from t5lite.families import family_of
  records = read_metrics(model_dir)
  rows = [r for r in records if r.get("loss") is not None]
  rates = [r["tokens_per_s"] for r in rows[1:] if r.get("tokens_per_s")]
  evals = [r for r in records if r.get(f"eval/{TASK}/loss") is not None]
  config = _model(bindings)
  last = rows[-1]
  return {
      "steps": last["step"],
      "train_loss": last["loss"],
      "train_curve": [[r["step"], r["loss"]] for r in rows],
      "eval_loss": evals[-1][f"eval/{TASK}/loss"] if evals else None,
      "tokens_per_s": statistics.median(rates) if rates else None,
      "params": count_params(config),
      "flops_per_example": family_of(config).flops_per_example(LENGTHS),
      **{k: last[k] for k in ("router_aux_loss", "router_z_loss", "dropped_fraction")
         if k in last},
  }


def plot(result: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  names = ("dense", "switch")
  for name, color in zip(names, ("C0", "C1")):
    steps, losses = zip(*result[name]["train_curve"])
    axes[0].plot(steps, losses, color=color, label=name)
  axes[0].set_title("training loss (Switch: + router losses)")
  axes[0].set_xlabel("step")
  axes[0].legend()
  axes[1].bar(names, [result[n]["eval_loss"] or 0 for n in names], color=["C0", "C1"])
  axes[1].set_title(f"{TASK} validation loss at the end")
  axes[2].bar(names, [result[n]["tokens_per_s"] or 0 for n in names], color=["C0", "C1"])
  axes[2].set_title("training tokens/s (median)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def run(out: str, steps: int, experts: int, overwrite: bool = False) -> dict:
  fresh_out(out, overwrite)
  started = time.time()
  schedule = [f"TRAIN_STEPS={steps}", f"EVAL_PERIOD={steps}", f"CheckpointConfig.period={steps}",
              f"ScheduleConfig.warmup_steps={max(1, steps // 4)}"]
  result = {"bench": "moe", "experts": experts}
  for name, bindings in (("dense", []), ("switch", switch_bindings(experts))):
    model_dir = os.path.join(out, name)
    run_t5lite(["train", f"--gin_file={RUN}", f"--gin.MODEL_DIR='{model_dir}'",
          *[f"--gin.{b}" for b in schedule + bindings]])
    result[name] = _figures(model_dir, bindings)
  dense, switch = result["dense"], result["switch"]
  result.update(
      eval_loss_gain=(dense["eval_loss"] - switch["eval_loss"]
                      if None not in (dense["eval_loss"], switch["eval_loss"]) else None),
      speed_ratio=(switch["tokens_per_s"] / dense["tokens_per_s"]
                   if dense["tokens_per_s"] and switch["tokens_per_s"] else None),
      flops_ratio=switch["flops_per_example"] / dense["flops_per_example"],
      params_ratio=switch["params"] / dense["params"],
      seconds=round(time.time() - started, 1), cores=os.cpu_count(), ratio_vs_hf=None)
  with open(os.path.join(out, "moe.json"), "w") as f:
    json.dump(result, f, indent=2)
  plot(result, os.path.join(out, "moe.png"))
  return result


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="t5lite bench moe", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="runs/bench_moe")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--overwrite", action="store_true",
                      help="empty a non-empty --out first (its runs are deleted)")
  args = parser.parse_args(argv)
  if args.steps < 2 or args.experts < 1:
    parser.error("--steps must be >= 2 and --experts >= 1")
  result = run(args.out, args.steps, args.experts, args.overwrite)
  print(f"\n{'run':8s} {'params':>11s} {'GFLOP/ex':>9s} {'train loss':>11s} {'eval loss':>10s} "
        f"{'tokens/s':>9s}")
  for name in ("dense", "switch"):
    r = result[name]
    print(f"{name:8s} {r['params']:11,d} {r['flops_per_example'] / 1e9:9.3f} "
          f"{r['train_loss']:11.4f} {r['eval_loss'] or float('nan'):10.4f} "
          f"{r['tokens_per_s'] or 0:9.0f}")
  curves = {n: result[n].pop("train_curve") for n in ("dense", "switch")}
  print(json.dumps({**result, "machine": machine.describe()}))
  for name, curve in curves.items():
    result[name]["train_curve"] = curve
  return 0
