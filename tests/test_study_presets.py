"""The presets that tests/test_study.py and tests/test_study_text_to_text.py do not run, each
end to end at smoke scale through the CLI (6 pretraining and 4 finetuning steps a run, one
downstream task): every arm run pretrains as its spec says, is finetuned and gets its row in
the table. A module of its own so that the suite's other worker runs it beside test_study; on
one fake device, as there (the study's plumbing is under test, not sharding).

Arms whose runs differ from a run arm's only in a model binding are not run again (--arms):
each arm's model and steps are checked from its gin files in test_study (the modifications'
activations and norms, the distillation's layers and steps, bert_ablations' `mlm`: `mlm_nsp`'s
run without the sentence head, whose loss on pairs test_layer_options checks), and each
activation and norm trains in test_layer_options. bert_ablations' `mlm_full` arm is
the same run as pretrain_vs_scratch's `pretrained` arm, run here."""
import json
import os

import pytest

from helpers.cli import run_t5lite
from t5lite.study import spec

TASK = "stdlib_docstring_module_head"


def _model_config(run) -> dict:
  return json.loads((run / "model_config.json").read_text())


def _modifications(out, results):
  """ReLU's 6 steps and SwiGLU's fewer (a third MLP matrix, at equal FLOPs), each with its
  activation."""
  for arm, activation in (("relu", "relu"), ("swiglu", "swiglu")):
    assert _model_config(out / arm / "seed0" / "pretrain")["mlp_activation"] == activation
  assert results["relu"]["pretrain_steps"] == 6 and 0 < results["swiglu"]["pretrain_steps"] < 6


def _distillation(out, results):
  """The distilled student (2 layers) starts from its 4-layer teacher's layers 0 and 2 and is
  scored by its MLM (hard) loss."""
  layers = {arm: _model_config(out / arm / "seed0" / "pretrain")["num_encoder_layers"]
            for arm in results}
  assert layers == {"teacher": 4, "distilled": 2}
  assert (out / "distilled" / "seed0" / "student_init" / ".complete").exists()
  assert "stdlib_mlm/distill_hard_loss" in results["distilled"]["pretrain_eval"]
  assert {figures["pretrain_steps"] for figures in results.values()} == {6}


def _bert_ablations(out, results):
  """MLM + NSP trained its sentence head on the pairs (the `mlm` arm, not run, is the same run
  without the head: test_study)."""
  assert _model_config(out / "mlm_nsp" / "seed0" / "pretrain")["sentence_classes"] == 2


def _no_more(out, results):
  pass


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("name, arms, check", [
    pytest.param(name, arms, check, id=name) for name, arms, check in (
        ("bert_ablations", "mlm_nsp,ltr", _bert_ablations), ("pretrain_vs_scratch", "", _no_more),
        ("modifications", "relu,swiglu", _modifications),
        ("distillation", "distilled", _distillation))])
def test_every_other_preset_runs_at_smoke_scale(name, arms, check, tmp_path):
  out = tmp_path / "study"
  done = run_t5lite("study", name, "--scale", "smoke", "--out", out, "--arms", arms,
                    devices=1, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  study = spec.get(name)
  chosen = study.only(tuple(arms.split(","))) if arms else study
  assert set(json.loads(done.stdout.strip().splitlines()[-1])["arms"]) == {
      arm.name for arm in chosen.arms}
  table = (out / "study.md").read_text()
  results = {}
  for arm in chosen.arms:
    results[arm.name] = json.loads((out / arm.name / "seed0" / "result.json").read_text())
    assert 0 <= results[arm.name]["downstream"][TASK] <= 100
    assert (results[arm.name]["pretrain_steps"] > 0) == bool(arm.pretraining), arm.name
    assert f"| {arm.label} |" in table
  assert results[study.reference.name]["pretrain_steps"] == 6
  assert sorted(os.listdir(out)) == sorted({"plan.json", "study.md", "study.json", "study.png",
                                            *results})  # no other arm ran
  check(out, results)
