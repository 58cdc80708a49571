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
