"""`t5lite study t5_objectives`' own rows end to end, apart from tests/test_study.py so that
another worker runs them (each module is one unit of the suite's schedule); its runs on one
fake device, as test_study's."""
import dataclasses

import pytest

from helpers import checkpoint_params
from helpers.cli import environment
from t5lite.study import runner, spec


@pytest.mark.e2e
@pytest.mark.slow
def test_t5_objectives_rows_pretrain_and_finetune_text_to_text_at_smoke_scale(
    tmp_path, monkeypatch):
  """The rows t5_objectives brought (a shared encoder-decoder, half the layers from the
  scale's arm bindings, a causal decoder on whole spans and then on a text-to-text task, a
  prefix LM on span corruption), each pretrained and finetuned at smoke scale and scored by
  ROUGE on decoded summaries. (The whole preset at smoke scale takes 20 runs.)"""
  full = spec.get("t5_objectives")
  names = ("shared_denoising", "half_LM", "lm_LM", "prefix_denoising")
  tiny = full.scales["tiny"]
  study = dataclasses.replace(
      full, name="t5_objectives_rows", arms=tuple(full.arm(n) for n in names),
      orderings=(), scales={"tiny": dataclasses.replace(tiny, arm_bindings=tuple(
          (n, b) for n, b in tiny.arm_bindings if n in names))})
  monkeypatch.setenv("XLA_FLAGS", environment(devices=1)["XLA_FLAGS"])  # the runs' subprocesses
  results = runner.run(study, "smoke", 1, str(tmp_path), say=lambda _: None)
  for name in names:
    figures = results[name][0]
    assert figures["pretrain_steps"] == 6 and figures["pretrain_eval"], name
    assert 0 <= figures["downstream"]["stdlib_docstring_summary"] <= 100, name
  model = {n: checkpoint_params(tmp_path / n / "seed0" / "pretrain")[0] for n in names}
  assert model["shared_denoising"].shared_encoder_decoder
  assert (model["half_LM"].num_encoder_layers, model["half_LM"].num_decoder_layers) == (1, 1)
  assert model["lm_LM"].architecture == "decoder_only" and not model["lm_LM"].prefix_lm
  assert model["prefix_denoising"].prefix_lm
