"""`t5lite bench gpu`: the GPU check in one command, a few minutes on one GPU.

T5 v1.1 base (248M params, vocab 32128) in bfloat16 at nanoT5's lengths (512 input, 114
target tokens), AdamW, random batches, in phases:

  train     t5lite's train step with cuDNN's fused attention, HF PyTorch's T5 beside it (SDPA
            attention under autocast bfloat16, the same weights and batches), then with XLA's
            attention: tokens/s, step time and MFU against the card's bf16 peak (the cost
            model's FLOPs), device memory (t5lite.bench.train; interleaved runs, medians).
  decode    greedy decoding (t5lite.generate, cuDNN arm; HF's generate on the same weights in
            bfloat16 beside it): output tokens/s for 64 rows of 512 inputs, 114 new tokens.
  parity    the first 3 training losses of the cuDNN arm in bfloat16 on the GPU against the
            same 3 steps in float32 with XLA's attention on the host's CPU: within bfloat16's
            tolerance (relative 2e-2). Layers scanned on both sides (a quick CPU compile).
  largest   the cuDNN arm alone at the largest batch (a multiple of 8, at most 512) that the
            train phase's device peak predicts fits in 80% of what jax may allocate on the
            device (its bytes_limit; the fixed cost: params, gradients and AdamW's two moments
            in float32): what a user runs.

Each phase's table goes to the console; one JSON line ends the run (the card in
`device_kind`); a phase that fails is reported in `errors` and the others still run. Off a
CUDA GPU it refuses with one line (exit 2) unless `--dry_run`, which runs every phase on a
tiny model at tiny sizes on any backend (XLA's attention in both arms off a GPU): the CPU test
of this command. jax is told not to preallocate device memory, so that HF's torch and jax
share the card.

  t5lite bench gpu                  # on the GPU machine; 5.5 to 6 minutes on an H200
  t5lite bench gpu --dry_run        # anywhere, about a minute on 2 CPU cores
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Sequence

# Before jax's backend starts: torch (HF's side) and jax share the device.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from t5lite.bench import machine  # noqa: E402

PARITY_TOLERANCE = 2e-2  # bfloat16 keeps 8 bits of mantissa: 2**-8 = 3.9e-3 a rounding
TRAIN_FIELDS = ("t5lite_tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf", "t5lite_step_s",
                "hf_step_s", "mfu_t5lite", "t5lite_compile_s", "device_peak_mb", "step0_loss",
                "step0_loss_rel_diff", "batch_size", "wall_s_per_run")


class Sizes:
  """The model and sizes of a run: the real check, or --dry_run's tiny stand-in."""

  def __init__(self, dry_run: bool, batch_size: int, repeats: int):
    self.model = "tiny" if dry_run else "t5_1_1_base"
    self.lengths = (32, 8) if dry_run else (512, 114)
    self.batch_size, self.repeats = (2, 1) if dry_run else (batch_size, repeats)
    self.steps = 2 if dry_run else 5
    self.largest_cap = 8 if dry_run else 512
    self.decode_rows, self.new_tokens = (2, 4) if dry_run else (64, 114)
    self.parity_rows = 2


def arms(dry_run: bool) -> dict[str, str]:
  """Arm name -> attention_implementation: cuDNN first (its device peak is then its own)."""
  from t5lite.models import attention_kernels
  import jax.numpy as jnp
  fused = attention_kernels.resolve("auto", jnp.bfloat16)
  if fused != "cudnn" and not dry_run:
    from t5lite.errors import ConfigError
    import jax
    raise ConfigError(f"t5lite bench gpu needs a CUDA GPU (this backend: "
                      f"{jax.default_backend()}); on this machine run it with --dry_run")
  return {"cudnn" if fused == "cudnn" else "fused(xla here)": fused, "xla": "xla"}


def base_config(sizes: Sizes, implementation: str):
  from t5lite.bench.train import model_config
  return model_config(sizes.model, "bfloat16").replace(attention_implementation=implementation)


def _timed_training(sizes: Sizes, config, batch_size: int, repeats: int, hf: bool,
                    log) -> dict:
  """`t5lite bench train` of config at batch_size: TRAIN_FIELDS of its report."""
  from t5lite.bench import train
  report = train.run(model=sizes.model, config=config, dtype="bfloat16", batch_size=batch_size,
                     inputs_length=sizes.lengths[0], targets_length=sizes.lengths[1],
                     steps=sizes.steps, repeats=repeats, hf=hf, log=log)
  _release_device_memory()
  return {k: report[k] for k in TRAIN_FIELDS}


def train_phase(sizes: Sizes, arm_names: dict[str, str], log) -> dict:
  return {arm: _timed_training(sizes, base_config(sizes, implementation), sizes.batch_size,
                               sizes.repeats, hf=index == 0, log=log)
          for index, (arm, implementation) in enumerate(arm_names.items())}


def largest_batch(peak_bytes: float, batch: int, param_count: int, limit_bytes: float,
                  cap: int) -> int:
  """The largest multiple of 8 (at most cap) whose predicted peak fits in limit_bytes: a fixed
  16 bytes a parameter (float32 params, gradients and AdamW's m and v) plus what `batch` rows
  took above it, per row."""
  fixed = 16 * param_count
  per_row = max(peak_bytes - fixed, 1) / batch
  return max(8, min(cap, int((limit_bytes - fixed) / per_row) // 8 * 8))


def largest_phase(sizes: Sizes, arm: str, implementation: str, train: dict, log) -> dict:
  import jax
  from t5lite.models import count_params, init_params
  config = base_config(sizes, implementation)
  stats = jax.devices()[0].memory_stats() or {}
  limit = 0.8 * stats.get("bytes_limit", 16 * 2**30)
  peak = (train[arm]["device_peak_mb"]["t5lite"] or 0) * 2**20
  params = count_params(jax.eval_shape(lambda: init_params(config, 0)))
  batch = largest_batch(peak, sizes.batch_size, params, limit, sizes.largest_cap)
  log(f"largest: {arm} at batch {batch} (device peak {peak / 2**30:.1f} GiB at batch "
      f"{sizes.batch_size}; limit {limit / 2**30:.1f} GiB)")
  report = _timed_training(sizes, config, batch, max(1, sizes.repeats - 2), hf=False, log=log)
  return {"arm": arm, **{k: v for k, v in report.items() if v is not None}}


def decode_phase(sizes: Sizes, arm: str, implementation: str, log) -> dict:
  import jax
  import numpy as np
  import t5lite
  from t5lite.bench.decode import make_inputs, output_tokens
  from t5lite.bench.hf_t5_train import model_from_t5lite
  from t5lite.models import init_params
  config = base_config(sizes, implementation)
  params = jax.device_put(init_params(config, 0))
  inputs = make_inputs(sizes.decode_rows, sizes.lengths[0], config.vocab_size)
  on_gpu = jax.default_backend() == "gpu"
  hf_model = model_from_t5lite(config, jax.device_get(params), "cuda" if on_gpu else "cpu")
  import torch
  hf_model = hf_model.to(torch.bfloat16).eval()
  hf_inputs = torch.from_numpy(inputs.astype(np.int64)).to(hf_model.device)

  def t5lite_side():
    return t5lite.generate(config, params, inputs, max_decode_length=sizes.new_tokens)

  def hf_side():
    with torch.no_grad():
      out = hf_model.generate(input_ids=hf_inputs, attention_mask=torch.ones_like(hf_inputs),
                              max_new_tokens=sizes.new_tokens, do_sample=False, num_beams=1)
    if on_gpu:
      torch.cuda.synchronize()
    return out[:, 1:].cpu().numpy()

  out = {}
  for name, side in (("t5lite", t5lite_side), ("hf", hf_side)):
    start = time.perf_counter()
    tokens = side()  # compiles (t5lite) / warms up (HF)
    first = time.perf_counter() - start
    walls = []
    for _ in range(max(1, sizes.repeats - 2)):
      start = time.perf_counter()
      tokens = side()
      walls.append(time.perf_counter() - start)
    produced = output_tokens(tokens)
    out[name] = {"tokens_per_s": round(produced / statistics.median(walls), 1),
                 "first_call_s": round(first, 2), "output_tokens": produced,
                 "wall_s": [round(w, 3) for w in walls]}
  out["ratio_vs_hf"] = round(out["t5lite"]["tokens_per_s"] / out["hf"]["tokens_per_s"], 3)
  out["arm"] = arm
  log(f"decode ({arm}): t5lite {out['t5lite']['tokens_per_s']:.0f} tokens/s, HF "
      f"{out['hf']['tokens_per_s']:.0f} ({out['ratio_vs_hf']:.2f}x)")
  del hf_model
  _release_device_memory()
  return out


def parity_phase(sizes: Sizes, implementation: str, log) -> dict:
  import jax
  from t5lite.bench.train_batches import pretrain_batches
  from t5lite.bench.train_timing import T5liteSide
  from t5lite.models import init_params
  from t5lite.train.optimizers import OptimizerConfig
  from t5lite.train.schedules import ScheduleConfig
  config = base_config(sizes, implementation).replace(scan_layers=True)
  params = jax.device_get(init_params(config, 0))
  batches, _ = pretrain_batches(config.vocab_size, sizes.parity_rows, sizes.lengths, seed=1)
  optimizer = OptimizerConfig(name="adamw", schedule=ScheduleConfig(
      name="constant", value=1e-3, warmup_steps=0))
  device = T5liteSide(config, params, optimizer, batches * 3).run()
  with jax.default_device(jax.devices("cpu")[0]):
    reference = T5liteSide(config.replace(dtype="float32", attention_implementation="xla"),
                           params, optimizer, batches * 3).run()
  worst = max(abs(a - b) / abs(b) for a, b in zip(device, reference))
  log(f"parity: losses {[round(x, 5) for x in device]} vs float32 on the CPU "
      f"{[round(x, 5) for x in reference]}: worst relative difference {worst:.2e}")
  return {"losses": [round(x, 6) for x in device], "cpu_float32_losses":
          [round(x, 6) for x in reference], "worst_rel_diff": worst,
          "within_tolerance": worst <= PARITY_TOLERANCE, "tolerance": PARITY_TOLERANCE}


def _release_device_memory() -> None:
  """Frees what a finished phase held, so that the next starts from an empty device."""
  gc.collect()
  if "torch" in sys.modules:
    import torch
    if torch.cuda.is_available():
      torch.cuda.empty_cache()


PHASES = ("train", "decode", "parity", "largest")


def run(*, phases: Sequence[str] = PHASES, dry_run: bool = False, batch_size: int = 32,
        repeats: int = 5, log: Callable[[str], Any] | None = print,
        report_path: str | None = None) -> dict:
  """Runs the phases; returns the figures of the final JSON line. report_path: the figures
  so far are written there after every phase (a run cut short keeps what it measured)."""
  import jax
  log = log or (lambda _: None)
  sizes = Sizes(dry_run, batch_size, repeats)
  arm_names = arms(dry_run)
  fused_arm, fused = next(iter(arm_names.items()))
  report: dict[str, Any] = {"bench": "gpu", "device_kind": jax.devices()[0].device_kind,
                            "model": sizes.model, "lengths": list(sizes.lengths),
                            "dry_run": dry_run, "errors": {}}
  started = time.perf_counter()
  for phase in phases:
    log(f"\n== {phase} ({time.perf_counter() - started:.0f} s in)")
    try:
      if phase == "train":
        report["train"] = train_phase(sizes, arm_names, log)
        fused_rate = report["train"][fused_arm]["t5lite_tokens_per_s"]
        report["ratio_vs_hf"] = report["train"][fused_arm]["ratio_vs_hf"]
        report["fused_vs_xla_attention"] = round(
            fused_rate / report["train"]["xla"]["t5lite_tokens_per_s"], 3)
      elif phase == "largest":
        if "train" not in report:
          raise RuntimeError("the largest-batch phase sizes itself from the train phase's "
                             "memory: run it with --phases train,largest")
        report["largest"] = largest_phase(sizes, fused_arm, fused, report["train"], log)
      elif phase == "decode":
        report["decode"] = decode_phase(sizes, fused_arm, fused, log)
      elif phase == "parity":
        report["parity"] = parity_phase(sizes, fused, log)
    except Exception as error:  # noqa: BLE001 (reported; the other phases still run)
      traceback.print_exc()
      report["errors"][phase] = f"{type(error).__name__}: {error}"[:500]
    if report_path:
      with open(report_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
  report["seconds"] = round(time.perf_counter() - started, 1)
  return report


def main(argv: Sequence[str] | None = None) -> int:
  """`t5lite bench gpu [--dry_run] [--phases ...] [--batch_size N]`: tables + one JSON line."""
  parser = argparse.ArgumentParser(
      prog="t5lite bench gpu", description="The GPU check: T5 v1.1 base in bfloat16, cuDNN "
      "vs XLA attention, beside HF PyTorch: train, largest batch, decode, CPU parity.")
  parser.add_argument("--phases", default=",".join(PHASES),
                      help=f"comma-separated, of {','.join(PHASES)} (default: all)")
  parser.add_argument("--batch_size", type=int, default=32, help="the train phase's batch")
  parser.add_argument("--repeats", type=int, default=5, help="interleaved timed runs")
  parser.add_argument("--report", default=None,
                      help="a JSON file rewritten after every phase with the figures so far")
  parser.add_argument("--dry_run", action="store_true",
                      help="a tiny model on any backend: checks the command, measures nothing")
  args = parser.parse_args(argv)
  phases = [p for p in args.phases.split(",") if p]
  if not phases or set(phases) - set(PHASES):
    parser.error(f"--phases takes some of {','.join(PHASES)}, got {args.phases!r}")
  if min(args.batch_size, args.repeats) < 1:
    parser.error("--batch_size and --repeats must be positive")
  report = run(phases=phases, dry_run=args.dry_run, batch_size=args.batch_size,
               repeats=args.repeats, report_path=args.report)
  print(json.dumps({**report, "machine": machine.describe()}), flush=True)
  return 1 if report["errors"] else 0


if __name__ == "__main__":
  sys.exit(main())
