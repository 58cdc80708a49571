"""`t5lite bench gpu`: refused off a GPU with one line, every phase end to end on a tiny model
with --dry_run (the CPU's share of the GPU check), and the largest-batch arithmetic."""
import json

import pytest

from t5lite import cli
from t5lite.bench import gpu



def test_off_a_gpu_it_refuses_with_one_line_and_exit_2(capsys):
  assert cli.main(["bench", "gpu"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1
  assert "needs a CUDA GPU (this backend: cpu)" in err and "--dry_run" in err


def test_bad_phases_are_refused_by_name(capsys):
  with pytest.raises(SystemExit) as stop:
    gpu.main(["--dry_run", "--phases", "train,warp"])
  assert stop.value.code == 2
  assert "--phases takes some of train,decode,parity,largest" in capsys.readouterr().err


def test_largest_batch_fills_the_limit_by_the_measured_bytes_per_row():
  gib, params = 2**30, 247_577_856
  fixed = 16 * params  # float32 params, gradients and AdamW's m and v: 3.69 GiB
  # 20 GiB at batch 32: (20 - 3.69 GiB) / 32 = 0.510 GiB a row; 100 GiB of room above
  # the fixed cost holds 196 rows -> 192, the multiple of 8 below.
  assert gpu.largest_batch(20 * gib, 32, params, 100 * gib + fixed, cap=256) == 192
  assert gpu.largest_batch(20 * gib, 32, params, 1000 * gib, cap=256) == 256
  assert gpu.largest_batch(20 * gib, 32, params, 2 * gib, cap=256) == 8  # never below 8


@pytest.mark.e2e
@pytest.mark.slow
def test_dry_run_runs_every_phase_and_keeps_a_report_after_each(tmp_path, capsys,
                                                                quick_matmul_rate):
  report_path = tmp_path / "report.json"
  assert gpu.main(["--dry_run", "--report", str(report_path)]) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report["bench"] == "gpu" and report["dry_run"] and report["errors"] == {}
  assert json.loads(report_path.read_text()) == {k: v for k, v in report.items()
                                                 if k not in ("seconds", "machine")}
  fused, xla = report["train"]  # the fused arm first, beside HF
  assert report["train"][fused]["hf_tokens_per_s"] > 0
  assert report["train"][xla]["hf_tokens_per_s"] is None
  # The same weights and batch in every arm: the same first loss (XLA's path both times here).
  assert (report["train"][fused]["step0_loss"]["t5lite"]
          == report["train"][xla]["step0_loss"]["t5lite"])
  assert report["train"][fused]["step0_loss_rel_diff"] < 1e-3  # vs HF, bfloat16 autocast
  assert report["decode"]["t5lite"]["output_tokens"] > 0 and report["decode"]["ratio_vs_hf"] > 0
  parity = report["parity"]
  assert parity["within_tolerance"] and len(parity["losses"]) == 3
  assert parity["losses"][2] < parity["losses"][0]  # the steps train
  assert report["largest"]["batch_size"] == 8
