"""`t5lite bench train`: steady-state train-step throughput, t5lite vs HF's PyTorch T5.

Both sides train the same model from the same weights (t5lite's init, exported to HF with
t5lite.interop.hf.checkpoints) with AdamW at the same lr / betas / eps / weight decay, on the same
examples, in one process; t5lite.bench.hf_t5_train is the HF side. The loss is the same on
both: mean cross entropy over real target tokens (t5lite's z-loss off, as HF has none).

  --mode pretrain   one random batch (B x inputs_length, B x targets_length tokens, no padding)
                    fed to both sides at every step. tokens/s counts inputs + targets.
  --mode finetune   the embedded task stdlib_docstring_summary. t5lite trains on `--steps`
                    packed batches of the real pipeline (get_dataset, packed
                    EncDecFeatureConverter, B rows of inputs_length / targets_length); HF on
                    exactly the examples those rows hold, shuffled and batched B at a time,
                    each batch padded to its longest example (HF's dynamic padding, labels
                    -100 on pads). tokens/s counts USEFUL tokens: non-pad inputs + non-pad
                    targets, the same total on both sides.

Timing: t5lite's step is compiled ahead of time (compile time reported), then each side
takes 2 warm-up steps (untimed). Then runs alternate t5lite, HF, t5lite, HF, ... `repeats`
times; a run is the side's whole batch list (`--steps` batches for t5lite; HF's list holds
the same examples) and ends when its results are ready. Reported step times and tokens/s are
medians over runs of wall time; ratio_vs_hf is t5lite tokens/s over HF tokens/s (higher =
t5lite faster). Threads: torch uses --threads (2), XLA CPU uses every core it sees.
Contention: other processes' CPU share is measured over each run and reported. It is not
neutral: torch's OpenMP workers wait on each other at every op, so a stolen core slows HF
several times more than XLA's work-stealing pool (ratios of 4-12x were seen on a busy
2-core machine, 1.45x quiet). Quote only runs whose others_cpu_fraction is near 0; with
--quiet_wait_s the bench waits, before each pair of runs, for the CPUs to be free.
FLOP rate: each side's model FLOPs per second (the cost model's FLOPs of t5lite's batches, the
same useful tokens on both sides), and its fraction of this machine's rate on the step's
largest matmul shape (B * inputs_length x d_model @ d_model x d_ff, the config's dtype, timed
after the runs): how far from the hardware each step is, without a datasheet peak.
Memory, after timing: each side runs one more step while a thread samples the process RSS;
the peak above the RSS before it is that side's step memory. On a GPU: the devices' peaks.

  --family bert|gpt2 the same harness against BertForPreTraining (MLM + next sentence) or
                    GPT2LMHeadModel (t5lite.bench.family_train; default --family t5 is the
                    T5 bench described here, unchanged).

  t5lite bench train                      # pretrain, the d_model 256 / 4+4 layer reference
  t5lite bench train --family bert        # 8 x 128, hidden 256, 4 layers, vocab 30522
  t5lite bench train --family gpt2        # 8 x 512, hidden 256, 4 layers, vocab 50257
  t5lite bench train --mode finetune --steps 4 --repeats 5
  t5lite bench train --model t5_1_1_base --batch_size 128 --dtype bfloat16 --no_hf   # GPU, MFU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Sequence

from t5lite.bench import machine
from t5lite.bench.train_timing import HFSide, T5liteSide, _median, _table, measure
from t5lite.bench.train_batches import (finetune_batches, pretrain_batches,
                                        t5lite_useful_tokens)

MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=128, d_model=32, d_ff=64, num_heads=4, d_kv=8, num_encoder_layers=1,
                 num_decoder_layers=1),
    "bench": dict(d_model=256, d_ff=1024, num_heads=4, d_kv=64, num_encoder_layers=4,
                  num_decoder_layers=4),
    "t5_1_1_small": dict(d_model=512, d_ff=1024, num_heads=6, d_kv=64, num_encoder_layers=8,
                         num_decoder_layers=8),
    "t5_1_1_base": dict(d_model=768, d_ff=2048, num_heads=12, d_kv=64, num_encoder_layers=12,
                        num_decoder_layers=12),
    "t5_1_1_large": dict(d_model=1024, d_ff=2816, num_heads=16, d_kv=64, num_encoder_layers=24,
                         num_decoder_layers=24),
}


def model_config(name: str, dtype: str = "float32", vocab_size: int | None = None):
  """A MODELS preset as a T5 v1.1 ModelConfig (gated-GELU, untied head, no dropout)."""
  from t5lite.models.config import ModelConfig
  values = {**dict(vocab_size=32128, mlp_activation="gated-gelu", tie_output_embedding=False,
                   scale_logits=False, dropout_rate=0.0, dtype=dtype), **MODELS[name]}
  if vocab_size:
    values["vocab_size"] = vocab_size
  return ModelConfig(**values)


def run(*, mode: str = "pretrain", model: str = "bench", config=None, batch_size: int = 8,
        inputs_length: int = 512, targets_length: int = 114, steps: int = 3, repeats: int = 5,
        dtype: str = "float32", learning_rate: float = 1e-3, threads: int = 2,
        hf: bool = True, seed: int = 0, quiet_wait_s: float = 0.0,
        log: Callable[[str], Any] | None = print, family: str = "t5",
        length: int | None = None) -> dict:
  """Runs the benchmark; returns the figures of the final JSON line.

  config: a ModelConfig to use instead of the `model` preset (its vocab_size is replaced by
  the task's, rounded up to a multiple of 128, in finetune mode). quiet_wait_s: wait up to
  this long, before the timed runs, for other processes to leave the CPUs (0: don't wait).
  family: 't5' (this function), 'bert' or 'gpt2' (t5lite.bench.family_train: pretrain mode,
  `length` tokens a row, model 'bench' or 'tiny'; inputs/targets_length and config unused).
  """
  if family != "t5":
    from t5lite.bench import family_train
    if mode != "pretrain" or config is not None:
      raise ValueError(f"family {family!r} benchmarks pretrain mode on a preset model only")
    return family_train.run(family=family, model=model, batch_size=batch_size, length=length,
                            steps=steps, repeats=repeats, dtype=dtype,
                            learning_rate=learning_rate, threads=threads, hf=hf, seed=seed,
                            quiet_wait_s=quiet_wait_s, log=log)
  import jax
  from t5lite.models import count_params, init_params
  from t5lite.families import family_of
  from t5lite.train import cost_model
  from t5lite.train.optimizers import OptimizerConfig
  from t5lite.train.schedules import ScheduleConfig
  log = log or (lambda _: None)
  load_before = os.getloadavg()
  lengths = (inputs_length, targets_length)
  config = config.replace(dtype=dtype) if config is not None else model_config(model, dtype)
  if mode == "finetune":
    packed, hf_batches, parity_batch, task_vocab = finetune_batches(batch_size, lengths, steps,
                                                                    seed)
    config = config.replace(vocab_size=-(-task_vocab // 128) * 128)
    t5lite_batches = packed
  else:
    t5lite_batches, hf_batches = pretrain_batches(config.vocab_size, batch_size, lengths, seed)
    t5lite_batches, hf_batches = t5lite_batches * steps, hf_batches * steps
    parity_batch = hf_batches[0]
  tokens_per_run = sum(map(t5lite_useful_tokens, t5lite_batches))
  optimizer_config = OptimizerConfig(name="adamw", schedule=ScheduleConfig(
      name="constant", value=learning_rate, warmup_steps=0))
  params = init_params(config, seed)
  log(f"bench train: {mode}, model {model} ({count_params(params) / 1e6:.1f}M params, "
      f"vocab {config.vocab_size}, {config.dtype}), batch {batch_size} x {lengths}, "
      f"{steps} t5lite steps a run, {repeats} repeats, backend {jax.default_backend()}, "
      f"load {load_before[0]:.2f}")

  sides: dict[str, Any] = {}
  warmup_losses: dict[str, list[float]] = {}
  step0_loss: dict[str, float] = {}
  if hf:
    from t5lite.bench.hf_t5_train import HFTrainer, useful_tokens
    if sum(map(useful_tokens, hf_batches)) != tokens_per_run:
      raise AssertionError("HF's batches do not hold the same useful tokens as t5lite's")
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    trainer = HFTrainer(config, jax.device_get(params), learning_rate=learning_rate,
                        b1=optimizer_config.b1, b2=optimizer_config.b2, eps=optimizer_config.eps,
                        weight_decay=optimizer_config.weight_decay, device=device,
                        num_threads=threads)
    step0_loss["hf"] = trainer.loss(trainer.to_device(parity_batch))  # before any update
    sides["hf"] = HFSide(trainer, hf_batches)
  t5lite = sides["t5lite"] = T5liteSide(config, params, optimizer_config, t5lite_batches)
  del params  # donated with the state
  sides = {"t5lite": t5lite, **({"hf": sides["hf"]} if hf else {})}  # t5lite runs first

  timing = measure(sides, repeats, quiet_wait_s, log)
  first_step_s, wall, cpu = timing.first_step_s, timing.wall, timing.cpu
  others_cpu, load_after, step_memory = timing.others_cpu, timing.load_after, timing.step_memory
  warmup_losses.update(timing.warmup_losses)
  step0_loss["t5lite"] = warmup_losses["t5lite"][0]

  rate = {name: tokens_per_run / _median(wall[name]) for name in sides}
  steps_run = {"t5lite": len(t5lite_batches), "hf": len(hf_batches)}
  peak = cost_model.peak_flops(jax.devices()[0].device_kind)
  flops_per_step = family_of(config).flops_per_example(
      {k: v.shape[1] for k, v in t5lite_batches[0].items()}) * batch_size
  # Both sides' FLOP rates count the model FLOPs of t5lite's batches (the same useful tokens
  # on both sides), against the rate of the step's largest matmul shape on this machine.
  flops_rate = {name: flops_per_step * steps_run["t5lite"] / _median(wall[name])
                for name in sides}
  matmul_shape = (batch_size * inputs_length, config.d_model, config.d_ff)
  matmul_rate = machine.matmul_flops_per_s(*matmul_shape, dtype=config.dtype)
  mb = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
  report = {
      "bench": "train",
      "mode": mode,
      "ratio_vs_hf": round(rate["t5lite"] / rate["hf"], 3) if hf else None,
      "t5lite_tokens_per_s": round(rate["t5lite"], 1),
      "hf_tokens_per_s": round(rate["hf"], 1) if hf else None,
      "t5lite_step_s": round(_median(wall["t5lite"]) / steps_run["t5lite"], 4),
      "hf_step_s": round(_median(wall["hf"]) / steps_run["hf"], 4) if hf else None,
      "t5lite_compile_s": round(t5lite.compile_s, 2),
      "first_two_steps_s": {k: round(v, 3) for k, v in first_step_s.items()},
      "mfu_t5lite": (round(cost_model.mfu(flops_per_step, _median(wall["t5lite"]) /
                                          steps_run["t5lite"], peak), 4) if peak else None),
      "flops_per_step": flops_per_step,
      "flops_per_s": {k: float(f"{v:.4g}") for k, v in flops_rate.items()},
      "matmul_flops_per_s": float(f"{matmul_rate:.4g}"),
      "matmul_shape": list(matmul_shape),
      "fraction_of_matmul_peak": {k: round(v / matmul_rate, 3) for k, v in flops_rate.items()},
      "step_peak_rss_mb": {k: mb(v) for k, v in step_memory.items()},
      "t5lite_compiled_temp_mb": mb(t5lite.compiled_temp_bytes()),
      "device_peak_mb": {"t5lite": mb(t5lite.peak_device_bytes()),
                         "hf": mb(sides["hf"].trainer.peak_device_bytes()) if hf else None},
      "process_max_rss_mb": mb(machine.max_rss_bytes()),
      "step0_loss": {k: round(v, 6) for k, v in step0_loss.items()},
      "step0_loss_rel_diff": (abs(step0_loss["t5lite"] - step0_loss["hf"]) /
                              abs(step0_loss["hf"]) if hf else None),
      "warmup_losses": {k: [round(x, 6) for x in v] for k, v in warmup_losses.items()},
      "tokens_per_run": tokens_per_run,
      "tokens_counted": "inputs + targets" if mode == "pretrain" else "non-pad inputs + targets",
      "steps_per_run": steps_run if hf else {"t5lite": steps_run["t5lite"]},
      "padding_efficiency": _padding_efficiency(t5lite_batches, hf_batches if hf else None),
      "cpu_per_wall": {k: round(sum(cpu[k]) / sum(wall[k]), 2) for k in sides},
      "repeats": repeats, "batch_size": batch_size, "inputs_length": inputs_length,
      "targets_length": targets_length, "model": model,
      "config": {k: getattr(config, k) for k in (
          "vocab_size", "d_model", "d_ff", "num_heads", "d_kv", "num_encoder_layers",
          "num_decoder_layers", "mlp_activation", "tie_output_embedding", "dtype")},
      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
      "torch_threads": threads if hf else None, "cpu_count": os.cpu_count(),
      "hf_attention": sides["hf"].trainer.attention_implementation if hf else None,
      "load_avg_1m": [round(load_before[0], 2), round(load_after[0], 2)],
      # Other processes' share of the CPUs during each timed run: median and worst.
      "others_cpu_fraction": ([round(_median(others_cpu), 3), round(max(others_cpu), 3)]
                              if others_cpu else None),
      "wall_s_per_run": {k: [round(x, 3) for x in v] for k, v in wall.items()},
  }
  log(_table(report, wall, tokens_per_run))
  return report


def _padding_efficiency(t5lite_batches, hf_batches) -> dict:
  """Useful tokens over all token positions of each side's batches."""
  def positions(b):
    return sum(v.size for k, v in b.items() if k in ("encoder_input_tokens", "decoder_target_tokens",
                                                     "input_ids", "labels"))
  out = {"t5lite": round(sum(map(t5lite_useful_tokens, t5lite_batches)) /
                         sum(map(positions, t5lite_batches)), 4)}
  if hf_batches is not None:
    from t5lite.bench.hf_t5_train import useful_tokens
    out["hf"] = round(sum(map(useful_tokens, hf_batches)) / sum(map(positions, hf_batches)), 4)
  return out


def main(argv: Sequence[str] | None = None) -> int:
  """`t5lite bench train [--mode pretrain|finetune] [--model NAME] ...`: table + JSON line."""
  parser = argparse.ArgumentParser(
      prog="t5lite bench train",
      description="Train-step throughput, t5lite vs HF transformers' PyTorch T5, side by side.")
  parser.add_argument("--family", choices=("t5", "bert", "gpt2"), default="t5",
                      help="t5: vs T5ForConditionalGeneration; bert: vs BertForPreTraining "
                      "(MLM 15%% + next sentence); gpt2: vs GPT2LMHeadModel (pretrain mode)")
  parser.add_argument("--mode", choices=("pretrain", "finetune"), default="pretrain")
  parser.add_argument("--model", choices=sorted(MODELS), default="bench",
                      help="'bench': d_model 256, d_ff 1024, 4 heads of 64, 4+4 layers "
                      "(bert / gpt2: 4 layers; 'bench' or 'tiny' only)")
  parser.add_argument("--length", type=int, default=None,
                      help="bert / gpt2: tokens a row (default: bert 128, gpt2 512)")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--inputs_length", type=int, default=512)
  parser.add_argument("--targets_length", type=int, default=114)
  parser.add_argument("--steps", type=int, default=3, help="t5lite steps per timed run")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--learning_rate", type=float, default=1e-3)
  parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
  parser.add_argument("--no_hf", action="store_true", help="t5lite only (ratio_vs_hf null)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quiet_wait_s", type=float, default=0.0,
                      help="seconds (in all) to wait, before each pair of runs, for other "
                      "processes to leave the CPUs; timings on a busy machine favour XLA")
  args = parser.parse_args(argv)
  if min(args.batch_size, args.inputs_length, args.targets_length, args.steps, args.repeats,
         args.threads) < 1:
    parser.error("sizes, --steps, --repeats and --threads must be positive")
  if args.family != "t5":
    if args.mode != "pretrain":
      parser.error(f"--family {args.family} benchmarks --mode pretrain only")
    if args.model not in ("bench", "tiny"):
      parser.error(f"--family {args.family} has the models 'bench' and 'tiny'")
    if args.length is not None and args.length < (5 if args.family == "bert" else 2):
      parser.error("--length is too short for a row")
  elif args.length is not None:
    parser.error("--length is for --family bert / gpt2 (T5: --inputs_length, --targets_length)")
  report = run(mode=args.mode, model=args.model, batch_size=args.batch_size,
               inputs_length=args.inputs_length, targets_length=args.targets_length,
               steps=args.steps, repeats=args.repeats, dtype=args.dtype,
               learning_rate=args.learning_rate, threads=args.threads, hf=not args.no_hf,
               seed=args.seed, quiet_wait_s=args.quiet_wait_s, family=args.family,
               length=args.length)
  print(json.dumps({**report, "machine": machine.describe()}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
