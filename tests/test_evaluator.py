"""seqio-style evaluation: examples, postprocessing, predict and score metrics, JSON output.

The decoding itself is tested in test_decoding.py; here generate and score are stand-ins
with known outputs, so the numbers each metric must produce are known exactly.
"""
import numpy as np
import pytest

import train_tasks
from helpers import tiny_decoder_only
from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, TaskRegistry, add_task
from t5lite.eval import metrics
from t5lite.eval.evaluator import DecodeConfig, TaskEvaluator, metric_kind, pad_rows

LENGTHS = {"inputs": 256, "targets": 256}  # longer than any document: nothing is cut


def upper_target(text, example=None, is_target=False):
  """Targets upper-cased, predictions as they are: only an identical text scores."""
  return text.upper() if is_target else text


@pytest.fixture(scope="module")
def task():
  TaskRegistry.remove("eval_test_copy")
  yield add_task("eval_test_copy", train_tasks.SOURCES, train_tasks.FEATURES,
                 [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, CACHE_POINT,
                  pp.append_eos_after_trim],
                 postprocess_fn=upper_target,
                 metric_fns=[metrics.sequence_accuracy, metrics.mean_log_likelihood])
  TaskRegistry.remove("eval_test_copy")


def copy_upper(config, params, inputs, *, max_decode_length, **kwargs):
  """A 'model' that outputs its input upper-cased for even rows, lower-cased for odd rows."""
  vocab = train_tasks.VOCAB
  out = np.zeros((inputs.shape[0], max_decode_length), np.int32)
  for i, row in enumerate(inputs):
    text = vocab.decode(row.tolist())
    ids = np.append(vocab.encode(text.upper() if i % 2 == 0 else text), 1)
    out[i, :len(ids)] = ids[:max_decode_length]
  return out


def fixed_scores(config, params, inputs, targets):
  return -np.arange(inputs.shape[0], dtype=np.float32)


def test_pad_rows():
  np.testing.assert_array_equal(pad_rows([[5, 1], [7, 8, 1]], 4, 3),
                                [[5, 1, 0, 0], [7, 8, 1, 0], [0, 0, 0, 0]])


def test_metric_kinds_follow_seqio_parameter_names():
  assert metric_kind(metrics.rouge) == "predict"
  assert metric_kind(metrics.mean_log_likelihood) == "score"
  with pytest.raises(ValueError, match="takes neither `predictions` nor `scores`"):
    metric_kind(lambda a, b: {})


def test_predict_and_score_metrics_with_known_outputs(task):
  evaluator = TaskEvaluator(task, split="validation", feature_lengths=LENGTHS, max_examples=10)
  assert len(evaluator.examples) == 10
  assert evaluator.targets[0] == train_tasks.documents(64, 1)[0]["text"].upper()
  # Batches of 4: [0..3] [4..7] [8, 9]; even rows within each batch are upper-cased.
  result = evaluator.evaluate(None, None, DecodeConfig(batch_size=4), generate_fn=copy_upper,
                              score_fn=fixed_scores)
  hits = [i % 4 % 2 == 0 for i in range(10)]
  assert result.metrics["sequence_accuracy"] == pytest.approx(100 * np.mean(hits))
  scores = [-(i % 4) for i in range(10)]
  assert result.metrics["mean_log_likelihood"] == pytest.approx(np.mean(scores))
  first = result.predictions[0]
  assert first["inputs"] == train_tasks.documents(64, 1)[0]["text"]
  assert first["prediction"] == first["target"] and first["score"] == 0.0
  assert result.predictions[1]["prediction"] != result.predictions[1]["target"]


def test_decode_length_defaults_to_the_targets_length(task):
  seen = {}

  def spy(config, params, inputs, *, max_decode_length, **kwargs):
    seen.update(max_decode_length=max_decode_length, shape=inputs.shape, **kwargs)
    return copy_upper(config, params, inputs, max_decode_length=max_decode_length)

  evaluator = TaskEvaluator(task, split="validation", feature_lengths=LENGTHS, max_examples=3)
  evaluator.predict(None, None, DecodeConfig(batch_size=8, method="beam", num_beams=2), spy)
  assert seen["max_decode_length"] == 256 and seen["shape"] == (8, 256)  # padded batch
  assert seen["method"] == "beam" and seen["num_beams"] == 2


def test_few_shot_prompts_and_metrics(task):
  from t5lite.eval.few_shot import FewShotConfig, build_prompts, few_shot_evaluate
  config = FewShotConfig(k=2, seed=3)
  prompts, examples = build_prompts(task, config, max_examples=4)
  train_texts = {d["text"] for d in train_tasks.documents(256, 0)}
  for prompt, example in zip(prompts, examples):
    lines = prompt.split("\n")
    assert len(lines) == 3 and lines[2] == f"{example['inputs_pretokenized']} =>"
    for line in lines[:2]:  # "text => text" from the train split
      source, target = line.split(" => ")
      assert source == target and source in train_texts
  assert build_prompts(task, config, max_examples=4)[0] == prompts  # seeded
  assert build_prompts(task, FewShotConfig(k=2, seed=4), max_examples=4)[0] != prompts

  def answer(config_, params, inputs, *, max_decode_length, **kwargs):
    """Continues each prompt with the right answer for even rows, then a next 'example'."""
    vocab = train_tasks.VOCAB
    out = np.zeros((inputs.shape[0], max_decode_length), np.int32)
    for i, row in enumerate(inputs):
      query = vocab.decode(row.tolist()).split("\n")[-1][:-len(" =>")]
      text = (" " + query.upper() if i % 2 == 0 else " wrong") + "\nmore => text"
      ids = np.append(vocab.encode(text), 1)[:max_decode_length]
      out[i, :len(ids)] = ids
    return out

  decoder_only = tiny_decoder_only()
  result = few_shot_evaluate(decoder_only, None, task, config, prompt_length=1024,
                             decode=DecodeConfig(batch_size=4, max_decode_length=256),
                             max_examples=4, generate_fn=answer)
  assert result.metrics == {"sequence_accuracy": 50.0}  # score metrics are left out
  assert result.predictions[0]["prediction"] == result.predictions[0]["target"]


def test_few_shot_runs_a_real_decoder_only_model(task):
  """The real t5lite.generate behind it: outputs are text, metrics in range (no accuracy
  claim for an untrained model)."""
  from t5lite.eval.few_shot import FewShotConfig, few_shot_evaluate
  from t5lite.models import init_params
  model = tiny_decoder_only()
  result = few_shot_evaluate(model, init_params(model, 0), task, FewShotConfig(k=1),
                             prompt_length=256, decode=DecodeConfig(batch_size=4,
                                                                    max_decode_length=8),
                             max_examples=4)
  assert 0.0 <= result.metrics["sequence_accuracy"] <= 100.0
  assert len(result.predictions) == 4
  assert all(isinstance(r["prediction_text"], str) for r in result.predictions)
