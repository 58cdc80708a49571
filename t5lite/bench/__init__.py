"""Benchmarks of t5lite against HF transformers' recipes (`t5lite bench <what>`).

Each benchmark module exposes `run(...) -> dict` and `main(argv) -> int`; a run prints a short
table and ends with one JSON line of its figures, including `ratio_vs_hf`.

  data            span corruption + packing throughput vs HF's FlaxDataCollatorForT5MLM
  hf_t5_collator  the HF side of `data`: a numpy re-implementation of HF's collator
  decode          greedy and beam decoding throughput vs HF's T5 `generate` on CPU
  hf_t5_decode    the HF side of `decode`: a random PyTorch T5 and its `generate`
  peft            full finetuning vs LoRA vs prompt tuning: step time, trainable params,
                  optimizer-state bytes, and ROUGE on the embedded summarization task
  recipes         ELECTRA vs BERT, a distilled student vs the same from scratch
  moe             a dense T5 vs its Switch version at equal FLOPs per token
"""
import os
import shlex
import shutil
import subprocess
import sys
import time


def fresh_out(out: str, overwrite: bool = False) -> None:
  """A benchmark's output folder, new or empty; an earlier run's is replaced only with
  overwrite (it may hold results someone wants)."""
  if os.path.isdir(out) and os.listdir(out):
    if not overwrite:
      raise FileExistsError(f"--out {out} is not empty; choose a new folder, or pass "
                            "--overwrite to replace this benchmark's earlier output")
    shutil.rmtree(out)
  os.makedirs(out, exist_ok=True)


def run_t5lite(argv: list[str]) -> None:
  """Runs `t5lite ARGV` in a subprocess (printed first, timed after); raises if it fails."""
  print(f"\n$ t5lite {shlex.join(argv)}", flush=True)
  started = time.time()
  subprocess.run([sys.executable, "-m", "t5lite.cli", *argv], check=True)
  print(f"  ({time.time() - started:.0f}s)", flush=True)
