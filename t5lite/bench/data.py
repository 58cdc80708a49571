"""`t5lite bench data`: span corruption + packing throughput per core, t5lite vs HF.

Both sides start from the same pre-tokenized documents (the embedded stdlib corpus, tokenized
once before any timing and replicated to fill many groups) and end with model-ready batches:

  t5lite  the real pipeline on pre-tokenized data, as for a cached task: a Task whose source
          is the token arrays, preprocessors `span_corruption_preprocessors()` only
          (select_random_chunk, concatenate 128 documents, split, span-corrupt, EOS), then
          `get_dataset` with the packed EncDecFeatureConverter; counts output rows.
  HF      `hf_t5_collator`: group_texts into expanded_inputs_length chunks (HF's own lengths
          helper), then FlaxDataCollatorForT5MLM over batches; counts examples (= rows).

The sides alternate (t5lite, HF, t5lite, HF, ...) `repeats` times; every run processes the
same number of batches (calibrated once so the slower side takes about `seconds_per_run`),
continuing each side's stream, so pipeline start-up is not timed. Reported figures are the
medians over runs of examples per CPU-second of this process: per-core throughput. The
process runs single-threaded: grain reads with no threads or prefetch (num_workers=0,
ReadOptions(num_threads=0)), BLAS/OpenMP pools are capped at 1 thread (this module sets the
variables before numpy loads, when it is the first to load it; nothing here calls BLAS), and
the report's cpu/wall ratio (~1.0) shows it. Example:

  t5lite bench data --inputs_length 512 --batch_size 64 --repeats 5
  ... {"bench": "data", "t5lite_examples_per_s": ..., "ratio_vs_hf": ..., ...}
"""
from __future__ import annotations

import os

# Cap BLAS / OpenMP pools at one thread. Effective when this module loads numpy first
# (`python -m t5lite.bench.data`); either way nothing here calls BLAS, and the report's
# cpu/wall ratio and thread count show what actually ran.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ.setdefault(_var, "1")

import argparse  # noqa: E402 (after the thread caps)
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from t5lite.bench import hf_t5_collator as hf, machine  # noqa: E402
from t5lite.data.objectives import span_corruption as sc  # noqa: E402
from t5lite.data.converters.sequence import EncDecFeatureConverter  # noqa: E402
from t5lite.data.pipeline import PipelineConfig, get_dataset  # noqa: E402
from t5lite.data.objectives.chains import CONCAT_GROUP, span_corruption_preprocessors  # noqa: E402
from t5lite.data.registry import Feature, Task, TaskRegistry, add_task  # noqa: E402

TASK_NAME = "bench_data_pretokenized_span_corruption"
T5_BASE_SEQUENCES_PER_S = 1000  # the feeding target for T5-base
GOAL_RATIO = 2.0


class _TokenIdsVocabulary:
  """The benchmark task's vocabulary: its documents are ids already, and span corruption
  reads only `vocab_size` (sentinels count down from vocab_size - 1) and EOS (T5's 1)."""
  eos_id = 1

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size


def embedded_documents() -> tuple[list[np.ndarray], int]:
  """The embedded corpus's train split, tokenized once: (int32 arrays, vocab_size)."""
  from t5lite_tasks import embedded  # the repo's tasks/ package; only needed here
  embedded.prepare()
  source = embedded.source("train")
  texts = [source[i]["text"] for i in range(len(source))]
  texts = [t.decode("utf-8") if isinstance(t, bytes) else t for t in texts]
  vocabulary = embedded.VOCABULARY
  return vocabulary.encode_batch(texts), vocabulary.vocab_size


def replicate(documents: Sequence[np.ndarray], minimum: int) -> list[np.ndarray]:
  """Non-empty documents repeated (the same arrays, no copies) to at least `minimum`.

  Example: [a, b], 5 -> [a, b, a, b, a, b].
  """
  documents = [np.asarray(d, np.int32) for d in documents if len(d)]
  if not documents:
    raise ValueError("the benchmark needs at least one non-empty document")
  return documents * max(1, -(-minimum // len(documents)))


def register_task(documents: Sequence[np.ndarray], vocab_size: int) -> Task:
  """(Re-)registers the benchmark's task: the token arrays as its source, as a cached task
  reads them, and the span corruption chain that follows a cache point."""
  vocabulary = _TokenIdsVocabulary(vocab_size)
  features = {"inputs": Feature(vocabulary), "targets": Feature(vocabulary)}
  TaskRegistry.remove(TASK_NAME)
  return add_task(TASK_NAME, {"train": [{"targets": d} for d in documents]}, features,
                  span_corruption_preprocessors())


def t5lite_batches(documents: Sequence[np.ndarray], vocab_size: int, inputs_length: int,
                   batch_size: int, seed: int = 0):
  """The t5lite pipeline's batch iterator over pre-tokenized documents (a registered task)."""
  _, targets_length = sc.span_corruption_lengths(inputs_length)
  register_task(documents, vocab_size)
  config = PipelineConfig(global_batch_size=batch_size, seed=seed, task_feature_lengths={
      "inputs": inputs_length, "targets": targets_length})
  # In-process (num_workers=0): one core does all the work, which is what we measure.
  return get_dataset(TASK_NAME, config, EncDecFeatureConverter(pack=True), num_workers=0)


def hf_batches(documents: Sequence[np.ndarray], vocab_size: int, inputs_length: int,
               batch_size: int, seed: int = 0) -> hf.HFBatches:
  """HF's data path (group_texts + FlaxDataCollatorForT5MLM) over the same documents."""
  expanded_inputs_length, targets_length = hf.compute_input_and_target_lengths(
      inputs_length, noise_density=0.15, mean_noise_span_length=3.0)
  collator = hf.FlaxDataCollatorForT5MLM(
      vocab_size=vocab_size, noise_density=0.15, mean_noise_span_length=3.0,
      input_length=inputs_length, target_length=targets_length, pad_token_id=0,
      decoder_start_token_id=0, seed=seed)
  return hf.HFBatches(documents, collator, batch_size, expanded_inputs_length, seed=seed)


def _timed(iterator, batches: int, collect: bool = True) -> tuple[float, float]:
  """(CPU seconds of this process, wall seconds) for `batches` next() calls."""
  if collect:
    gc.collect()  # neither side pays for the other's garbage
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(batches):
    next(iterator)
  return time.process_time() - cpu, time.perf_counter() - wall


def _median_rate(examples: int, seconds: Sequence[float]) -> float:
  return statistics.median(examples / max(s, 1e-9) for s in seconds)


def run(*, inputs_length: int = 512, batch_size: int = 64, repeats: int = 5,
        seconds_per_run: float = 3.0, documents: Sequence[np.ndarray] | None = None,
        vocab_size: int | None = None, seed: int = 0,
        log: Callable[[str], Any] | None = print) -> dict:
  """Runs the benchmark; returns the figures of the final JSON line (plus a few details).

  documents: pre-tokenized int arrays (default: the embedded corpus); vocab_size: the
  vocabulary size with its extra ids (default: the embedded vocabulary's, or for given
  documents max id + 101). Each of the 2 x repeats runs takes about seconds_per_run on the
  slower side; warm-up and calibration add about 2 x seconds_per_run.
  """
  log = log or (lambda _: None)
  if documents is None:
    documents, corpus_vocab_size = embedded_documents()
    vocab_size = vocab_size or corpus_vocab_size
  elif vocab_size is None:
    vocab_size = int(max(int(np.max(d)) for d in documents if len(d))) + 101
  raw_length, targets_length = sc.span_corruption_lengths(inputs_length)
  expanded_inputs_length, hf_targets_length = hf.compute_input_and_target_lengths(
      inputs_length, 0.15, 3.0)
  if (raw_length, targets_length) != (expanded_inputs_length, hf_targets_length):
    raise AssertionError("t5lite's and HF's span lengths disagree: "
                         f"{(raw_length, targets_length)} vs "
                         f"{(expanded_inputs_length, hf_targets_length)}")
  # Enough documents that every t5lite row fills two whole concatenation groups per epoch.
  documents = replicate(documents, 2 * CONCAT_GROUP * batch_size)
  tokens = sum(len(d) for d in documents)
  log(f"bench data: {len(documents)} documents, {tokens} tokens, inputs {inputs_length} / "
      f"targets {targets_length} (raw pieces of {raw_length}), batch {batch_size}")

  sides = {"t5lite": t5lite_batches(documents, vocab_size, inputs_length, batch_size, seed),
           "hf": hf_batches(documents, vocab_size, inputs_length, batch_size, seed)}
  try:
    # Warm-up (pipeline start-up, first groups) and calibration: a fixed batch count per run.
    rates = {}
    for name, iterator in sides.items():
      next(iterator)
      count, cpu = 0, 0.0
      while cpu < seconds_per_run / 2 or count < 2:
        step_cpu, _ = _timed(iterator, 1, collect=False)
        cpu, count = cpu + step_cpu, count + 1
      rates[name] = count / max(cpu, 1e-9)
    batches = max(1, round(seconds_per_run * min(rates.values())))
    examples = batches * batch_size

    cpu_s: dict[str, list[float]] = {name: [] for name in sides}
    wall_s: dict[str, list[float]] = {name: [] for name in sides}
    hf_group_s = []
    threads = threading.active_count()
    for _ in range(repeats):
      for name, iterator in sides.items():  # interleaved: t5lite, HF, t5lite, HF, ...
        group_before = sides["hf"].group_seconds
        cpu, wall = _timed(iterator, batches)
        cpu_s[name].append(cpu)
        wall_s[name].append(wall)
        if name == "hf":
          hf_group_s.append(sides["hf"].group_seconds - group_before)
        threads = max(threads, threading.active_count())
  finally:
    TaskRegistry.remove(TASK_NAME)

  t5lite_rate = _median_rate(examples, cpu_s["t5lite"])
  hf_rate = _median_rate(examples, cpu_s["hf"])
  hf_collate_rate = _median_rate(examples, [c - g for c, g in zip(cpu_s["hf"], hf_group_s)])
  report = {
      "bench": "data",
      "t5lite_examples_per_s": round(t5lite_rate, 1),
      "hf_examples_per_s": round(hf_rate, 1),
      "ratio_vs_hf": round(t5lite_rate / hf_rate, 3),
      "inputs_length": inputs_length,
      "batch_size": batch_size,
      "repeats": repeats,
      "cores_for_1000_seq_s": round(T5_BASE_SEQUENCES_PER_S / t5lite_rate, 3),
      "targets_length": targets_length,
      "examples_per_run": examples,
      "hf_collate_only_examples_per_s": round(hf_collate_rate, 1),
      "cpu_per_wall": round(sum(map(sum, cpu_s.values())) / sum(map(sum, wall_s.values())), 3),
      "threads": threads,
  }
  log(_table(report, cpu_s, wall_s, examples))
  return report


def _table(report: dict, cpu_s: dict, wall_s: dict, examples: int) -> str:
  """The human-readable part of the report."""
  lines = [f"{'side':8} {'ex/s/core (median)':>19} {'min':>8} {'max':>8} {'ex/s wall':>10} "
           f"{'cores for 1000/s':>17}"]
  for name in cpu_s:
    rates = [examples / c for c in cpu_s[name]]
    wall = _median_rate(examples, wall_s[name])
    median = statistics.median(rates)
    lines.append(f"{name:8} {median:19.0f} {min(rates):8.0f} {max(rates):8.0f} {wall:10.0f} "
                 f"{T5_BASE_SEQUENCES_PER_S / median:17.3f}")
  ratio = report["ratio_vs_hf"]
  lines.append(f"ratio t5lite / HF: {ratio:.2f}x (goal {GOAL_RATIO:.0f}x: "
               f"{'met' if ratio >= GOAL_RATIO else 'NOT met'}); HF collator alone "
               f"{report['hf_collate_only_examples_per_s']:.0f} ex/s/core; "
               f"{report['repeats']} interleaved runs of {examples} examples each; "
               f"cpu/wall {report['cpu_per_wall']:.2f}, {report['threads']} thread(s)")
  lines.append(f"T5-base at {T5_BASE_SEQUENCES_PER_S} sequences/s needs "
               f"{report['cores_for_1000_seq_s']:.2f} t5lite cores (of a 16-core host: "
               f"{'enough' if report['cores_for_1000_seq_s'] <= 16 else 'NOT enough'})")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """`t5lite bench data [--inputs_length N] [--batch_size N] [--repeats N]`: table + JSON.
  With --source KIND: streamed corpora of growing size instead (t5lite.bench.data_stream)."""
  args_list = list(sys.argv[1:] if argv is None else argv)
  if any(a == "--source" or a.startswith("--source=") for a in args_list):
    from t5lite.bench import data_stream  # pylint: disable=import-outside-toplevel
    return data_stream.main(args_list)
  parser = argparse.ArgumentParser(
      prog="t5lite bench data",
      description="Span corruption + packing throughput per core, t5lite vs HF's "
      "FlaxDataCollatorForT5MLM, on the same pre-tokenized embedded corpus.")
  parser.add_argument("--inputs_length", type=int, default=512)
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--seconds_per_run", type=float, default=3.0,
                      help="about how long one run of the slower side takes")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(args_list)
  if min(args.inputs_length, args.batch_size, args.repeats) < 1 or args.seconds_per_run <= 0:
    parser.error("--inputs_length, --batch_size, --repeats and --seconds_per_run must be positive")
  report = run(inputs_length=args.inputs_length, batch_size=args.batch_size,
               repeats=args.repeats, seconds_per_run=args.seconds_per_run, seed=args.seed)
  print(json.dumps({**report, "machine": machine.describe()}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
