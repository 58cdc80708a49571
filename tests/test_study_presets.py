"""The presets that tests/test_study.py and tests/test_study_text_to_text.py do not run, each
end to end at smoke scale through the CLI (6 pretraining and 4 finetuning steps a run, one
downstream task): every arm pretrains as its spec says, is finetuned and gets its row in the
table. A module of its own so that the suite's other worker runs it beside test_study; on one
fake device, as there (the study's plumbing is under test, not sharding)."""
import json

import pytest

from helpers.cli import run_t5lite
from t5lite.study import spec

TASK = "stdlib_docstring_module_head"


def _model_config(run) -> dict:
  return json.loads((run / "model_config.json").read_text())


def _modifications(out, results):
  """Each arm's own MLP activation and norm; the gated arms (a third MLP matrix) get fewer
  steps than ReLU's 6 at equal FLOPs."""
  expected = {"relu": ("relu", "layer"), "gelu": ("gelu_exact", "layer"),
              "geglu": ("gated-gelu", "layer"), "swiglu": ("swiglu", "layer"),
              "rmsnorm": ("gelu_exact", "rms")}
  for arm, (activation, norm) in expected.items():
    config = _model_config(out / arm / "seed0" / "pretrain")
    assert (config["mlp_activation"], config["norm"]) == (activation, norm), arm
  steps = {arm: figures["pretrain_steps"] for arm, figures in results.items()}
  assert steps["relu"] == steps["gelu"] == steps["rmsnorm"] == 6
  assert 0 < steps["geglu"] < 6 and 0 < steps["swiglu"] < 6, steps


def _distillation(out, results):
  """A 4-layer teacher; the distilled student starts from the teacher's layers 0 and 2 and is
  scored by its MLM (hard) loss; equal steps, not FLOPs."""
  layers = {arm: _model_config(out / arm / "seed0" / "pretrain")["num_encoder_layers"]
            for arm in results}
  assert layers == {"teacher": 4, "distilled": 2, "scratch": 2}
  assert (out / "distilled" / "seed0" / "student_init" / ".complete").exists()
  assert "stdlib_mlm/distill_hard_loss" in results["distilled"]["pretrain_eval"]
  assert {figures["pretrain_steps"] for figures in results.values()} == {6}


def _no_more(out, results):
  pass


@pytest.mark.e2e
@pytest.mark.slow
# bert_ablations before pretrain_vs_scratch: the latter's runs are then compiled already (same
# worker, same compilation cache).
@pytest.mark.parametrize("name, check", [
    pytest.param(name, check, id=name) for name, check in (
        ("bert_ablations", _no_more), ("pretrain_vs_scratch", _no_more),
        ("modifications", _modifications), ("distillation", _distillation))])
def test_every_other_preset_runs_at_smoke_scale(name, check, tmp_path):
  out = tmp_path / "study"
  done = run_t5lite("study", name, "--scale", "smoke", "--out", out, devices=1, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  study = spec.get(name)
  assert set(json.loads(done.stdout.strip().splitlines()[-1])["arms"]) == {
      arm.name for arm in study.arms}
  table = (out / "study.md").read_text()
  results = {}
  for arm in study.arms:
    results[arm.name] = json.loads((out / arm.name / "seed0" / "result.json").read_text())
    assert 0 <= results[arm.name]["downstream"][TASK] <= 100
    assert (results[arm.name]["pretrain_steps"] > 0) == bool(arm.pretraining), arm.name
    assert f"| {arm.label} |" in table
  assert results[study.reference.name]["pretrain_steps"] == 6
  check(out, results)
