"""`t5lite plot RUN [RUN ...]`: runs compared on one figure, against steps or tokens, eval
metrics in panels of their own, smoothing, the plotted points as CSV."""
from __future__ import annotations

import csv
import json
import struct

import pytest

from t5lite import cli
from t5lite.cli import plot


def write_run(folder, rows):
  folder.mkdir(parents=True)
  (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return folder


def png_size(path) -> tuple[int, int]:
  data = open(path, "rb").read(24)
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  return struct.unpack(">II", data[16:24])  # IHDR: width, height


@pytest.fixture
def two_runs(tmp_path):
  dense = write_run(tmp_path / "a" / "dense", [
      {"step": 10, "loss": 4.0, "tokens": 1280}, {"step": 20, "loss": 3.0, "tokens": 2560},
      {"step": 20, "eval/copy/loss": 3.5, "eval/copy/accuracy": 0.25}])
  switch = write_run(tmp_path / "b" / "switch", [
      {"step": 10, "loss": 3.8, "tokens": 640}, {"step": 15, "eval/copy/loss": 3.6},
      {"step": 20, "loss": 2.9, "tokens": 1280}])
  return dense, switch


def test_two_runs_on_one_figure_against_tokens_with_every_point_in_the_csv(two_runs, tmp_path,
                                                                          capsys):
  out, table = tmp_path / "compare.png", tmp_path / "compare.csv"
  assert cli.main(["plot", *map(str, two_runs), "--x", "tokens", "--smooth", "0.5",
                   "--out", str(out), "--csv", str(table)]) == 0
  assert capsys.readouterr().out.split() == [str(out), str(table)]
  # Three panels of 320 pixels: the train loss, eval/copy/accuracy, eval/copy/loss.
  assert png_size(out) == (800, 960)
  rows = list(csv.DictReader(open(table)))
  assert [(r["run"], r["metric"], r["step"], r["tokens"], r["value"]) for r in rows] == [
      ("dense", "loss", "10", "1280", "4.0"), ("dense", "loss", "20", "2560", "3.0"),
      ("dense", "eval/copy/accuracy", "20", "2560", "0.25"),
      ("dense", "eval/copy/loss", "20", "2560", "3.5"),
      ("switch", "loss", "10", "640", "3.8"), ("switch", "loss", "20", "1280", "2.9"),
      # an eval at a step without a training row: its tokens from the run's tokens per step
      ("switch", "eval/copy/loss", "15", "960.0", "3.6")]


def test_one_run_keeps_its_loss_png(tmp_path):
  run = write_run(tmp_path / "run", [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}])
  assert plot.plot_runs([run]) == str(run / "loss.png")
  assert png_size(run / "loss.png") == (800, 320)


def test_runs_of_the_same_folder_name_are_told_apart_by_path(tmp_path):
  first = write_run(tmp_path / "x" / "run", [{"step": 1, "loss": 3.0}])
  second = write_run(tmp_path / "y" / "run", [{"step": 1, "loss": 2.0}])
  assert plot._labels([str(first), str(second)]) == [str(first), str(second)]
  assert plot._labels([str(first), str(tmp_path / "x")]) == ["run", "x"]


def test_smoothing_is_tensorboards_debiased_moving_average():
  # By hand: averages 0.5, 0.25, 0.625 over debias weights 0.5, 0.75, 0.875.
  assert plot.smoothed([1.0, 0.0, 1.0], 0.5) == pytest.approx([1.0, 1 / 3, 5 / 7])
  assert plot.smoothed([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
  assert plot.smoothed([1.0, 0.0], 0.0) == [1.0, 0.0]


@pytest.mark.parametrize("args, message", [
    (["--x", "tokens"], "has no 'tokens' column (a run logged by an older t5lite): plot it "
                        "against --x step"),
    (["--smooth", "1.5"], "--smooth 1.5 is not in [0, 1)"),
])
def test_bad_plots_exit_2_in_one_line(tmp_path, capsys, args, message):
  run = write_run(tmp_path / "old", [{"step": 1, "loss": 3.0}])
  assert cli.main(["plot", str(run), *args]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err


def test_eval_rows_get_the_tokens_of_their_step_between_and_beyond_the_training_rows():
  """A finetuning run counts tokens from its initial checkpoint's step (400): its eval before
  training is at 0 tokens, one after the last training row goes on at the same rate."""
  records = [{"step": 400, "eval/t/loss": 6.0}, {"step": 420, "loss": 4.0, "tokens": 2000},
             {"step": 440, "loss": 3.0, "tokens": 4000}, {"step": 430, "eval/t/loss": 5.0},
             {"step": 450, "eval/t/loss": 4.5}]
  assert plot._tokens_by_step(records) == {400: 0.0, 420: 2000, 440: 4000, 430: 3000.0,
                                           450: 5000.0}
  assert plot._tokens_by_step([{"step": 5, "loss": 1.0, "tokens": 50}]) == {5: 50}
