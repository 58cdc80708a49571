"""`t5lite bench moe`: both runs train through the CLI on the same data and the report
compares them at equal FLOPs per token (a few steps here; the README quotes a full run)."""
import json

import pytest

from t5lite import cli
from t5lite.bench import moe

pytestmark = pytest.mark.e2e


def train_in_this_process(argv: list[str]) -> None:
  """`t5lite ARGV` through the CLI's entry point here rather than in a fresh interpreter, as
  test_train_cli.py trains demo.gin: the report does not depend on the process boundary, and
  each interpreter's start-up (JAX, the tasks) costs seconds. Raises if it fails, as the
  bench's subprocess.run(check=True) does."""
  assert cli.main(argv) == 0, argv


@pytest.mark.slow
def test_dense_and_switch_runs_are_reported_side_by_side(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(moe, "run_t5lite", train_in_this_process)
  # --steps 2, the fewest the bench takes: the figures compared do not depend on the count.
  assert moe.main(["--out", str(tmp_path / "out"), "--steps", "2", "--experts", "4"]) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["bench"] == "moe" and report["ratio_vs_hf"] is None
  dense, switch = report["dense"], report["switch"]
  assert dense["steps"] == switch["steps"] == 2
  # One expert per token: the same FLOPs but the router's (d_model x 4 per sparse token).
  assert 1.0 < report["flops_ratio"] < 1.002
  assert report["params_ratio"] > 1.5 and switch["params"] > dense["params"]
  assert 0.0 <= switch["dropped_fraction"] < 1.0 and "dropped_fraction" not in dense
  assert dense["eval_loss"] > 0 and switch["eval_loss"] > 0
  saved = json.loads((tmp_path / "out" / "moe.json").read_text())
  assert len(saved["switch"]["train_curve"]) >= 1
  assert (tmp_path / "out" / "moe.png").stat().st_size > 0
