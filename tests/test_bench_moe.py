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


# demo.gin at a quarter of its width, two layers a stack (a sparse MLP in each: every second
# layer is one) and batches of 8: the report's figures are ratios of the same two models.
SMALLER = """include 'runs/demo.gin'
ModelConfig.d_model = 32
ModelConfig.d_ff = 128
ModelConfig.num_heads = 2
ModelConfig.d_kv = 16
ModelConfig.num_encoder_layers = 2
ModelConfig.num_decoder_layers = 2
BATCH_SIZE = 8
TrainConfig.eval_steps = 1
"""


@pytest.mark.slow
def test_dense_and_switch_runs_are_reported_side_by_side(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(moe, "run_t5lite", train_in_this_process)
  (tmp_path / "smaller.gin").write_text(SMALLER)
  monkeypatch.setattr(moe, "RUN", str(tmp_path / "smaller.gin"))
  # --steps 2, the fewest the bench takes: the figures compared do not depend on the count.
  assert moe.main(["--out", str(tmp_path / "out"), "--steps", "2", "--experts", "4"]) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["bench"] == "moe" and report["ratio_vs_hf"] is None
  dense, switch = report["dense"], report["switch"]
  assert dense["steps"] == switch["steps"] == 2
  # One expert per token: the same FLOPs but the router's (d_model x 4 per sparse token).
  assert 1.0 < report["flops_ratio"] < 1.002
  # 4 experts for each sparse MLP (one per stack: the second layer) and its router: three
  # more copies of a gated MLP's d_model x d_ff matrices (wi_0, wi_1, wo) and d_model x 4.
  assert switch["params"] - dense["params"] == 2 * (3 * 3 * 32 * 128 + 32 * 4), report
  assert report["params_ratio"] == pytest.approx(switch["params"] / dense["params"])
  assert 0.0 <= switch["dropped_fraction"] < 1.0 and "dropped_fraction" not in dense
  assert dense["eval_loss"] > 0 and switch["eval_loss"] > 0
  saved = json.loads((tmp_path / "out" / "moe.json").read_text())
  assert len(saved["switch"]["train_curve"]) >= 1
  assert (tmp_path / "out" / "moe.png").stat().st_size > 0
