"""`t5lite plot MODEL_DIR`: training loss and every eval/* series of a run, as one PNG.

Reads MODEL_DIR/metrics.jsonl (written by MetricsWriter) and writes MODEL_DIR/loss.png:
training loss against step on the left axis, each `eval/<task>/<metric>` series present on a
second panel below (eval figures have their own scales, e.g. accuracy vs. loss).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.runtime.metrics_writer import METRICS_FILE


def read_metrics(model_dir: str | os.PathLike) -> list[dict]:
  """The records of MODEL_DIR/metrics.jsonl in file order; a torn last line (a run killed
  mid-write) is skipped rather than failing the plot."""
  path = os.path.join(os.fspath(model_dir), METRICS_FILE)
  if not os.path.exists(path):
    raise ConfigFileNotFoundError(f"no {METRICS_FILE} in {model_dir!s}: is it a t5lite MODEL_DIR "
                                  f"of a run that has logged at least one step?")
  records = []
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      if i == len(lines) - 1:
        break
      raise ConfigError(f"{path}:{i + 1} is not valid JSON: {line[:80]!r}") from None
  return records


def last_value(model_dir: str | os.PathLike, key: str) -> float | None:
  """The last value of `key` (e.g. 'eval/TASK/accuracy') in MODEL_DIR/metrics.jsonl, or None."""
  values = [r[key] for r in read_metrics(model_dir) if r.get(key) is not None]
  return values[-1] if values else None


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
  points = [(r["step"], r[key]) for r in records if r.get(key) is not None and "step" in r]
  return [s for s, _ in points], [v for _, v in points]


def plot_losses(model_dir: str | os.PathLike, out_png: str | os.PathLike | None = None) -> str:
  """Plots training loss (and eval/* series) of a run; returns the PNG path written."""
  model_dir = os.fspath(model_dir)
  records = read_metrics(model_dir)
  steps, losses = _series(records, "loss")
  if not steps:
    raise ConfigError(f"{os.path.join(model_dir, METRICS_FILE)} has no 'loss' values to plot")
  eval_keys = sorted({k for r in records for k in r if k.startswith("eval/")})

  # Agg: no display needed (servers, CI); chosen before pyplot is first imported.
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = 2 if eval_keys else 1
  fig, axes = plt.subplots(rows, 1, figsize=(8, 3.5 * rows), sharex=True, squeeze=False)
  ax = axes[0, 0]
  ax.plot(steps, losses, label="train loss", linewidth=1)
  ax.set_ylabel("loss")
  ax.set_title(os.path.basename(os.path.normpath(model_dir)) or model_dir)
  ax.grid(alpha=0.3)
  ax.legend()
  if eval_keys:
    ax = axes[1, 0]
    for key in eval_keys:
      xs, ys = _series(records, key)
      # Evals are sparse, so markers make single points visible.
      ax.plot(xs, ys, marker="o", markersize=3, label=key[len("eval/"):])
    ax.set_ylabel("eval")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
  axes[-1, 0].set_xlabel("step")
  fig.tight_layout()

  out = os.fspath(out_png) if out_png is not None else os.path.join(model_dir, "loss.png")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv: Sequence[str] | None = None) -> int:
  """`t5lite plot MODEL_DIR [--out PNG]`."""
  parser = argparse.ArgumentParser(prog="t5lite plot", description=__doc__.splitlines()[0])
  parser.add_argument("model_dir", help="run directory holding metrics.jsonl")
  parser.add_argument("--out", default=None, help="PNG to write (default MODEL_DIR/loss.png)")
  args = parser.parse_args(argv)
  print(plot_losses(args.model_dir, args.out))  # a missing or bad metrics.jsonl: cli.main says so
  return 0
