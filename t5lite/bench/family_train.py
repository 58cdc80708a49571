"""`t5lite bench train --family bert|gpt2`: t5lite's train step vs HF PyTorch BERT / GPT-2.

The same harness as the T5 bench (t5lite.bench.train: the trainer's jitted, donating
windowed_train_step compiled ahead of time; fused torch AdamW at the same lr / betas / eps /
weight decay; 2 untimed warm-up steps a side; `repeats` interleaved runs of `steps` steps;
medians of wall time), on models built from one HF config dict (hf_family_train.hf_config):

  bert   BertForPreTraining vs t5lite family 'bert' (post-norm, exact GELU, pooler + NSP head):
         rows [CLS] A [SEP] B [SEP], 15% MLM positions (80/10/10), a next-sentence label; the
         loss is MLM mean + NSP mean on both sides. Default 8 x 128 tokens (BERT's phase-1
         length, where most of its pretraining steps are).
  gpt2   GPT2LMHeadModel (labels = input_ids) vs t5lite family 'gpt2' (pre-norm, tanh GELU,
         learned positions, tied head); mean next-token CE. Default 8 x 512 tokens.

Model 'bench': hidden 256, 4 layers, 4 heads of 64, FF 1024, vocab 30522 (BERT) / 50257
(GPT-2), fp32, no dropout. tokens/s counts every position of the batch (no padding), the same
on both sides. One random batch is fed at every step, so the warm-up's second losses agree too
(a check that both AdamW updates match).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from t5lite.bench import hf_family_train as hf_family
from t5lite.bench import machine
from t5lite.bench.train_timing import HFSide, T5liteSide, _median, _table, measure
from t5lite.bench.machine import cpu_model
from t5lite.bench.train_batches import family_batches

DEFAULT_LENGTH = {"bert": 128, "gpt2": 512}


def run(*, family: str, model: str = "bench", batch_size: int = 8, length: int | None = None,
        steps: int = 3, repeats: int = 5, dtype: str = "float32", learning_rate: float = 1e-3,
        threads: int = 2, hf: bool = True, seed: int = 0, quiet_wait_s: float = 0.0,
        log: Callable[[str], Any] | None = print) -> dict:
  """Runs the BERT or GPT-2 benchmark; returns the figures of the final JSON line."""
  import jax
  from t5lite.families import family_of
  from t5lite.models import count_params, init_params
  from t5lite.train import cost_model
  from t5lite.train.optimizers import OptimizerConfig
  from t5lite.train.schedules import ScheduleConfig
  if family not in hf_family.FAMILIES:
    raise ValueError(f"family {family!r} is not one of {hf_family.FAMILIES}")
  log = log or (lambda _: None)
  load_before = os.getloadavg()
  length = length or DEFAULT_LENGTH[family]
  hf_dict = hf_family.hf_config(family, model, max_positions=max(512, length))
  config = hf_family.t5lite_config(hf_dict, dtype)
  t5lite_batches, hf_batches = family_batches(family, config.vocab_size, batch_size, length,
                                              seed)
  t5lite_batches, hf_batches = t5lite_batches * steps, hf_batches * steps
  parity_batch = hf_batches[0]
  tokens_per_run = batch_size * length * steps
  optimizer_config = OptimizerConfig(name="adamw", schedule=ScheduleConfig(
      name="constant", value=learning_rate, warmup_steps=0))
  params = init_params(config, seed)
  log(f"bench train: {family}, model {model} ({count_params(params) / 1e6:.1f}M params, "
      f"vocab {config.vocab_size}, {config.dtype}), batch {batch_size} x {length}, "
      f"{steps} steps a run, {repeats} repeats, backend {jax.default_backend()}, "
      f"load {load_before[0]:.2f}")

  sides: dict[str, Any] = {}
  step0_loss: dict[str, float] = {}
  if hf:
    if sum(map(hf_family.useful_tokens, hf_batches)) != tokens_per_run:
      raise AssertionError("HF's batches do not hold the same tokens as t5lite's")
    device = "cuda" if jax.default_backend() == "gpu" else "cpu"
    trainer = hf_family.HFFamilyTrainer(
        hf_dict, config, jax.device_get(params), learning_rate=learning_rate,
        b1=optimizer_config.b1, b2=optimizer_config.b2, eps=optimizer_config.eps,
        weight_decay=optimizer_config.weight_decay, device=device, num_threads=threads)
    step0_loss["hf"] = trainer.loss(trainer.to_device(parity_batch))  # before any update
    sides["hf"] = HFSide(trainer, hf_batches)
  t5lite = T5liteSide(config, params, optimizer_config, t5lite_batches)
  del params  # donated with the state
  sides = {"t5lite": t5lite, **({"hf": sides["hf"]} if hf else {})}  # t5lite runs first

  timing = measure(sides, repeats, quiet_wait_s, log)
  wall = timing.wall
  step0_loss["t5lite"] = timing.warmup_losses["t5lite"][0]
  rate = {name: tokens_per_run / _median(wall[name]) for name in sides}
  step_s = {name: _median(wall[name]) / steps for name in sides}
  peak = cost_model.peak_flops(jax.devices()[0].device_kind)
  lengths = {k: v.shape[1] for k, v in t5lite_batches[0].items() if np.ndim(v) == 2}
  flops_per_step = family_of(config).flops_per_example(lengths) * batch_size
  mb = lambda b: None if b is None else round(b / 2**20, 1)  # noqa: E731
  loss_diff = abs(step0_loss["t5lite"] - step0_loss["hf"]) if hf else None
  report = {
      "bench": "train",
      "family": family,
      "mode": "pretrain",
      "ratio_vs_hf": round(rate["t5lite"] / rate["hf"], 3) if hf else None,
      "tokens_per_s": round(rate["t5lite"], 1),
      "t5lite_tokens_per_s": round(rate["t5lite"], 1),
      "hf_tokens_per_s": round(rate["hf"], 1) if hf else None,
      "t5lite_step_s": round(step_s["t5lite"], 4),
      "hf_step_s": round(step_s["hf"], 4) if hf else None,
      "t5lite_compile_s": round(t5lite.compile_s, 2),
      "first_two_steps_s": {k: round(v, 3) for k, v in timing.first_step_s.items()},
      "mfu_t5lite": (round(cost_model.mfu(flops_per_step, step_s["t5lite"], peak), 4)
                     if peak else None),
      "step_peak_rss_mb": {k: mb(v) for k, v in timing.step_memory.items()},
      "t5lite_compiled_temp_mb": mb(t5lite.compiled_temp_bytes()),
      "device_peak_mb": {"t5lite": mb(t5lite.peak_device_bytes()),
                         "hf": mb(sides["hf"].trainer.peak_device_bytes()) if hf else None},
      "process_max_rss_mb": mb(machine.max_rss_bytes()),
      "step0_loss": {k: round(v, 6) for k, v in step0_loss.items()},
      "step0_loss_diff": loss_diff,
      "step0_loss_rel_diff": loss_diff / abs(step0_loss["hf"]) if hf else None,
      "warmup_losses": {k: [round(x, 6) for x in v] for k, v in timing.warmup_losses.items()},
      "tokens_per_run": tokens_per_run,
      "tokens_counted": "every position (batch x length, no padding)",
      "steps_per_run": {name: steps for name in sides},
      "padding_efficiency": {name: 1.0 for name in sides},
      "cpu_per_wall": {k: round(sum(timing.cpu[k]) / sum(wall[k]), 2) for k in sides},
      "repeats": repeats, "batch_size": batch_size, "length": length, "model": model,
      "config": {k: getattr(config, k) for k in (
          "family", "architecture", "vocab_size", "d_model", "d_ff", "num_heads", "d_kv",
          "num_encoder_layers" if config.has_encoder else "num_decoder_layers",
          "mlp_activation", "norm_position", "tie_output_embedding", "dtype")},
      "hf_model": hf_dict["architectures"][0],
      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
      "cpu_model": cpu_model(), "cpu_count": os.cpu_count(),
      "torch_threads": threads if hf else None,
      "hf_attention": sides["hf"].trainer.attention_implementation if hf else None,
      "load_avg_1m": [round(load_before[0], 2), round(timing.load_after[0], 2)],
      # Other processes' share of the CPUs during each timed run: median and worst.
      "others_cpu_fraction": ([round(_median(timing.others_cpu), 3),
                               round(max(timing.others_cpu), 3)]
                              if timing.others_cpu else None),
      "wall_s_per_run": {k: [round(x, 3) for x in v] for k, v in wall.items()},
  }
  log(_table(report, wall, tokens_per_run))
  return report
