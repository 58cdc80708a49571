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

`--memory` measures instead what one `generate` call adds to the process's peak RSS, for the
same random params laid out three ways (MEMORY_VARIANTS), each in a fresh subprocess:
unscanned, scanned (generate slices the stacks inside its jitted program), and scanned but
sliced outside jit before the call (what generate did before: a second copy of every layer).
There is no HF peer, so `ratio_vs_hf` is null. Its default model has 4 + 4 layers of d_model
256 and d_ff 2048 at vocab 1024: 62 MB (MiB, as all its figures) of float32 params, 60 MB of
them in layers. A few MB either way are allocator noise; a copy of the layers is not. About a
minute on 2 cores, most of it compiling:

  python -m t5lite.bench.decode --memory
  ... {"bench": "decode_memory", "ratio_vs_hf": null, "scanned_greedy_peak_rss_increase_mb": ...}
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from t5lite.bench import hf_t5_decode, machine
from t5lite.errors import ConfigError
from t5lite.models.config import ModelConfig
from t5lite.util import progress

GOAL_RATIO = 2.0
METHODS = ("greedy", "beam")

# T5 v1.1-like, small enough for a CPU benchmark: 4 + 4 layers, d_model 256, 4 heads x 64.
BENCH_CONFIG = ModelConfig(vocab_size=32128, d_model=256, d_ff=1024, num_heads=4, d_kv=64,
                           num_encoder_layers=4, num_decoder_layers=4,
                           mlp_activation="gated-gelu", dropout_rate=0.0)
# Flag defaults: (throughput, --memory). The memory model is mostly layers (a small vocab), big
# enough that a copy of them stands out, and decodes a few short rows: RSS is the figure.
SIZES = {"batch_size": (8, 4), "inputs_length": (128, 32), "max_new_tokens": (64, 16),
         "d_model": (256, 256), "d_ff": (1024, 2048), "num_heads": (4, 4), "d_kv": (64, 64),
         "num_layers": (4, 4), "vocab_size": (32128, 1024)}
MEMORY_VARIANTS = {
    "unscanned": "scan_layers=False: params stored per layer, as decoding reads them",
    "scanned": "scan_layers=True: stacked params, sliced inside generate's jitted program",
    "scanned_sliced_outside_jit": "stacked params unscanned before each call (the old path)",
}


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
  with progress.Progress("bench decode: timed repeats", repeats, "repeat") as bar:
    for _ in range(repeats):
      for method in METHODS:
        for name, decode in sides.items():  # interleaved: t5lite, HF, t5lite, HF, ...
          elapsed, out = _timed(lambda: decode(method))
          seconds[name, method].append(elapsed)
          outputs[name, method] = out
      bar.update()

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


# --- --memory: peak RSS of generate per params layout ---------------------------------------

def _status_mb(field: str) -> float:
  """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in MB."""
  with open("/proc/self/status", encoding="ascii") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024  # kB
  raise ConfigError(f"/proc/self/status has no {field}: --memory needs Linux")


def peak_rss_increase_mb(fn: Callable[[], Any]) -> float:
  """How far the RSS rises above its level before fn() while fn runs, in MB.

  ru_maxrss cannot tell: it keeps the process's peak so far (compilation's included) and
  cannot be reset. Linux's VmHWM can: writing 5 to /proc/self/clear_refs sets it to the current
  RSS. Memory freed earlier goes back to the OS first (malloc_trim), so that fn's allocations
  show as new pages instead of reusing free ones the RSS already counts.
  """
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):  # not glibc: free pages may hide part of the increase
    pass
  before = _status_mb("VmRSS")
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
  except OSError as error:
    raise ConfigError(f"--memory resets the peak RSS through /proc/self/clear_refs: {error}")
  fn()
  return _status_mb("VmHWM") - before


def _nbytes_mb(tree) -> float:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)) / 2**20


def memory_variant(variant: str, *, config: ModelConfig, batch_size: int, inputs_length: int,
                   max_new_tokens: int, num_beams: int, alpha: float, seed: int) -> dict:
  """In this process: the peak RSS increase of one steady-state generate call per method,
  for config's random params laid out as `variant` (MEMORY_VARIANTS)."""
  import t5lite
  from t5lite.models.params import init_params, scan_params, unscan_params
  config = config.replace(scan_layers=False)
  params = init_params(config, seed)
  layers_mb = sum(_nbytes_mb(value) for stack in ("encoder", "decoder") if stack in params
                  for name, value in params[stack].items() if name.startswith("layers_"))
  if variant != "unscanned":
    scanned = config.replace(scan_layers=True)
    params = scan_params(params, scanned)
    config = scanned if variant == "scanned" else config
  params = jax.device_put(params)  # in device memory once, as a served model's are
  if variant == "scanned_sliced_outside_jit":
    decode_params = lambda: unscan_params(params)  # per call, as generate used to
  else:
    decode_params = lambda: params
  inputs = make_inputs(batch_size, inputs_length, config.vocab_size, seed)
  settings = {"greedy": {}, "beam": dict(num_beams=num_beams, alpha=alpha)}
  report = {"variant": variant, "params_mb": round(_nbytes_mb(params), 1),
            "layer_params_mb": round(layers_mb, 1)}
  for method in METHODS:
    decode = lambda: t5lite.generate(config, decode_params(), inputs, method=method,
                                     max_decode_length=max_new_tokens, **settings[method])
    decode()  # compiles: not measured
    report[f"{method}_peak_rss_increase_mb"] = round(peak_rss_increase_mb(decode), 1)
  return report


def run_memory(*, config: ModelConfig, batch_size: int, inputs_length: int,
               max_new_tokens: int, num_beams: int, alpha: float, seed: int,
               log: Callable[[str], Any] | None = print) -> dict:
  """`memory_variant` for each of MEMORY_VARIANTS in a fresh subprocess, so that no variant
  reuses another's compiled programs or freed memory; returns the figures of the JSON line."""
  log = log or (lambda _: None)
  log(f"bench decode --memory: d_model {config.d_model}, {config.num_heads} heads x "
      f"{config.d_kv}, d_ff {config.d_ff}, {config.num_encoder_layers}+"
      f"{config.num_decoder_layers} layers, vocab {config.vocab_size}; batch {batch_size}, "
      f"inputs {inputs_length}, {max_new_tokens} new tokens, beam {num_beams}")
  flags = dict(batch_size=batch_size, inputs_length=inputs_length, max_new_tokens=max_new_tokens,
               num_beams=num_beams, alpha=alpha, seed=seed, d_model=config.d_model,
               d_ff=config.d_ff, num_heads=config.num_heads, d_kv=config.d_kv,
               num_layers=config.num_decoder_layers, vocab_size=config.vocab_size)
  argv = [arg for name, value in flags.items() for arg in (f"--{name}", str(value))]
  results = {}
  for variant in MEMORY_VARIANTS:
    child = subprocess.run(
        [sys.executable, "-m", "t5lite.bench.decode", *argv, "--memory_variant", variant],
        capture_output=True, text=True, check=False)
    if child.returncode:
      raise RuntimeError(f"--memory_variant {variant} failed:\n{child.stderr[-3000:]}")
    results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
  first = results["unscanned"]
  report = {"bench": "decode_memory", "ratio_vs_hf": None, "params_mb": first["params_mb"],
            "layer_params_mb": first["layer_params_mb"]}
  for variant in MEMORY_VARIANTS:
    for method in METHODS:
      key = f"{method}_peak_rss_increase_mb"
      report[f"{variant}_{key}"] = results[variant][key]
  lines = [f"{'variant':28} {'greedy MB':>10} {'beam MB':>10}  peak RSS increase of one "
           f"generate call; params {report['params_mb']} MB, {report['layer_params_mb']} MB "
           f"in layers"]
  for variant, what in MEMORY_VARIANTS.items():
    lines.append(f"{variant:28} {results[variant]['greedy_peak_rss_increase_mb']:10.1f} "
                 f"{results[variant]['beam_peak_rss_increase_mb']:10.1f}  {what}")
  log("\n".join(lines))
  return report


def main(argv: Sequence[str] | None = None) -> int:
  """`t5lite bench decode [--memory] [--batch_size N] [--inputs_length N] ...`."""
  parser = argparse.ArgumentParser(
      prog="t5lite bench decode",
      description="Greedy and beam decoding throughput on CPU, t5lite.generate vs HF "
      "T5ForConditionalGeneration.generate, on the same random T5 v1.1-like weights; with "
      "--memory, the peak RSS that generate adds, for scanned vs unscanned params.")
  parser.add_argument("--memory", action="store_true",
                      help="measure peak RSS of generate (scanned, unscanned and sliced-outside-"
                           "jit params, each in a fresh subprocess) instead of throughput")
  parser.add_argument("--memory_variant", choices=sorted(MEMORY_VARIANTS),
                      help=argparse.SUPPRESS)  # one --memory subprocess
  for field in ("batch_size", "inputs_length", "max_new_tokens"):
    parser.add_argument(f"--{field}", type=int, help="default %d (--memory: %d)" % SIZES[field])
  parser.add_argument("--num_beams", type=int, default=4)
  parser.add_argument("--alpha", type=float, default=0.6,
                      help="length penalty (T5X's for t5lite, HF's length_penalty for HF)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--torch_threads", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  for field in ("d_model", "d_ff", "num_heads", "d_kv", "num_layers", "vocab_size"):
    default, memory_default = SIZES[field]
    parser.add_argument(f"--{field}", type=int, help=f"model size: default {default}"
                        + (f" (--memory: {memory_default})" if memory_default != default else ""))
  args = parser.parse_args(argv)
  memory = args.memory or args.memory_variant is not None
  for field, defaults in SIZES.items():
    if getattr(args, field) is None:
      setattr(args, field, defaults[memory])
  sizes = (args.batch_size, args.inputs_length, args.max_new_tokens, args.num_beams,
           args.repeats, args.torch_threads, args.d_model, args.d_ff, args.num_heads, args.d_kv,
           args.num_layers, args.vocab_size)
  if min(sizes) < 1:
    parser.error("sizes, counts and thread numbers must be positive")
  config = BENCH_CONFIG.replace(d_model=args.d_model, d_ff=args.d_ff, num_heads=args.num_heads,
                                d_kv=args.d_kv, num_encoder_layers=args.num_layers,
                                num_decoder_layers=args.num_layers, vocab_size=args.vocab_size)
  common = dict(config=config, batch_size=args.batch_size, inputs_length=args.inputs_length,
                max_new_tokens=args.max_new_tokens, num_beams=args.num_beams, alpha=args.alpha,
                seed=args.seed)
  if args.memory_variant:
    report = memory_variant(args.memory_variant, **common)
  elif args.memory:
    report = run_memory(**common)
  else:
    report = run(**common, repeats=args.repeats, torch_threads=args.torch_threads)
  print(json.dumps({**report, "machine": machine.describe()}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
