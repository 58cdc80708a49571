"""`t5lite bench data --source KIND`: a C4-shaped corpus streamed through span corruption.

The corpus is synthesized once from the embedded text (the stdlib documents, as C4 records
{"text", "timestamp", "url"}) at each size asked for (default 0.5, 2 and 8 GB of JSON), in
at least 256 shards, and kept in --corpus_dir. For each size a fresh process reads it the way
training does: `get_dataset` over a task whose source is the streamed files (JSONL.gz,
Parquet, or an HF dataset through `datasets` streaming), tokenized with the embedded
vocabulary, span-corrupted and packed to 512/114 (T5's objective), batch 32, in-process. It
reports:

  first_batch_s      wall seconds from building the pipeline to the first batch
  examples_per_s     rows per CPU second of the process, after the first batch (per core)
  peak_rss_mb        the process's peak resident memory (ru_maxrss); rss_after_imports_mb
                     its resident memory once the libraries and the vocabulary are loaded
  resume_exact       whether an iterator restored from the state after N batches gives the
                     same next batches as the uninterrupted one (bitwise)

beside two peers on the middle size's corpus: the indexed path (JsonlSource, which holds each
shard decompressed in memory) over its first --peer_shards shards, and HF's path (`datasets`
streaming with a 1,000-example shuffle buffer, the same tokenizer, run_t5_mlm_flax's
group_texts and FlaxDataCollatorForT5MLM; t5lite.bench.hf_t5_collator). Example:

  t5lite bench data --source jsonl_gz --sizes_gb 0.5 2 8
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Sequence

SOURCES = ("jsonl_gz", "parquet", "hf_dataset")
TASK = "bench_stream_span_corruption"
MIN_SHARDS = 256


def _peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_mb() -> float:
  """The resident memory now (Linux), in MB."""
  with open("/proc/self/statm", encoding="ascii") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _documents() -> list[dict]:
  """The embedded train documents as C4 records."""
  from t5lite_tasks import embedded  # the repo's tasks/ package
  embedded.prepare()
  source = embedded.source("train")
  docs = []
  for i in range(len(source)):
    text = source[i]["text"]
    text = text.decode("utf-8") if isinstance(text, bytes) else text
    docs.append({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                 "url": f"https://docs.python.org/3/library/{i}.html"})
  return docs


def synthesize(folder: str, size_gb: float, shards: int = MIN_SHARDS,
               kind: str = "jsonl_gz") -> str:
  """Writes (once) a corpus of about size_gb GB of JSON text in `shards` files; returns the
  glob of its files. Parquet shards hold the same records as the JSON ones."""
  suffix = "parquet" if kind == "parquet" else "json.gz"
  folder = os.path.join(folder, f"{size_gb:g}gb-{shards}")
  pattern = os.path.join(folder, f"c4-train.*-of-{shards:05d}.{suffix}")
  done = os.path.join(folder, f"DONE.{suffix}")
  if os.path.exists(done):
    return pattern
  os.makedirs(folder, exist_ok=True)
  lines = [json.dumps(d) + "\n" for d in _documents()]
  per_shard = size_gb * 1e9 / shards
  for s in range(shards):
    records, size, i = [], 0, s * 7  # each shard starts elsewhere in the documents
    while size < per_shard:
      records.append(lines[i % len(lines)])
      size, i = size + len(records[-1]), i + 1
    path = os.path.join(folder, f"c4-train.{s:05d}-of-{shards:05d}.{suffix}")
    if kind == "parquet":
      import pyarrow as pa  # pylint: disable=import-outside-toplevel
      import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
      pq.write_table(pa.Table.from_pylist([json.loads(r) for r in records]), path + ".tmp",
                     row_group_size=1000)
    else:
      with gzip.open(path + ".tmp", "wt", encoding="utf-8", compresslevel=1) as f:
        f.writelines(records)
    os.replace(path + ".tmp", path)
  open(done, "w").close()
  return pattern


def _stream_source(kind: str, pattern: str):
  from t5lite.data.sources import streams  # pylint: disable=import-outside-toplevel
  if kind == "parquet":
    return streams.ParquetStream(pattern, ["text"])
  if kind == "hf_dataset":
    import glob  # pylint: disable=import-outside-toplevel
    # datasets reads JSON in chunks of 10 MB by default, one per open shard (per batch row).
    return streams.HfStream("json", data_files=sorted(glob.glob(pattern)), chunksize=1 << 20)
  return streams.JsonlStream(pattern, ("text",))


def _in_memory_source(pattern: str, shards: int):
  import glob  # pylint: disable=import-outside-toplevel
  from t5lite.data.sources.readers import JsonlSource  # pylint: disable=import-outside-toplevel
  return JsonlSource(sorted(glob.glob(pattern))[:shards], ("text",))


def measure(kind: str, pattern: str, batch_size: int, batches: int, seed: int = 0,
            peer_shards: int = 64) -> dict:
  """One size, in this process: the figures of the module docstring."""
  from t5lite_tasks import embedded  # pylint: disable=import-outside-toplevel
  from t5lite.data import preprocessors as pp  # pylint: disable=import-outside-toplevel
  from t5lite.data.converters.sequence import EncDecFeatureConverter  # pylint: disable=import-outside-toplevel
  from t5lite.data.objectives import span_corruption as sc  # pylint: disable=import-outside-toplevel
  from t5lite.data.objectives.chains import span_corruption_preprocessors  # pylint: disable=import-outside-toplevel
  from t5lite.data.pipeline import PipelineConfig, get_dataset  # pylint: disable=import-outside-toplevel
  from t5lite.data.registry import TaskRegistry, add_task  # pylint: disable=import-outside-toplevel
  embedded.VOCABULARY.vocab_size  # loads the vocabulary before the clock starts
  rss_imports = _rss_mb()
  start = time.perf_counter()
  if kind == "in_memory":
    source = _in_memory_source(pattern, peer_shards)
  else:
    source = _stream_source(kind, pattern)
  TaskRegistry.remove(TASK)
  add_task(TASK, {"train": source}, embedded.FEATURES,
           [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize,
            *span_corruption_preprocessors()])
  lengths = {"inputs": 512, "targets": sc.span_corruption_lengths(512)[1]}
  config = PipelineConfig(global_batch_size=batch_size, task_feature_lengths=lengths, seed=seed)

  def pipeline():
    return get_dataset(TASK, config, EncDecFeatureConverter(pack=True))

  it = pipeline()
  next(it)
  first_batch = time.perf_counter() - start
  cpu = time.process_time()
  for _ in range(batches):
    next(it)
  cpu = time.process_time() - cpu
  state = it.get_state()
  following = [next(it) for _ in range(3)]
  resumed = pipeline()
  resumed.set_state(json.loads(json.dumps(state)))
  import numpy as np  # pylint: disable=import-outside-toplevel
  exact = all(all(np.array_equal(a[k], b[k]) for k in a)
              for a, b in zip(following, (next(resumed) for _ in range(3))))
  return {"source": kind, "first_batch_s": round(first_batch, 2),
          "examples_per_s": round(batches * batch_size / max(cpu, 1e-9), 1),
          "peak_rss_mb": round(_peak_rss_mb()), "rss_after_imports_mb": round(rss_imports),
          "resume_exact": bool(exact), "resumed_after_batches": batches + 1}


def measure_hf(pattern: str, batch_size: int, batches: int, seed: int = 0) -> dict:
  """HF's path over the same files: datasets streaming, tokenize, group_texts, collator."""
  import glob  # pylint: disable=import-outside-toplevel
  import datasets  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from t5lite.bench import hf_t5_collator as hf  # pylint: disable=import-outside-toplevel
  from t5lite_tasks import embedded  # pylint: disable=import-outside-toplevel
  vocabulary = embedded.VOCABULARY
  vocabulary.vocab_size
  rss_imports = _rss_mb()
  start = time.perf_counter()
  expanded, targets = hf.compute_input_and_target_lengths(512, 0.15, 3.0)
  collator = hf.FlaxDataCollatorForT5MLM(
      vocab_size=vocabulary.vocab_size, noise_density=0.15, mean_noise_span_length=3.0,
      input_length=512, target_length=targets, pad_token_id=0, decoder_start_token_id=0,
      seed=seed)
  stream = datasets.load_dataset("json", data_files=sorted(glob.glob(pattern)), split="train",
                                 streaming=True).shuffle(seed=seed, buffer_size=1000)

  def tokenize(batch):  # run_t5_mlm_flax: tokenize, then group_texts, batched by 1000
    ids = vocabulary.encode_batch(batch["text"])
    return {"input_ids": [chunk for chunk in hf.group_texts(
        [np.append(np.asarray(i, np.int32), 1) for i in ids], expanded)]}

  chunks = iter(stream.map(tokenize, batched=True, batch_size=1000,
                           remove_columns=["text", "timestamp", "url"]))

  def batch():
    return collator([{"input_ids": np.asarray(next(chunks)["input_ids"])}
                     for _ in range(batch_size)])

  batch()
  first_batch = time.perf_counter() - start
  cpu = time.process_time()
  for _ in range(batches):
    batch()
  cpu = time.process_time() - cpu
  return {"source": "hf_collator", "first_batch_s": round(first_batch, 2),
          "examples_per_s": round(batches * batch_size / max(cpu, 1e-9), 1),
          "peak_rss_mb": round(_peak_rss_mb()), "rss_after_imports_mb": round(rss_imports)}


def _in_child(*args: str) -> dict:
  """A measurement in a fresh process (its peak RSS is its own)."""
  out = subprocess.run([sys.executable, "-m", "t5lite.bench.data_stream", "--measure", *args],
                       capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"measurement {args} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def run(source: str, sizes_gb: Sequence[float], corpus_dir: str, *, shards: int = MIN_SHARDS,
        batch_size: int = 32, batches: int = 600, repeats: int = 3, peer_shards: int = 64,
        log=print) -> dict:
  rows = []
  for size in sizes_gb:
    started = time.perf_counter()
    pattern = synthesize(corpus_dir, size, shards, source)
    log(f"corpus {size:g} GB in {shards} shards ({source}): ready in "
        f"{time.perf_counter() - started:.0f} s at {os.path.dirname(pattern)}")
    runs = [_in_child(source, pattern, str(batch_size), str(batches), "0")
            for _ in range(repeats)]
    rows.append(_median_row(runs, size_gb=size))
    log(json.dumps(rows[-1]))
  peer_size = sorted(sizes_gb)[len(sizes_gb) // 2]
  peer_corpus = synthesize(corpus_dir, peer_size, shards, "jsonl_gz")
  peers = []
  for peer in ("in_memory", "hf_collator"):
    runs = [_in_child(peer, peer_corpus, str(batch_size), str(batches), str(peer_shards))
            for _ in range(repeats)]
    read = (f"{peer_shards} of {shards} shards" if peer == "in_memory" else "all shards")
    peers.append(_median_row(runs, size_gb=peer_size, read=read))
    log(json.dumps(peers[-1]))
  rss = [r["peak_rss_mb"] for r in rows]
  return {"bench": "data_stream", "source": source, "batch_size": batch_size,
          "lengths": "512/114 packed", "sizes": rows, "peers": peers,
          "peak_rss_spread": round(max(rss) / min(rss) - 1, 3),
          "peak_rss_max_mb": max(rss), "resume_exact": all(r["resume_exact"] for r in rows)}


def _median_row(runs: list[dict], **extra) -> dict:
  """The runs' median of every figure (a flag holds only if it held in every run)."""
  row = dict(runs[0], **extra, runs=len(runs))
  for key, value in runs[0].items():
    if isinstance(value, bool):
      row[key] = all(r[key] for r in runs)
    elif isinstance(value, (int, float)):
      row[key] = statistics.median(r[key] for r in runs)
  return row


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--measure"]:
    kind, pattern, batch_size, batches, peer_shards = argv[1:6]
    if kind == "hf_collator":
      report = measure_hf(pattern, int(batch_size), int(batches))
    else:
      report = measure(kind, pattern, int(batch_size), int(batches),
                       peer_shards=int(peer_shards))
    print(json.dumps(report), flush=True)
    return 0
  parser = argparse.ArgumentParser(prog="t5lite bench data --source", description=__doc__.split(
      "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--source", choices=SOURCES, required=True)
  parser.add_argument("--sizes_gb", type=float, nargs="+", default=[0.5, 2, 8])
  parser.add_argument("--shards", type=int, default=MIN_SHARDS)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--batches", type=int, default=600,
                      help="batches timed per run (a row span-corrupts 128 documents at a time)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--peer_shards", type=int, default=64,
                      help="shards of the middle size the in-memory peer reads")
  parser.add_argument("--corpus_dir", default=os.path.expanduser("~/.cache/t5lite/bench-corpus"))
  args = parser.parse_args(argv)
  if min(args.sizes_gb) <= 0 or min(args.shards, args.batch_size, args.batches,
                                    args.repeats) < 1:
    parser.error("--sizes_gb, --shards, --batch_size, --batches and --repeats must be positive")
  from t5lite.bench import machine  # pylint: disable=import-outside-toplevel
  report = run(args.source, args.sizes_gb, args.corpus_dir, shards=args.shards,
               batch_size=args.batch_size, batches=args.batches, repeats=args.repeats,
               peer_shards=args.peer_shards)
  print(json.dumps({**report, "machine": machine.describe()}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
