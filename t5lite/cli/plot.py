"""`t5lite plot RUN [RUN ...]`: the training loss and every eval series of one or more runs.

    t5lite plot /tmp/t5_base                                   # -> /tmp/t5_base/loss.png
    t5lite plot runs/dense runs/switch --x tokens --smooth 0.8 --out compare.png --csv compare.csv

Reads each RUN's metrics.jsonl (a MODEL_DIR; written by MetricsWriter) and draws one figure:
the training loss in the first panel, then one panel per eval metric (`eval/<task>/<metric>`:
each has its own scale), every run a line of its own colour in each panel, against the step or
the tokens trained on (`--x tokens`, the rows' `tokens` column). `--smooth W` draws the
exponential moving average TensorBoard's slider draws (weight W in [0, 1), debiased at the
start) over the faint raw loss. `--csv` also writes every plotted point as one row
(run, metric, step, tokens, value).
"""
from __future__ import annotations

import argparse
import csv
import json
import io
import os
from typing import Sequence

import numpy as np

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.runtime.metrics_writer import METRICS_FILE
from t5lite.util import atomic, paths

X_AXES = ("step", "tokens")
EXAMPLE = ("examples:\n  t5lite plot /tmp/t5_base\n  t5lite plot runs/dense runs/switch "
           "--x tokens --smooth 0.8 --out compare.png --csv compare.csv")


def read_metrics(model_dir: str | os.PathLike) -> list[dict]:
  """The records of MODEL_DIR/metrics.jsonl in file order; a torn last line (a run killed
  mid-write) is skipped rather than failing the plot."""
  path = paths.join(os.fspath(model_dir), METRICS_FILE)
  if not paths.isfile(path):
    raise ConfigFileNotFoundError(f"no {METRICS_FILE} in {model_dir!s}: is it a t5lite MODEL_DIR "
                                  f"of a run that has logged at least one step?")
  records = []
  lines = paths.read_text(path).splitlines()
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


def smoothed(values: Sequence[float], weight: float) -> list[float]:
  """TensorBoard's smoothing: an exponential moving average, debiased so that the first
  points are not pulled towards zero. weight 0 returns the values."""
  out, average = [], 0.0
  for i, value in enumerate(values):
    average = weight * average + (1 - weight) * value
    out.append(average / (1 - weight ** (i + 1)) if weight else value)
  return out


def _tokens_by_step(records: list[dict]) -> dict[int, float]:
  """Step -> tokens trained on, from the training rows' `tokens`, interpolated (and at the
  ends extended with the nearest rows' tokens per step) to the steps of eval rows: an eval at
  a step that was not logged, or before the first step. {} for a run whose rows have no
  `tokens`; a single training row gives the eval rows nothing to go on (their tokens: None)."""
  known = sorted({r["step"]: r["tokens"] for r in records if r.get("tokens") is not None}.items())
  if len(known) < 2:
    return dict(known)
  steps, tokens, logged = [s for s, _ in known], [t for _, t in known], dict(known)

  def at(step: int) -> float:
    if step in logged:
      return logged[step]
    if step < steps[0]:
      return tokens[0] - (steps[0] - step) * (tokens[1] - tokens[0]) / (steps[1] - steps[0])
    if step > steps[-1]:
      return tokens[-1] + (step - steps[-1]) * (tokens[-1] - tokens[-2]) / (steps[-1] - steps[-2])
    return float(np.interp(step, steps, tokens))

  return {r["step"]: at(r["step"]) for r in records if "step" in r}


class Run:
  """One run's series: metric -> [(step, tokens, value)], in file order."""

  def __init__(self, model_dir: str, label: str, x: str):
    self.model_dir, self.label = model_dir, label
    records = read_metrics(model_dir)
    tokens = _tokens_by_step(records)
    if x == "tokens" and not tokens:
      raise ConfigError(f"{paths.join(model_dir, METRICS_FILE)} has no 'tokens' column (a run "
                        "logged by an older t5lite): plot it against --x step")
    keys = ["loss"] + sorted({k for r in records for k in r if k.startswith("eval/")})
    self.series = {key: [(r["step"], tokens.get(r["step"]), r[key]) for r in records
                         if r.get(key) is not None and "step" in r] for key in keys}
    if not self.series["loss"] and len(keys) == 1:
      raise ConfigError(f"{paths.join(model_dir, METRICS_FILE)} has no 'loss' or eval values "
                        "to plot")


def _labels(model_dirs: list[str]) -> list[str]:
  """Each run's folder name, or its whole path where two runs share a folder name."""
  names = [paths.basename(d.rstrip("/")) or d for d in model_dirs]
  return [name if names.count(name) == 1 else d for name, d in zip(names, model_dirs)]


def plot_runs(model_dirs: Sequence[str | os.PathLike], out_png: str | os.PathLike | None = None,
              *, x: str = "step", smooth: float = 0.0, out_csv: str | None = None) -> str:
  """Draws the runs' loss and eval series (module docstring); returns the PNG path written:
  out_png, or RUN/loss.png for one run, ./loss.png for several."""
  if x not in X_AXES:
    raise ConfigError(f"--x {x!r} is not one of {', '.join(X_AXES)}")
  if not 0 <= smooth < 1:
    raise ConfigError(f"--smooth {smooth} is not in [0, 1): 0 draws the raw values, 0.9 a "
                      "strong average")
  model_dirs = [os.fspath(d) for d in model_dirs]
  runs = [Run(d, label, x) for d, label in zip(model_dirs, _labels(model_dirs))]
  keys = ["loss"] + sorted({k for run in runs for k in run.series if k != "loss"})
  if not any(run.series["loss"] for run in runs):
    keys.remove("loss")

  # Agg: no display needed (servers, CI); chosen before pyplot is first imported.
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(len(keys), 1, figsize=(8, 3.2 * len(keys)), sharex=True,
                           squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, key in zip(axes[:, 0], keys):
    for i, run in enumerate(runs):
      points = [p for p in run.series.get(key, []) if x == "step" or p[1] is not None]
      if not points:
        continue
      xs = [p[0] if x == "step" else p[1] for p in points]
      ys = [p[2] for p in points]
      color = colors[i % len(colors)]
      if key == "loss" and smooth:
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1)
        ax.plot(xs, smoothed(ys, smooth), color=color, linewidth=1.5, label=run.label)
      else:  # evals are sparse: markers make single points visible
        ax.plot(xs, ys, color=color, linewidth=1 if key == "loss" else 1.2,
                marker=None if key == "loss" else "o", markersize=3, label=run.label)
    ax.set_ylabel("train loss" if key == "loss" else key[len("eval/"):], fontsize="small")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
  axes[0, 0].set_title(runs[0].label if len(runs) == 1 else f"{len(runs)} runs")
  axes[-1, 0].set_xlabel(x)
  fig.tight_layout()

  if out_png is None:
    out_png = paths.join(model_dirs[0], "loss.png") if len(runs) == 1 else "loss.png"
  out = os.fspath(out_png)
  image = io.BytesIO()
  fig.savefig(image, format="png", dpi=100)
  plt.close(fig)
  atomic.write_file(out, image.getvalue())  # a local path or a bucket URL
  if out_csv is not None:
    table = io.StringIO(newline="")
    writer = csv.writer(table)
    writer.writerow(["run", "metric", "step", "tokens", "value"])
    for run in runs:
      for key, points in run.series.items():
        writer.writerows([run.label, key, *point] for point in points)
    atomic.write_file(out_csv, table.getvalue())
  return out


def main(argv: Sequence[str] | None = None) -> int:
  """`t5lite plot RUN [RUN ...] [--x step|tokens] [--smooth W] [--out PNG] [--csv CSV]`."""
  parser = argparse.ArgumentParser(
      prog="t5lite plot", description=__doc__.split("\n\n")[0].split(": ", 1)[1],
      epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("model_dirs", nargs="+", metavar="RUN",
                      help="run directories (MODEL_DIRs) holding metrics.jsonl")
  parser.add_argument("--x", default="step", choices=X_AXES,
                      help="the x axis: training steps, or tokens trained on")
  parser.add_argument("--smooth", type=float, default=0.0,
                      help="exponential moving average of the train loss, weight in [0, 1) "
                      "(TensorBoard's slider; default 0: raw)")
  parser.add_argument("--out", default=None,
                      help="PNG to write (default: RUN/loss.png for one run, ./loss.png for "
                      "several)")
  parser.add_argument("--csv", default=None, help="also write the plotted points to this CSV")
  args = parser.parse_args(argv)
  print(plot_runs(args.model_dirs, args.out, x=args.x, smooth=args.smooth, out_csv=args.csv))
  if args.csv:
    print(args.csv)
  return 0
