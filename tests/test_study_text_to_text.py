"""`t5lite study t5_objectives`' own rows end to end, apart from tests/test_study.py so that
another worker runs them (each module is one unit of the suite's schedule); its runs on one
fake device, as test_study's. Their MODEL_DIRs then serve `t5lite infer`'s prompts: a causal
LM finetuned text to text is prompted as its task's pipeline fed it (inputs + EOS)."""
import json

import numpy as np
import pytest

import t5lite_tasks  # noqa: F401 (registers the tasks)
from helpers import checkpoint_params
from helpers.cli import environment
from t5lite.data.describe import preprocessed_examples
from t5lite.data.registry import get_mixture_or_task
from t5lite.eval import run
from t5lite.eval.evaluator import DecodeConfig
from t5lite.models.decoding import search
from t5lite.study import runner, spec


@pytest.mark.e2e
@pytest.mark.slow
def test_t5_objectives_rows_pretrain_and_finetune_text_to_text_at_smoke_scale(
    tmp_path, monkeypatch):
  """The rows t5_objectives brought (a shared encoder-decoder, a causal decoder on whole
  spans and then on a text-to-text task, a prefix LM on span corruption), each pretrained and
  finetuned at smoke scale and scored by ROUGE on decoded summaries. (The whole preset at
  smoke scale takes 20 runs. The half arms' runs differ from the encoder-decoder's in their
  layers only, from the scale's arm bindings: test_study checks what their runs are given.)"""
  names = ("shared_denoising", "lm_LM", "prefix_denoising")
  monkeypatch.setenv("XLA_FLAGS", environment(devices=1)["XLA_FLAGS"])  # the runs' subprocesses
  results = runner.run(spec.get("t5_objectives"), "smoke", 1, str(tmp_path),
                       say=lambda _: None, arms=names)
  assert set(results) == set(names)
  for name in names:
    figures = results[name][0]
    assert figures["pretrain_steps"] == 6 and figures["pretrain_eval"], name
    assert 0 <= figures["downstream"]["stdlib_docstring_summary"] <= 100, name
  model = {n: checkpoint_params(tmp_path / n / "seed0" / "pretrain")[0] for n in names}
  assert model["shared_denoising"].shared_encoder_decoder
  assert model["lm_LM"].architecture == "decoder_only" and not model["lm_LM"].prefix_lm
  assert model["prefix_denoising"].prefix_lm

  _check_infer_prompts(tmp_path, monkeypatch)


def _check_infer_prompts(out, monkeypatch):
  """`t5lite infer` ends a prompt with EOS where the model's training did: always for the
  encoder-decoder and the prefix LM; for the causal LM after its text-to-text finetuning
  (task.json: inputs and targets), not after its LM pretraining (targets only), where a
  prompt is a document to continue. The finetuned model's prompts equal its task's inputs."""
  task = "stdlib_docstring_summary"
  runs = {(arm, stage): out / arm / "seed0" / (f"finetune_{task}" if stage else "pretrain")
          for arm in ("shared_denoising", "lm_LM", "prefix_denoising") for stage in (0, 1)}
  lengths = {key: set(json.loads((path / "task.json").read_text())["task_feature_lengths"])
             for key, path in runs.items()}
  assert lengths[("lm_LM", 0)] == {"targets"} and lengths[("lm_LM", 1)] == {"inputs", "targets"}
  for (arm, stage), path in runs.items():
    config = checkpoint_params(path)[0]
    expected = arm != "lm_LM" or stage == 1
    assert run.prompt_ends_with_eos(run.InferConfig(str(path)), config, str(path)) == expected
    assert not run.prompt_ends_with_eos(run.InferConfig(str(path), prompt_eos=False), config,
                                        str(path))

  examples = [e for e in preprocessed_examples(get_mixture_or_task(task), "validation",
                                                {"inputs": 256, "targets": 32}, 6)
              if len(e["inputs"]) < 256][:2]  # whole texts (cut, the prompts differ by more)
  (out / "prompts.jsonl").write_text("".join(
      json.dumps({"inputs": e["inputs_pretokenized"]}) + "\n" for e in examples))
  seen = []
  real_generate = search.generate

  def recording(config, params, inputs, **kwargs):
    seen.append(np.asarray(inputs))
    return real_generate(config, params, inputs, **kwargs)

  monkeypatch.setattr(search, "generate", recording)
  for stage in (1, 0):
    assert run.infer(run.InferConfig(
        str(runs[("lm_LM", stage)]), str(out / "prompts.jsonl"), str(out / "predictions.jsonl"),
        inputs_length=256, decode=DecodeConfig(batch_size=2, max_decode_length=2))) == 2
  for example, finetuned, pretrained in zip(examples, seen[0], seen[1]):
    given = example["inputs"]  # the pipeline's: the text's ids, then EOS
    np.testing.assert_array_equal(finetuned[:len(given)], given)
    np.testing.assert_array_equal(pretrained[:len(given) - 1], given[:-1])
    assert not finetuned[len(given):].any() and not pretrained[len(given) - 1:].any()
