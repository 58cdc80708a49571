"""Sequence-level knowledge distillation (t5lite.train.recipes.sequence_distillation): a task whose
targets are a teacher's beam-search outputs on another task's inputs, decoded once and cached.

The expected targets are computed apart from the module, by the evaluator's own decoding of
the source task (TaskEvaluator.predict: the same batches, t5lite.models.decoding.search.generate),
cut at the first EOS. A tiny random teacher is enough: beam search with the length penalty
ends its hypotheses at different lengths, so the EOS handling is exercised.
"""
import json
import math
import os

import jax
import numpy as np
import pytest

import train_tasks
from helpers import quiet, tiny, tiny_decoder_only, tiny_encoder_only, train_config
from t5lite.data import preprocessors as pp
from t5lite.train.recipes import sequence_distillation as sd
from t5lite.data.registry import TaskRegistry, add_task
from t5lite.data.sources.readers import FunctionSource
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError
from t5lite.eval import metrics
from t5lite.eval.evaluator import DecodeConfig, TaskEvaluator
from t5lite.interop.params_only import write_model_dir
from t5lite.families import family_of
from t5lite.families.base import Family

SOURCE = "sd_test_copy"
UNCUT = "sd_test_copy_uncut"  # EOS appended without a trim: inputs run past their length
LENGTHS = {"inputs": 48, "targets": 12}  # most documents are longer: inputs are cut
BATCH = 4  # 16 train examples: 4 batches; 6 validation examples: a full batch and a half one
BEAM = dict(num_beams=3, alpha=0.6)
VOCAB = train_tasks.VOCAB
EOS = VOCAB.eos_id


def _train_docs():
  return train_tasks.documents(16, 0)


def _validation_docs():
  return train_tasks.documents(6, 1)


@pytest.fixture(scope="module", autouse=True)
def source_tasks():
  sources = {"train": FunctionSource(_train_docs), "validation": FunctionSource(_validation_docs)}
  for name, eos in ((SOURCE, pp.append_eos_after_trim), (UNCUT, pp.append_eos)):
    TaskRegistry.remove(name)
    add_task(name, sources, train_tasks.FEATURES,
             [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, eos],
             metric_fns=[metrics.sequence_accuracy])
  yield
  for name in (SOURCE, UNCUT):
    TaskRegistry.remove(name)


def model_dir(path, config, seed=0, vocabulary=VOCAB, change=None):
  """A params-only MODEL_DIR of config with seed's params (change: fn(params) -> params)."""
  params = family_of(config).init_params(seed)
  params = change(params) if change else params
  write_model_dir(path, config, params, step=1, vocabulary=vocabulary)
  return str(path), params


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
  """(MODEL_DIR, config, params) of a tiny encoder-decoder teacher over the byte vocabulary."""
  config = tiny(vocab_size=384)
  path, params = model_dir(tmp_path_factory.mktemp("teacher") / "run", config)
  return path, config, params


@pytest.fixture
def register():
  """register(name, teacher, cache_dir, **settings) -> Task; unregistered after the test."""
  names = []

  def run(name, teacher_path, cache_dir, source=SOURCE, **settings):
    names.append(name)
    return sd.add_sequence_distillation_task(
        name, source, teacher_path, task_feature_lengths=LENGTHS,
        **{"batch_size": BATCH, "cache_dir": str(cache_dir), "log": quiet, **BEAM, **settings})
  yield run
  for name in names:
    TaskRegistry.remove(name)


def examples(task, split):
  return TaskEvaluator(task, split=split, feature_lengths=LENGTHS).examples


def expected(source, config, params, split, max_decode_length=None):
  """(source examples, teacher tokens before EOS) by the evaluator's decoding."""
  evaluator = TaskEvaluator(TaskRegistry.get(source), split=split, feature_lengths=LENGTHS)
  decode = DecodeConfig(method="beam", batch_size=BATCH, max_decode_length=max_decode_length,
                        **BEAM)
  rows = evaluator.predict(config, params, decode)
  return evaluator.examples, [row[:list(row).index(EOS)] if EOS in row else row for row in rows]


def check_targets(task, config, params, max_decode_length=None, source=SOURCE):
  """Asserts the task's examples are the source's inputs and the teacher's outputs; returns
  the teacher's tokens of both splits."""
  every = []
  for split in ("train", "validation"):
    source_examples, teacher_ids = expected(source, config, params, split, max_decode_length)
    got = examples(task, split)
    assert len(got) == len(source_examples) == {"train": 16, "validation": 6}[split]
    for ex, src, ids in zip(got, source_examples, teacher_ids):
      # The inputs the teacher saw: cut as the feature converter (and pad_rows) cut them.
      np.testing.assert_array_equal(ex["inputs"], src["inputs"][:LENGTHS["inputs"]])
      # Exactly one EOS, after the tokens that fit before it (append_eos_after_trim's cut).
      np.testing.assert_array_equal(ex["targets"],
                                    np.append(ids[:LENGTHS["targets"] - 1], EOS))
      assert ex["targets_pretokenized"] == VOCAB.decode(list(ids))
      assert ex["inputs_pretokenized"] == src["inputs_pretokenized"]
    every += teacher_ids
  return every


def test_targets_are_the_teachers_beam_search_outputs(teacher, register, tmp_path):
  path, config, params = teacher
  task = register("sd_targets", path, tmp_path)
  assert task.output_features == TaskRegistry.get(SOURCE).output_features
  assert task.metric_fns == TaskRegistry.get(SOURCE).metric_fns
  ids = check_targets(task, config, params)
  # Some hypotheses end early (their EOS cut off, then appended once), some run to the end.
  assert min(map(len, ids)) < LENGTHS["targets"] - 1 and max(map(len, ids)) == LENGTHS["targets"]
  # Some inputs were cut to their length (EOS kept last by the source's preprocessing).
  assert any(len(ex["inputs"]) == LENGTHS["inputs"] for ex in examples(task, "train"))


def test_an_unfinished_hypothesis_is_cut_and_ends_with_one_eos(teacher, register, tmp_path):
  path, config, params = teacher
  task = register("sd_short", path, tmp_path, max_decode_length=2)
  check_targets(task, config, params, max_decode_length=2)
  [manifest_file] = [os.path.join(tmp_path, d, "train.json") for d in os.listdir(tmp_path)]
  with open(manifest_file) as f:
    assert json.load(f)["truncated"] > 0


def test_the_cache_is_read_again_and_a_change_makes_a_new_entry(teacher, register, tmp_path,
                                                                monkeypatch):
  path, config, params = teacher
  calls = []
  generate = Family.generate

  def counting(self, *args, **kwargs):
    calls.append(kwargs)
    return generate(self, *args, **kwargs)
  monkeypatch.setattr(Family, "generate", counting)
  first = register("sd_cache_a", path, tmp_path)
  assert len(calls) == math.ceil(16 / BATCH) + math.ceil(6 / BATCH)
  assert {c["method"] for c in calls} == {"beam"} and {c["num_beams"] for c in calls} == {3}
  [entry] = os.listdir(tmp_path)
  with open(os.path.join(tmp_path, entry, "train.json")) as f:
    manifest = json.load(f)
  assert manifest["source_task"] == SOURCE and manifest["split"] == "train"
  assert manifest["task_feature_lengths"] == {"inputs": 48, "targets": 12}
  assert manifest["decoding"] == {"method": "beam", "num_beams": 3, "alpha": 0.6,
                                  "max_decode_length": 12}
  assert manifest["teacher"]["params_sha256"] == sd.params_digest(params)
  assert manifest["teacher"]["config"]["vocab_size"] == 384 and manifest["examples"] == 16

  calls.clear()
  second = register("sd_cache_b", path, tmp_path)
  assert calls == [] and os.listdir(tmp_path) == [entry]
  for split in ("train", "validation"):
    for a, b in zip(examples(first, split), examples(second, split), strict=True):
      np.testing.assert_array_equal(a["targets"], b["targets"])

  # An unfinished split (no manifest: a killed run) is decoded again, the other one is not.
  os.remove(os.path.join(tmp_path, entry, "validation.json"))
  register("sd_cache_c", path, tmp_path)
  assert len(calls) == math.ceil(6 / BATCH) and os.listdir(tmp_path) == [entry]

  calls.clear()
  register("sd_cache_d", path, tmp_path, num_beams=2)
  assert len(calls) == 6 and {c["num_beams"] for c in calls} == {2}
  assert len(os.listdir(tmp_path)) == 2

  # Another teacher: one parameter changed by a little.
  def nudge(p):
    return jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1e-3), p)
  other, _ = model_dir(tmp_path.parent / "other_teacher", config, change=nudge)
  calls.clear()
  register("sd_cache_e", other, tmp_path)
  assert len(calls) == 6 and len(os.listdir(tmp_path)) == 3


def test_params_digest_sees_a_swap_that_sums_miss():
  a = {"w": np.array([1.0, 2.0], np.float32)}
  assert sd.params_digest(a) == sd.params_digest({"w": np.array([1.0, 2.0], np.float32)})
  assert sd.params_digest(a) != sd.params_digest({"w": np.array([2.0, 1.0], np.float32)})


def test_a_student_trains_on_the_distilled_task(teacher, register, tmp_path):
  from t5lite.train.trainer import train
  path, _, _ = teacher
  register("sd_student", path, tmp_path / "cache")
  result = train(tiny(vocab_size=384), train_config(
      tmp_path / "student", mixture_or_task_name="sd_student", task_feature_lengths=LENGTHS,
      train_steps=2, batch_size=8), log=quiet)
  assert result.step == 2
  assert result.losses and all(np.isfinite(v) and v > 0 for v in result.losses.values())


def test_a_decoder_only_teacher_continues_the_inputs(register, tmp_path):
  config = tiny_decoder_only(prefix_lm=True)
  path, params = model_dir(tmp_path / "teacher", config)
  assert family_of(config).continues_prompts
  task = register("sd_decoder_only", path, tmp_path / "cache", source=UNCUT, max_decode_length=6)
  check_targets(task, config, params, max_decode_length=6, source=UNCUT)
  # The source's inputs ran past their length; the prompts were cut (their EOS too).
  long = [ex for ex in examples(TaskRegistry.get(UNCUT), "train") if len(ex["inputs"]) > 48]
  assert long and all(ex["inputs"][-1] == EOS for ex in long)


def test_an_hf_directory_teacher(teacher, register, tmp_path):
  import t5lite
  path, config, params = teacher
  t5lite.save_hf(config, params, str(tmp_path / "hf"))
  task = register("sd_hf", tmp_path / "hf", tmp_path / "cache")
  check_targets(task, config, params)
  [entry] = os.listdir(tmp_path / "cache")
  with open(tmp_path / "cache" / entry / "train.json") as f:
    assert json.load(f)["teacher_path"] == str(tmp_path / "hf")


# --- bad input: refused before the teacher's params are read -----------------------------

@pytest.fixture
def no_params_read(monkeypatch):
  from t5lite.runtime import model_dir as model_dir_lib

  def refuse(*args, **kwargs):
    raise AssertionError("the teacher's params were read")
  monkeypatch.setattr(model_dir_lib, "load_params", refuse)


def test_a_teacher_with_another_vocab_size_is_refused(register, tmp_path, no_params_read):
  path, _ = model_dir(tmp_path / "small", tiny())  # vocab_size 128 < the byte vocabulary's 359
  with pytest.raises(ConfigError, match=r"vocab_size 128.*has 359 ids"):
    register("sd_bad", path, tmp_path)
  path, _ = model_dir(tmp_path / "other", tiny(vocab_size=384),
                      vocabulary=ByteVocabulary(extra_ids=10))
  with pytest.raises(ConfigError, match="another vocabulary"):
    register("sd_bad", path, tmp_path)


def test_a_teacher_without_decoder_is_refused(register, tmp_path, no_params_read):
  path, _ = model_dir(tmp_path / "bert", tiny_encoder_only())
  with pytest.raises(ConfigError, match="'encoder_only' model: it has no decoder"):
    register("sd_bad", path, tmp_path)


def test_bad_source_task_teacher_path_and_name(teacher, register, tmp_path, no_params_read):
  path = teacher[0]
  with pytest.raises(ConfigError, match="unknown task 'sd_test_cpy'; closest: sd_test_copy"):
    sd.add_sequence_distillation_task("sd_bad", "sd_test_cpy", path,
                                      task_feature_lengths=LENGTHS)
  with pytest.raises(ConfigError, match="'train_test_lm' has no inputs feature"):
    sd.add_sequence_distillation_task("sd_bad", "train_test_lm", path,
                                      task_feature_lengths=LENGTHS)
  with pytest.raises(ConfigError, match="neither a t5lite MODEL_DIR .* nor an HF model directory"):
    register("sd_bad", tmp_path / "nothing", tmp_path)
  with pytest.raises(ConfigError, match="'sd_test_copy' is already registered"):
    register(SOURCE, path, tmp_path)
  with pytest.raises(ConfigError, match=r"splits \['test'\]"):
    register("sd_bad", path, tmp_path, splits=("test",))
  with pytest.raises(ConfigError, match="method='sample'"):
    register("sd_bad", path, tmp_path, method="sample")
  assert "sd_bad" not in TaskRegistry.names() and not os.listdir(tmp_path)
