"""`t5lite bench decode`: greedy and beam decoding throughput on CPU, t5lite vs HF generate.

Both sides decode the same inputs with the same weights: a random T5 v1.1-like HF model
(`hf_t5_decode.random_model`: gated-GELU, untied lm_head) saved and read back with
`t5lite.load_hf`. Inputs are random ids (no EOS, no padding), so a random model rarely stops
early and both sides produce about max_new_tokens per row.

  t5lite  `t5lite.generate` (method 'greedy' / 'beam'): encoder once, prefill, one jitted
          lax.while_loop over positions with a preallocated KV cache.
  HF      `T5ForConditionalGeneration.generate` with its KV cache (greedy; num_beams=K with
          length_penalty=alpha), under torch.set_num_threads(torch_threads).

Each side's first call is timed separately (for t5lite: compilation plus one decode; its
compile figure is that minus the steady-state median) and kept out of the medians. Then the
runs alternate (t5lite greedy, HF greedy, t5lite beam, HF beam, repeated) and the report gives
median output tokens per wall-clock second, where output tokens are the returned tokens up to
and including EOS (the best hypothesis for beam search; B x max_new_tokens when no row stops).
`ratio_vs_hf` is the greedy ratio (t5lite over HF, higher is better); the beam ratio is
reported beside it. The report also says whether the greedy tokens of the two sides agree
(they should, exactly) and on what fraction of rows the beam outputs agree (HF's length
penalty differs from T5X's). Example (about a minute on 2 cores):

  python -m t5lite.bench.decode --repeats 3
  ... {"bench": "decode", "ratio_vs_hf": ..., "t5lite_greedy_tokens_per_s": ..., ...}
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from t5lite.bench import hf_t5_decode
from t5lite.models.config import ModelConfig

GOAL_RATIO = 2.0
METHODS = ("greedy", "beam")

# T5 v1.1-like, small enough for a CPU benchmark: 4 + 4 layers, d_model 256, 4 heads x 64.
BENCH_CONFIG = ModelConfig(vocab_size=32128, d_model=256, d_ff=1024, num_heads=4, d_kv=64,
                           num_encoder_layers=4, num_decoder_layers=4,
                           mlp_activation="gated-gelu", dropout_rate=0.0)


def make_inputs(batch_size: int, inputs_length: int, vocab_size: int, seed: int = 0):
  """Random ids in [2, vocab_size - 100): no pad, no EOS, no sentinel ids. (B, L) int32."""
  rng = np.random.default_rng(seed)
  return rng.integers(2, max(3, vocab_size - 100), (batch_size, inputs_length), dtype=np.int32)


def output_tokens(tokens: np.ndarray) -> int:
  """Tokens up to and including each row's EOS (all of a row without EOS)."""
  count = 0
  for row in tokens:
    ends = np.flatnonzero(row == 1)
    count += int(ends[0]) + 1 if len(ends) else len(row)
  return count


def _timed(fn: Callable[[], np.ndarray]) -> tuple[float, np.ndarray]:
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def _load_average() -> float | None:
  try:
    return round(os.getloadavg()[0], 2)
  except OSError:
    return None


def run(*, config: ModelConfig = BENCH_CONFIG, batch_size: int = 8, inputs_length: int = 128,
        max_new_tokens: int = 64, num_beams: int = 4, alpha: float = 0.6, repeats: int = 3,
        torch_threads: int = 2, seed: int = 0, log: Callable[[str], Any] | None = print) -> dict:
  """Runs the benchmark; returns the figures of the final JSON line."""
  import t5lite  # the public API under test
  log = log or (lambda _: None)
  model = hf_t5_decode.random_model(config, seed)
  with tempfile.TemporaryDirectory() as path:
    model.save_pretrained(path)
    config, params = t5lite.load_hf(path)
  # In device memory once, as HF's weights sit in torch tensors: no per-call transfer.
  params = jax.device_put(params)
  hf = hf_t5_decode.HFDecoder(model, num_threads=torch_threads)
  inputs = make_inputs(batch_size, inputs_length, config.vocab_size, seed)
  hf_batch = hf.prepare(inputs)
  settings = {"greedy": {}, "beam": dict(num_beams=num_beams, alpha=alpha)}
  sides = {
      "t5lite": lambda m: t5lite.generate(config, params, inputs, max_decode_length=max_new_tokens,
                                          method=m, **settings[m]),
      "hf": lambda m: hf.generate(hf_batch, max_new_tokens=max_new_tokens, method=m,
                                  **settings[m]),
  }
  log(f"bench decode: d_model {config.d_model}, {config.num_heads} heads x {config.d_kv}, "
      f"d_ff {config.d_ff}, {config.num_encoder_layers}+{config.num_decoder_layers} layers, "
      f"vocab {config.vocab_size}; batch {batch_size}, inputs {inputs_length}, "
      f"{max_new_tokens} new tokens, beam {num_beams} (alpha {alpha}); "
      f"torch threads {torch_threads}; load average {_load_average()}")

  first_s, outputs = {}, {}
  for method in METHODS:
    for name, decode in sides.items():
      first_s[name, method], outputs[name, method] = _timed(lambda: decode(method))
  seconds: dict[tuple[str, str], list[float]] = {key: [] for key in first_s}
  for _ in range(repeats):
    for method in METHODS:
      for name, decode in sides.items():  # interleaved: t5lite, HF, t5lite, HF, ...
        elapsed, out = _timed(lambda: decode(method))
        seconds[name, method].append(elapsed)
        outputs[name, method] = out

  rate = {key: statistics.median(output_tokens(outputs[key]) / s for s in runs)
          for key, runs in seconds.items()}
  steady = {key: statistics.median(runs) for key, runs in seconds.items()}
  greedy_ratio = rate["t5lite", "greedy"] / rate["hf", "greedy"]
  beam_ratio = rate["t5lite", "beam"] / rate["hf", "beam"]
  report = {
      "bench": "decode",
      "ratio_vs_hf": round(greedy_ratio, 3),
      "greedy_ratio_vs_hf": round(greedy_ratio, 3),
      "beam_ratio_vs_hf": round(beam_ratio, 3),
      "t5lite_greedy_tokens_per_s": round(rate["t5lite", "greedy"], 1),
      "hf_greedy_tokens_per_s": round(rate["hf", "greedy"], 1),
      "t5lite_beam_tokens_per_s": round(rate["t5lite", "beam"], 1),
      "hf_beam_tokens_per_s": round(rate["hf", "beam"], 1),
      "t5lite_greedy_compile_s": round(max(0.0, first_s["t5lite", "greedy"]
                                           - steady["t5lite", "greedy"]), 3),
      "t5lite_beam_compile_s": round(max(0.0, first_s["t5lite", "beam"]
                                         - steady["t5lite", "beam"]), 3),
      "greedy_tokens_match": bool(np.array_equal(outputs["t5lite", "greedy"],
                                                 outputs["hf", "greedy"])),
      "beam_rows_match": round(float(np.mean(np.all(
          outputs["t5lite", "beam"] == outputs["hf", "beam"], axis=1))), 3),
      "batch_size": batch_size,
      "inputs_length": inputs_length,
      "max_new_tokens": max_new_tokens,
      "num_beams": num_beams,
      "alpha": alpha,
      "repeats": repeats,
      "torch_threads": torch_threads,
      "load_average": _load_average(),
  }
  log(_table(report, seconds, outputs))
  return report


def _table(report: dict, seconds: dict, outputs: dict) -> str:
  """The human-readable part of the report."""
  lines = [f"{'method':7} {'side':7} {'tokens/s (median)':>18} {'min':>8} {'max':>8} "
           f"{'s/run':>7} {'tokens':>7}"]
  for (name, method), runs in seconds.items():
    tokens = output_tokens(outputs[name, method])
    rates = [tokens / s for s in runs]
    lines.append(f"{method:7} {name:7} {statistics.median(rates):18.1f} {min(rates):8.1f} "
                 f"{max(rates):8.1f} {statistics.median(runs):7.3f} {tokens:7d}")
  ratio = report["ratio_vs_hf"]
  lines.append(f"ratio t5lite / HF: greedy {ratio:.2f}x (goal {GOAL_RATIO:.0f}x: "
               f"{'met' if ratio >= GOAL_RATIO else 'NOT met'}), beam "
               f"{report['beam_ratio_vs_hf']:.2f}x; t5lite compile (excluded): greedy "
               f"{report['t5lite_greedy_compile_s']:.1f} s, beam "
               f"{report['t5lite_beam_compile_s']:.1f} s; greedy tokens "
               f"{'match' if report['greedy_tokens_match'] else 'DIFFER'}, beam rows matching "
               f"{report['beam_rows_match']:.0%}; {report['repeats']} interleaved runs; "
               f"load average {report['load_average']}")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """`t5lite bench decode [--batch_size N] [--inputs_length N] [--max_new_tokens N] ...`."""
  parser = argparse.ArgumentParser(
      prog="t5lite bench decode",
      description="Greedy and beam decoding throughput on CPU, t5lite.generate vs HF "
      "T5ForConditionalGeneration.generate, on the same random T5 v1.1-like weights.")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--inputs_length", type=int, default=128)
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--num_beams", type=int, default=4)
  parser.add_argument("--alpha", type=float, default=0.6,
                      help="length penalty (T5X's for t5lite, HF's length_penalty for HF)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--torch_threads", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  for field, default in (("d_model", 256), ("d_ff", 1024), ("num_heads", 4), ("d_kv", 64),
                         ("num_layers", 4), ("vocab_size", 32128)):
    parser.add_argument(f"--{field}", type=int, default=default, help="model size")
  args = parser.parse_args(argv)
  sizes = (args.batch_size, args.inputs_length, args.max_new_tokens, args.num_beams,
           args.repeats, args.torch_threads, args.d_model, args.d_ff, args.num_heads, args.d_kv,
           args.num_layers, args.vocab_size)
  if min(sizes) < 1:
    parser.error("sizes, counts and thread numbers must be positive")
  config = BENCH_CONFIG.replace(d_model=args.d_model, d_ff=args.d_ff, num_heads=args.num_heads,
                                d_kv=args.d_kv, num_encoder_layers=args.num_layers,
                                num_decoder_layers=args.num_layers, vocab_size=args.vocab_size)
  report = run(config=config, batch_size=args.batch_size, inputs_length=args.inputs_length,
               max_new_tokens=args.max_new_tokens, num_beams=args.num_beams, alpha=args.alpha,
               repeats=args.repeats, torch_threads=args.torch_threads, seed=args.seed)
  print(json.dumps(report), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
