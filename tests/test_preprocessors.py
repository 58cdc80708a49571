"""Preprocessors (worked examples and fuzzing) and the task/mixture registry."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t5lite.data import preprocessors as pp
from t5lite.data.registry import (Feature, Mixture, MixtureRegistry, Task, TaskRegistry,
                                  add_mixture, add_task, get_mixture_or_task, rate_num_examples)
from t5lite.data.sources.readers import FunctionSource
from t5lite.data.vocab.vocabularies import ByteVocabulary

VOCAB = ByteVocabulary()
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}


def test_worked_examples():
  assert pp.rekey({"inputs": None, "targets": "text"})({"text": "hi", "id": 3}) == \
      {"inputs": "", "targets": "hi"}
  ex = pp.tokenize({"targets": "hi"}, output_features=FEATURES)
  assert ex["targets"].tolist() == [107, 108] and ex["targets_pretokenized"] == "hi"
  assert pp.append_eos({"targets": np.array([5, 6])}, FEATURES)["targets"].tolist() == [5, 6, 1]
  assert pp.trim({"targets": np.array([5, 6, 7])}, {"targets": 2})["targets"].tolist() == [5, 6]
  out = pp.append_eos_after_trim({"targets": np.array([5, 6, 7, 8])}, FEATURES, {"targets": 3})
  assert out["targets"].tolist() == [5, 6, 1]
  assert pp.filter_empty({"inputs": "", "targets": ""}, FEATURES) is None
  assert pp.filter_empty({"inputs": "", "targets": "a"}, FEATURES) is not None
  with pytest.raises(KeyError, match="rekey: example has no \\['body'\\]"):
    pp.rekey({"targets": "body"})({"text": "x"})


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=3000), length=st.integers(1, 600))
def test_tokenize_trim_and_eos_on_arbitrary_text(text, length):
  """Any unicode (empty, very long): tokens decode back, EOS survives trimming, lengths hold."""
  ex = pp.tokenize({"inputs": text, "targets": text}, output_features=FEATURES)
  assert VOCAB.decode(ex["targets"].tolist()) == text
  out = pp.append_eos_after_trim(ex, FEATURES, {"inputs": length, "targets": length})
  for name in ("inputs", "targets"):
    tokens = out[name]
    assert tokens.dtype == np.int32 and tokens[-1] == 1
    assert len(tokens) == min(len(ex[name]) + 1, length)
    assert tokens[:-1].tolist() == ex[name][:length - 1].tolist()
  assert (pp.filter_empty(ex, FEATURES) is None) == (text == "")


def _source():
  return [{"text": f"example {i}"} for i in range(10)]


@pytest.fixture
def clean_registry():
  before = (dict(TaskRegistry._registry), dict(MixtureRegistry._registry))
  yield
  TaskRegistry._registry.clear()
  TaskRegistry._registry.update(before[0])
  MixtureRegistry._registry.clear()
  MixtureRegistry._registry.update(before[1])


class RecordingVocabulary(ByteVocabulary):
  """ByT5's vocabulary, noting the longest text it was asked to encode."""
  longest = 0

  def encode(self, s):
    RecordingVocabulary.longest = max(RecordingVocabulary.longest, len(s))
    return super().encode(s)


def _run(steps, rows, lengths):
  import grain
  vocab = RecordingVocabulary()
  task = Task("limits_probe", FunctionSource(lambda: rows),
              {"inputs": Feature(vocab), "targets": Feature(vocab)}, steps)
  RecordingVocabulary.longest = 0
  ds = grain.MapDataset.source(rows).to_iter_dataset()
  return list(pp.apply_preprocessors(ds, task, list(enumerate(task.preprocessors)),
                                     sequence_length=lengths, seed=0))


def test_enormous_rows_are_cut_before_tokenizing_and_yield_the_same_examples():
  """A 3 MB line costs what a long one does: only what the later steps can keep is encoded,
  and the examples are those of the whole text (the pretokenized copy stays whole)."""
  huge = "word " * 600_000 + "tail"
  rows = [{"inputs": huge, "targets": "short one"}, {"inputs": "x", "targets": huge}]
  lengths = {"inputs": 64, "targets": 7}
  out = _run([pp.tokenize, pp.append_eos_after_trim], rows, lengths)
  assert RecordingVocabulary.longest == pp.CHARS_PER_TOKEN * 64 < len(huge)
  for got, row in zip(out, rows):
    for name, length in lengths.items():
      whole = VOCAB.encode(row[name])[:length - 1].tolist() + [1]
      assert got[name].tolist() == whole
      assert got[f"{name}_pretokenized"] == row[name]
  # A chain that keeps more than the feature length (T5's span corruption draws a chunk of up
  # to 65,536 tokens per document) keeps that much; without lengths (a cache), the same.
  keeps_all = pp.stream_preprocessor(lambda ds: ds)
  out = _run([pp.tokenize, keeps_all], rows, lengths)
  assert RecordingVocabulary.longest == pp.CHARS_PER_TOKEN * pp.DOCUMENT_TOKENS < len(huge)
  assert out[1]["targets"].tolist() == VOCAB.encode(huge[:RecordingVocabulary.longest]).tolist()
  assert pp.text_limits([pp.trim], FEATURES, None) == {
      name: pp.CHARS_PER_TOKEN * pp.DOCUMENT_TOKENS for name in FEATURES}
  assert pp.text_limits([pp.trim], FEATURES, {"targets": 10**6})["targets"] == 32 * 10**6
  ordinary = [{"inputs": "a" * 500, "targets": "b" * 3000}]
  _run([pp.tokenize, pp.trim], ordinary, {"inputs": 512, "targets": 512})
  assert RecordingVocabulary.longest == 3000  # ordinary rows are never cut


def test_text_the_vocabulary_mostly_drops_is_encoded_until_enough_tokens_are_there():
  """20,000 characters that give no tokens, then words: the cut at 32 x 64 characters would
  hold none of the kept tokens, so more is encoded until they are there."""
  import inspect
  import json
  from t5lite.data.vocab.hf_training import train_wordpiece
  text = [" ".join(inspect.getdoc(json).split())]
  vocab = train_wordpiece(text * 3, 300)
  features = {"inputs": Feature(vocab)}
  row = " " * 20_000 + text[0] * 20  # BERT's pre-tokenizer makes no token of spaces
  limits = pp.text_limits([pp.trim], features, {"inputs": 64})
  assert limits == {"inputs": 2048} and len(vocab.encode(row[:2048])) == 0
  out = pp.trim(pp.tokenize({"inputs": row}, features, text_limits=limits), {"inputs": 64})
  assert out["inputs"].tolist() == vocab.encode(row)[:64].tolist()
  assert len(out["inputs"]) == 64


@pytest.mark.parametrize("name", ["../evil", "a/b", "", "x..y", "-lead", "sp ace"])
def test_invalid_names_are_rejected(name):
  with pytest.raises(ValueError, match="invalid task name"):
    Task(name, {"train": []}, FEATURES)


def test_duplicates_and_unknown_names(clean_registry):
  add_task("reg_glue_cola", {"train": FunctionSource(_source)}, FEATURES)
  with pytest.raises(ValueError, match="already registered"):
    add_task("reg_glue_cola", {"train": FunctionSource(_source)}, FEATURES)
  with pytest.raises(ValueError, match="already registered"):
    add_mixture("reg_glue_cola", ["reg_glue_cola"], default_rate=1.0)
  with pytest.raises(KeyError, match="closest: reg_glue_cola"):
    TaskRegistry.get("reg_glue_cloa")
  with pytest.raises(KeyError, match="closest: reg_glue_cola"):
    get_mixture_or_task("reg_glue_col")
  with pytest.raises(ValueError, match="no split 'test'; splits: \\['train'\\]"):
    TaskRegistry.get("reg_glue_cola").get_source("test")


def test_mixture_rates_and_nested_mixtures(clean_registry):
  add_task("reg_a", {"train": FunctionSource(_source)}, FEATURES)
  add_task("reg_b", {"train": FunctionSource(lambda: _source()[:5])}, FEATURES)
  add_mixture("reg_ab", [("reg_a", rate_num_examples), ("reg_b", rate_num_examples)])
  rates = {t.name: r for t, r in MixtureRegistry.get("reg_ab").task_rates()}
  assert rates == {"reg_a": 10.0, "reg_b": 5.0}
  add_mixture("reg_outer", [("reg_ab", 1.0), ("reg_a", 1.0)])
  rates = [(t.name, round(r, 6)) for t, r in MixtureRegistry.get("reg_outer").task_rates()]
  assert rates == [("reg_a", 0.666667), ("reg_b", 0.333333), ("reg_a", 1.0)]
  with pytest.raises(ValueError, match="no rate and no default_rate"):
    Mixture("reg_bad", ["reg_a"]).task_rates()


# T5's multi-task mixing (the paper's Section 3.5.2) over a C4-sized unsupervised task and five
# GLUE training sets (MNLI, QQP, SST-2, CoLA, RTE): docs/tasks.md shows these rates.
T5_SIZES = {"reg_c4": 2**24, "reg_mnli": 392_702, "reg_qqp": 363_846, "reg_sst2": 67_349,
            "reg_cola": 8_551, "reg_rte": 2_490}


@pytest.mark.parametrize("maximum, temperature, scale, shown", [
    (None, 1.0, 1.0, [95.26, 2.23, 2.07, 0.38, 0.05, 0.01]),
    (2**21, 1.0, 1.0, [71.52, 13.39, 12.41, 2.30, 0.29, 0.08]),
    (2**21, 2.0, 1.0, [47.02, 20.35, 19.58, 8.43, 3.00, 1.62]),
    (2**21, 8.0, 1.0, [23.82, 19.32, 19.13, 15.50, 11.97, 10.26]),
    (2**19, 3.0, 7.5, None)])  # scale before the clip, as seqio: 7.5 * RTE's 2,490 < 2**19
def test_mixture_temperature_gives_seqio_rates(clean_registry, maximum, temperature, scale,
                                               shown):
  """seqio.mixing_rate_num_examples, re-derived: n * scale, clipped at maximum, to 1 / T."""
  import functools
  for name, n in T5_SIZES.items():
    add_task(name, {"train": range(n)}, FEATURES)
  rate = functools.partial(rate_num_examples, maximum=maximum, temperature=temperature,
                           scale=scale)
  add_mixture("reg_t5_mix", [(name, rate) for name in T5_SIZES])
  got = np.array([r for _, r in MixtureRegistry.get("reg_t5_mix").task_rates()])
  n = np.array(list(T5_SIZES.values()), np.float64) * scale
  want = (np.minimum(n, maximum) if maximum else n) ** (1.0 / temperature)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  np.testing.assert_allclose(got / got.sum(), want / want.sum(), atol=1e-6)
  if shown is not None:
    np.testing.assert_allclose(100 * got / got.sum(), shown, atol=0.005)
  with pytest.raises(ValueError, match="temperature 0 must be > 0"):
    rate_num_examples(TaskRegistry.get("reg_rte"), temperature=0)
