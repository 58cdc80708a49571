"""`t5lite bench moe`: both runs train through the CLI on the same data and the report
compares them at equal FLOPs per token (a few steps here; the README quotes a full run)."""
import json

import pytest

from t5lite.bench import moe

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_dense_and_switch_runs_are_reported_side_by_side(tmp_path, capsys):
  assert moe.main(["--out", str(tmp_path / "out"), "--steps", "4", "--experts", "4"]) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["bench"] == "moe" and report["ratio_vs_hf"] is None
  dense, switch = report["dense"], report["switch"]
  assert dense["steps"] == switch["steps"] == 4
  # One expert per token: the same FLOPs but the router's (d_model x 4 per sparse token).
  assert 1.0 < report["flops_ratio"] < 1.002
  assert report["params_ratio"] > 1.5 and switch["params"] > dense["params"]
  assert 0.0 <= switch["dropped_fraction"] < 1.0 and "dropped_fraction" not in dense
  assert dense["eval_loss"] > 0 and switch["eval_loss"] > 0
  saved = json.loads((tmp_path / "out" / "moe.json").read_text())
  assert len(saved["switch"]["train_curve"]) >= 1
  assert (tmp_path / "out" / "moe.png").stat().st_size > 0
