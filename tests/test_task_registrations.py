"""Registered tasks (tasks/, imported as t5lite_tasks): T5's exact text formats, label
round trips through postprocess_fn, metric values, and where each task reads its data.

Examples are preprocessed by hand, step by step (CACHE_POINT skipped, the injected kwargs
passed where a step declares them), on tiny fake data written to tmp dirs: nothing here
reads TFDS or downloads anything.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pickle
import struct
import subprocess
import sys

import grain
import numpy as np
import pytest

import t5lite_tasks
from t5lite_tasks import c4, glue, squad, vocab
from t5lite.data import preprocessors as pp
from t5lite.data.sources.crc32c import masked_crc32c
from t5lite.data.registry import CACHE_POINT, Feature, MixtureRegistry, TaskRegistry
from t5lite.data.sources.readers import JsonlSource, TfdsSource, TsvSource
from t5lite.data.sources.streams import JsonlStream
from t5lite.data.sources.tfrecord import ArrayRecordSource, convert_tfrecord_to_array_record
from t5lite.data.sources.tfrecord_example import make_example
from t5lite.data.vocab.vocabularies import (ByteVocabulary, SentencePieceVocabulary,
                                            train_sentencepiece)

LENGTHS = {"inputs": 64, "targets": 16}
ENV_VARS = ("T5LITE_VOCAB", "T5LITE_LOCAL_DATA_DIR", "T5LITE_TFDS_DATA_DIR", "T5LITE_C4_JSON",
            "T5LITE_C4_ARRAY_RECORD")
FAKE_TEXT = ["The quick brown fox jumps over the lazy dog near the river bank.",
             "Rain fell all day and the roads of the old city were closed.",
             "Who won the game? The home team won it in the last minute."]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
  for name in ENV_VARS:
    monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def sp_vocab() -> SentencePieceVocabulary:
  return SentencePieceVocabulary(train_sentencepiece(FAKE_TEXT * 10, 300), extra_ids=10)


def with_vocab(name: str, vocabulary=None):
  """The registered task, with a tiny vocabulary instead of T5's (which needs a file)."""
  task = TaskRegistry.get(name)
  vocabulary = vocabulary or ByteVocabulary()
  features = {k: Feature(vocabulary, f.add_eos, f.required)
              for k, f in task.output_features.items()}
  return dataclasses.replace(task, output_features=features)


def preprocess(task, examples, lengths=LENGTHS, until=None) -> list[dict]:
  """Applies task.preprocessors[:until] in order, by hand, to a list of raw examples."""
  injected = {"output_features": task.output_features, "sequence_length": lengths}
  for i, fn in enumerate(task.preprocessors[:until]):
    if fn is CACHE_POINT:
      continue
    kwargs = {k: v for k, v in injected.items() if k in pp.wanted_kwargs(fn)}
    if "rng" in pp.wanted_kwargs(fn):
      kwargs["rng"] = np.random.default_rng(i)
    if "seed" in pp.wanted_kwargs(fn):
      kwargs["seed"] = i
    if pp.is_stream(fn):
      examples = list(fn(grain.MapDataset.source(examples).to_iter_dataset(), **kwargs))
    else:
      examples = [out for out in (fn(dict(ex), **kwargs) for ex in examples) if out is not None]
  return examples


def text_of(name: str, example: dict) -> tuple[str, str]:
  """(inputs, targets) text after the task's text-to-text step (before tokenize)."""
  task = TaskRegistry.get(name)
  (out,) = preprocess(task, [example], until=task.preprocessors.index(pp.tokenize))
  return out["inputs"], out["targets"]


# ------------------------------------------------------------------ registration

def test_import_registers_without_env_or_files():
  """A fresh interpreter with no T5LITE_* variables registers everything, opening no file."""
  script = """
import builtins, gzip, mmap, sys
import t5lite.data.sources.readers, t5lite.data.sources.tfrecord
import t5lite.data.objectives.chains, t5lite.eval.metrics
def refuse(*args, **kwargs):
  raise AssertionError(f"registration opened a file: {args[:1]}")
builtins.open = gzip.open = mmap.mmap = refuse
import t5lite_tasks
from t5lite.data.registry import TaskRegistry, MixtureRegistry
from t5lite_tasks import vocab
assert vocab.default_vocabulary()._vocab is None
assert "tensorflow_datasets" not in sys.modules
print(" ".join(TaskRegistry.names() + MixtureRegistry.names()))
"""
  env = {k: v for k, v in os.environ.items() if not k.startswith("T5LITE_")}
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  names = set(out.stdout.split())
  assert {"c4_span_corruption", "glue_cola_v002", "super_glue_record_v102", "squad_v010_allanswers",
          "cnn_dailymail_v002", "wmt_t2t_ende_v003", "glue_v002_proportional"} <= names


def test_registered_names():
  names = set(TaskRegistry.names())
  expected = {"c4_span_corruption", "c4_lm", "cnn_dailymail_v002", "squad_v010_allanswers",
              "wmt_t2t_ende_v003", "wmt14_ende_v003", "wmt16_enro_v003",
              "super_glue_wsc_v102_simple_train", "super_glue_wsc_v102_simple_eval"}
  expected |= {f"glue_{c}_v002" for c in ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli",
                                          "mnli_matched", "mnli_mismatched", "qnli", "rte",
                                          "wnli", "ax")}
  expected |= {f"super_glue_{c}_v102" for c in ("boolq", "cb", "copa", "multirc", "record",
                                                "rte", "wic", "axb", "axg")}
  assert expected <= names
  assert {"glue_v002_proportional", "super_glue_v102_proportional"} <= set(MixtureRegistry.names())


def test_default_vocabulary_is_lazy_and_says_how_to_set_it(tmp_path, monkeypatch, sp_vocab):
  lazy = vocab.LazyVocabulary()
  with pytest.raises(RuntimeError, match="T5LITE_VOCAB is unset.*export T5LITE_VOCAB="):
    lazy.encode("hi")
  model = tmp_path / "spiece.model"
  model.write_bytes(sp_vocab.serialized_model)
  monkeypatch.setenv("T5LITE_VOCAB", str(model))
  assert lazy.vocab_size == 300 + 100  # T5's 100 extra ids
  assert lazy.extra_id(0) == 399
  np.testing.assert_array_equal(lazy.encode("the fox"), sp_vocab.encode("the fox"))
  assert lazy.decode(lazy.encode("the fox")) == "the fox"
  assert lazy == SentencePieceVocabulary(model)
  clone = pickle.loads(pickle.dumps(lazy))
  assert clone._vocab is None and clone.vocab_size == 400
  monkeypatch.setenv("T5LITE_VOCAB", str(tmp_path))  # a directory holding spiece.model
  assert vocab.LazyVocabulary().vocab_size == 400
  monkeypatch.setenv("T5LITE_VOCAB", str(tmp_path / "missing.model"))
  with pytest.raises(FileNotFoundError, match="missing.model"):
    vocab.LazyVocabulary().vocab_size


# ------------------------------------------------------------------ GLUE / SuperGLUE formats

GLUE_CASES = [
    ("glue_cola_v002", {"sentence": "He left.", "label": 1, "idx": 0},
     "cola sentence: He left.", "acceptable"),
    ("glue_sst2_v002", {"sentence": "a dull film", "label": 0, "idx": 1},
     "sst2 sentence: a dull film", "negative"),
    ("glue_mrpc_v002", {"sentence1": "A b.", "sentence2": "B a.", "label": 1, "idx": 2},
     "mrpc sentence1: A b. sentence2: B a.", "equivalent"),
    ("glue_qqp_v002", {"question1": "Why?", "question2": "How?", "label": 0, "idx": 3},
     "qqp question1: Why? question2: How?", "not_duplicate"),
    ("glue_mnli_v002", {"premise": "P.", "hypothesis": "H.", "label": 2, "idx": 4},
     "mnli hypothesis: H. premise: P.", "contradiction"),
    ("glue_mnli_mismatched_v002", {"premise": "P.", "hypothesis": "H.", "label": 1, "idx": 5},
     "mnli hypothesis: H. premise: P.", "neutral"),
    ("glue_qnli_v002", {"question": "Q?", "sentence": "S.", "label": 1, "idx": 6},
     "qnli question: Q? sentence: S.", "not_entailment"),
    ("glue_rte_v002", {"sentence1": "S1.", "sentence2": "S2.", "label": 0, "idx": 7},
     "rte sentence1: S1. sentence2: S2.", "entailment"),
    ("glue_wnli_v002", {"sentence1": "S1.", "sentence2": "S2.", "label": 1, "idx": 8},
     "wnli sentence1: S1. sentence2: S2.", "entailment"),
    ("glue_ax_v002", {"premise": "P.", "hypothesis": "H.", "label": -1, "idx": 9},
     "mnli hypothesis: H. premise: P.", "<unk>"),
    ("glue_stsb_v002", {"sentence1": "A cat.", "sentence2": "A dog.", "label": 3.25, "idx": 0},
     "stsb sentence1: A cat. sentence2: A dog.", "3.2"),
    ("glue_stsb_v002", {"sentence1": "A", "sentence2": "B", "label": 0.5, "idx": 0},
     "stsb sentence1: A sentence2: B", "0.4"),  # 2.5 rounds half to even, as tf.round
    ("super_glue_boolq_v102", {"question": "is it?", "passage": "It is.", "label": 1, "idx": 0},
     "boolq passage: It is. question: is it?", "True"),
    ("super_glue_cb_v102", {"premise": "P.", "hypothesis": "H.", "label": 1, "idx": 0},
     "cb hypothesis: H. premise: P.", "contradiction"),
    ("super_glue_copa_v102", {"premise": "It rained.", "choice1": "Sun.", "choice2": "Wet.",
                              "question": "effect", "label": 1, "idx": 0},
     "copa choice1: Sun. choice2: Wet. premise: It rained. question: effect", "choice2"),
    ("super_glue_rte_v102", {"premise": "P.", "hypothesis": "H.", "label": 1, "idx": 0},
     "rte hypothesis: H. premise: P.", "not_entailment"),
    ("super_glue_wic_v102", {"sentence1": "A bat flew.", "sentence2": "He hit the bat.",
                             "word": "bat", "start1": 2, "end1": 5, "start2": 11, "end2": 14,
                             "label": 0, "idx": 0},
     "wic sentence1: A bat flew. sentence2: He hit the bat. word: bat", "False"),
    ("super_glue_axb_v102", {"sentence1": "S1.", "sentence2": "S2.", "label": 0, "idx": 0},
     "rte hypothesis: S2. premise: S1.", "entailment"),
    ("super_glue_axg_v102", {"premise": "P.", "hypothesis": "H.", "label": 1, "idx": 0},
     "rte hypothesis: H. premise: P.", "not_entailment"),
]


@pytest.mark.parametrize("name, example, inputs, targets", GLUE_CASES)
def test_glue_text_format(name, example, inputs, targets):
  assert text_of(name, example) == (inputs, targets)


def test_multirc_format_and_metrics():
  ex = {"paragraph": "Bo ran.<br>He <b>won</b>.", "question": "Who won?", "answer": "Bo",
        "label": 1, "idx": {"paragraph": 4, "question": 2, "answer": 7}}
  task = with_vocab("super_glue_multirc_v102")
  (out,) = preprocess(task, [ex])
  assert out["inputs_pretokenized"] == ("multirc question: Who won? answer: Bo paragraph: "
                                        "Bo ran. He won.")
  assert out["targets_pretokenized"] == "True"
  assert (out["idx/paragraph"], out["idx/question"], out["idx/answer"]) == (4, 2, 7)
  post = task.postprocess_fn
  assert post("True", example=out, is_target=True) == {"value": 1, "group": (4, 2)}
  assert post("maybe") == {"value": -1}
  # Question (4, 2): both answers right; question (4, 3): one of two wrong -> EM 50.
  targets = [{"value": 1, "group": (4, 2)}, {"value": 0, "group": (4, 2)},
             {"value": 1, "group": (4, 3)}, {"value": 0, "group": (4, 3)}]
  predictions = [{"value": 1}, {"value": 0}, {"value": 1}, {"value": 1}]
  results = {}
  for fn in task.metric_fns:
    results.update(fn(targets, predictions))
  assert results == pytest.approx({"f1": 80.0, "exact_match": 50.0})


def test_record_one_example_per_answer():
  ex = {"passage": "Bo is here.\n@highlight\nAl left\n@highlight\nThe end",
        "query": "@placeholder flies.", "entities": ["Bo", "Al"], "answers": ["Bo", "Al"],
        "idx": {"passage": 3, "query": 7}}
  task = with_vocab("super_glue_record_v102")
  outs = preprocess(task, [ex])
  inputs = ("record query: @placeholder flies. entities: Bo, Al passage: Bo is here. Al left. "
            "The end")
  assert [o["inputs_pretokenized"] for o in outs] == [inputs, inputs]
  assert [o["targets_pretokenized"] for o in outs] == ["Bo", "Al"]
  assert preprocess(task, [{**ex, "answers": []}])[0]["targets_pretokenized"] == "<unk>"
  target = task.postprocess_fn("Bo", example=outs[0], is_target=True)
  assert target == {"value": ["Bo", "Al"], "group": (3, 7)}
  # Two copies of one query count once; the prediction "al" matches the answer "Al".
  targets, predictions = [target, target], [{"value": "al"}, {"value": "al"}]
  assert task.metric_fns[0](targets, predictions) == pytest.approx({"em": 100.0, "f1": 100.0})


def test_wsc_simple():
  ex = {"text": "Mitchell asked Tom if he could lend some money.", "span1_text": "Tom",
        "span1_index": 2, "span2_text": "he", "span2_index": 4, "label": 1, "idx": 0}
  train, evaluate = (with_vocab(f"super_glue_wsc_v102_simple_{s}") for s in ("train", "eval"))
  (out,) = preprocess(train, [ex])
  assert out["inputs_pretokenized"] == "wsc: Mitchell asked Tom if *he* could lend some money."
  assert out["targets_pretokenized"] == "Tom"
  assert preprocess(train, [{**ex, "label": 0}]) == []  # training keeps true referents only
  (out,) = preprocess(evaluate, [{**ex, "label": 0}])
  post = evaluate.postprocess_fn
  assert post("Tom", example=out, is_target=True) == 0
  assert [post(p, example=out) for p in ("the Tom", "tom", "Mitchell", "Tom's")] == [1, 1, 0, 0]


def test_tokenized_features_end_with_eos():
  task = with_vocab("glue_cola_v002")
  (out,) = preprocess(task, [{"sentence": "x" * 100, "label": 0, "idx": 0}])
  vocabulary = ByteVocabulary()
  inputs = vocabulary.encode("cola sentence: " + "x" * 100)
  assert out["inputs"].tolist() == inputs[:63].tolist() + [1]
  assert out["targets"].tolist() == vocabulary.encode("unacceptable")[:15].tolist() + [1]
  assert out["idx"] == 0


CLASSIFICATION = [b for b in glue.GLUE + glue.SUPER_GLUE
                  if b.labels and b.config not in ("multirc",)]


@pytest.mark.parametrize("benchmark", CLASSIFICATION, ids=lambda b: b.config)
def test_postprocess_inverts_label_names(benchmark):
  prefix = "super_glue" if benchmark in glue.SUPER_GLUE else "glue"
  task = TaskRegistry.get(f"{prefix}_{benchmark.config}_"
                          f"{'v102' if prefix == 'super_glue' else 'v002'}")
  fmt = task.preprocessors[0]
  fields = {key: "t" for _, key in [(f, f) if isinstance(f, str) else f for f in benchmark.fields]}
  for label in range(len(benchmark.labels)):
    target = fmt({**fields, "label": label, "idx": 0})["targets"]
    assert task.postprocess_fn(target) == label
  assert task.postprocess_fn("not a label") == -1


def test_stsb_postprocess_and_metrics():
  task = TaskRegistry.get("glue_stsb_v002")
  assert task.postprocess_fn("3.2") == pytest.approx(3.2)
  assert task.postprocess_fn("three") == -1.0
  targets, predictions = [1.0, 2.0, 3.0, 4.0], [1.2, 1.8, 3.4, 4.0]
  results = {k: v for fn in task.metric_fns for k, v in fn(targets, predictions).items()}
  assert results["spearman_corrcoef"] == pytest.approx(100.0)
  # Pearson by hand: deviations (-1.5, -.5, .5, 1.5) and (-1.4, -.8, .8, 1.4).
  expected = 100 * 5.0 / np.sqrt(5.0 * 5.2)
  assert results["pearson_corrcoef"] == pytest.approx(expected)


def test_glue_metric_fns():
  cola = TaskRegistry.get("glue_cola_v002")
  assert cola.metric_fns[0]([1, 1, 0, 0], [1, 0, 0, 0]) == {
      "matthews_corrcoef": pytest.approx(100 * 2 / np.sqrt(12))}
  mrpc = TaskRegistry.get("glue_mrpc_v002")
  results = {k: v for fn in mrpc.metric_fns for k, v in fn([1, 1, 0, 0], [1, -1, 1, 0]).items()}
  assert results == pytest.approx({"f1": 50.0, "accuracy": 50.0})
  cb = TaskRegistry.get("super_glue_cb_v102")
  results = {k: v for fn in cb.metric_fns for k, v in fn([0, 1, 2, 2], [0, 1, 2, 1]).items()}
  assert results == pytest.approx({"mean_3class_f1": 100 * (1 + 2 / 3 + 2 / 3) / 3,
                                   "accuracy": 75.0})


# ------------------------------------------------------------------ summarization, QA, MT

def test_cnn_dailymail():
  task = with_vocab("cnn_dailymail_v002")
  (out,) = preprocess(task, [{"article": "Rain fell. Roads closed.",
                              "highlights": "Rain closed roads."}])
  assert out["inputs_pretokenized"] == "summarize: Rain fell. Roads closed."
  assert out["targets_pretokenized"] == "Rain closed roads."
  results = task.metric_fns[0](["rain closed roads"], ["rain closed the roads"])
  # rouge1: 3 common words, P 3/4, R 3/3 -> F 6/7; rouge2: 1 common bigram of 2 and 3.
  assert results == pytest.approx({"rouge1": 600 / 7, "rouge2": 40.0, "rougeLsum": 600 / 7})


def test_wmt():
  task = with_vocab("wmt_t2t_ende_v003")
  (out,) = preprocess(task, [{"en": "That is good.", "de": "Das ist gut."}])
  assert out["inputs_pretokenized"] == "translate English to German: That is good."
  assert out["targets_pretokenized"] == "Das ist gut."
  assert text_of("wmt16_enro_v003", {"en": "Hi.", "ro": "Salut."}) == (
      "translate English to Romanian: Hi.", "Salut.")
  sentence = "the cat sat on the mat today"
  assert task.metric_fns[0]([sentence], [sentence]) == {"bleu": pytest.approx(100.0)}


def test_squad():
  ex = {"id": b"a1", "title": "T", "question": "Who won the 2nd game?",
        "context": "Bo won it (barely).",
        "answers": {"text": np.array([b"Bo", b"Bo (barely)"], dtype=object),
                    "answer_start": np.array([0, 0])}}
  task = with_vocab("squad_v010_allanswers")
  (out,) = preprocess(task, [ex])
  assert out["inputs_pretokenized"] == ("question: Who won the 2nd game ? context: Bo won it "
                                        "( barely ) . ")
  assert out["targets_pretokenized"] == "Bo"
  assert out["answers"] == ["Bo", "Bo ( barely ) "]
  targets = [task.postprocess_fn("Bo", example=out, is_target=True)]
  assert targets == [["Bo", "Bo ( barely ) "]]
  assert task.metric_fns[0](targets, ["bo barely"]) == pytest.approx({"em": 100.0, "f1": 100.0})
  assert task.metric_fns[0](targets, ["Bo won"]) == pytest.approx({"em": 0.0, "f1": 100 * 2 / 3})
  assert squad.pad_punctuation("café") == "caf é "  # RE2's ASCII \\W, as T5 ran it


# ------------------------------------------------------------------ where the data comes from

def test_tfds_source_by_default(monkeypatch):
  source = TaskRegistry.get("glue_cola_v002").get_source("validation")
  assert isinstance(source, TfdsSource)
  assert (source.name, source.split, source.data_dir) == ("glue/cola:2.0.0", "validation", None)
  monkeypatch.setenv("T5LITE_TFDS_DATA_DIR", "/data/tfds")
  source = TaskRegistry.get("glue_mnli_v002").get_source("validation_matched")
  assert (source.name, source.data_dir) == ("glue/mnli:2.0.0", "/data/tfds")
  assert TaskRegistry.get("squad_v010_allanswers").get_source("train").name == "squad/v1.1:3.0.0"


def test_local_jsonl_and_tsv_files(tmp_path, monkeypatch):
  cola = tmp_path / "glue" / "cola"
  cola.mkdir(parents=True)
  (cola / "train.jsonl").write_text(
      "\n".join(json.dumps({"sentence": s, "label": i % 2, "idx": i})
                for i, s in enumerate(["He left.", "Left he."])) + "\n")
  (cola / "validation.tsv").write_text("sentence\tlabel\tidx\nShe ran.\t1\t0\n")
  monkeypatch.setenv("T5LITE_LOCAL_DATA_DIR", str(tmp_path))
  task = with_vocab("glue_cola_v002")
  train, validation = task.get_source("train"), task.get_source("validation")
  assert isinstance(train, JsonlSource) and isinstance(validation, TsvSource)
  assert [ex["inputs_pretokenized"] for ex in preprocess(task, [train[0], train[1]])] == [
      "cola sentence: He left.", "cola sentence: Left he."]
  (out,) = preprocess(task, [validation[0]])
  assert (out["inputs_pretokenized"], out["targets_pretokenized"]) == (
      "cola sentence: She ran.", "acceptable")
  with pytest.raises(FileNotFoundError, match="test.jsonl"):
    task.get_source("test")
  # Other datasets still come from TFDS.
  assert isinstance(TaskRegistry.get("glue_sst2_v002").get_source("train"), TfdsSource)


def test_glue_mixture_is_examples_proportional(tmp_path, monkeypatch):
  mixture = MixtureRegistry.get("glue_v002_proportional")
  names = [name for name, _ in mixture.tasks]
  assert "glue_wnli_v002" not in names and "glue_mnli_matched_v002" not in names
  for i, name in enumerate(names):
    config = name[len("glue_"):-len("_v002")]
    folder = tmp_path / "glue" / config
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"label": 0}\n' * (i + 1))
  monkeypatch.setenv("T5LITE_LOCAL_DATA_DIR", str(tmp_path))
  rates = {task.name: rate for task, rate in mixture.task_rates()}
  assert rates == {name: float(i + 1) for i, name in enumerate(names)}


# ------------------------------------------------------------------ C4

def _write_c4_json(folder, split: str, shard: int, texts) -> None:
  with gzip.open(folder / f"c4-{split}.{shard:05d}-of-00002.json.gz", "wt") as f:
    for text in texts:
      f.write(json.dumps({"text": text, "timestamp": "2019-04-25T12:57:54Z",
                          "url": "https://example.com"}) + "\n")


def _write_tfrecord(path, records) -> None:
  with open(path, "wb") as f:
    for data in records:
      length = struct.pack("<Q", len(data))
      f.write(length + struct.pack("<I", masked_crc32c(length)) + data
              + struct.pack("<I", masked_crc32c(data)))


def _streamed(source) -> list[dict]:
  """Every example of a streamed source, shard after shard."""
  return [ex for shard in range(source.num_shards) for ex in source.examples(shard)]


def test_c4_sources(tmp_path, monkeypatch):
  assert c4.split_pattern("/c4/c4-train.*.json.gz", "validation") == "/c4/c4-validation.*.json.gz"
  assert c4.split_pattern("/c4/{split}/*.gz", "train") == "/c4/train/*.gz"
  task = TaskRegistry.get("c4_span_corruption")
  source = task.get_source("train")
  assert isinstance(source, TfdsSource) and source.name == "c4/en:3.1.0"
  # Converted TFDS tfrecord shards.
  _write_tfrecord(tmp_path / "c4-train.tfrecord-00000-of-00001",
                  [make_example({"text": t, "url": "u"}) for t in FAKE_TEXT])
  convert_tfrecord_to_array_record(str(tmp_path / "c4-train.tfrecord-*"), str(tmp_path / "ar"))
  monkeypatch.setenv("T5LITE_C4_ARRAY_RECORD", str(tmp_path / "ar" / "c4-train.array_record-*"))
  source = task.get_source("train")
  assert isinstance(source, ArrayRecordSource) and source[1]["text"] == FAKE_TEXT[1]
  # The public JSON files win over both.
  _write_c4_json(tmp_path, "train", 0, FAKE_TEXT[:2])
  _write_c4_json(tmp_path, "train", 1, FAKE_TEXT[2:])
  _write_c4_json(tmp_path, "validation", 0, ["Held out text."])
  monkeypatch.setenv("T5LITE_C4_JSON", str(tmp_path / "c4-train.*-of-00002.json.gz"))
  train, validation = task.get_source("train"), task.get_source("validation")
  assert isinstance(train, JsonlStream) and train.num_shards == 2  # read as a stream
  assert [ex["text"] for ex in _streamed(train)] == FAKE_TEXT
  assert [ex["text"] for ex in _streamed(validation)] == ["Held out text."]


def test_c4_span_corruption(tmp_path, monkeypatch, sp_vocab):
  _write_c4_json(tmp_path, "train", 0, FAKE_TEXT * 4)
  monkeypatch.setenv("T5LITE_C4_JSON", str(tmp_path / "c4-train.*.json.gz"))
  task = with_vocab("c4_span_corruption", sp_vocab)
  source = task.get_source("train")
  outs = preprocess(task, _streamed(source))
  assert outs
  sentinel = sp_vocab.vocab_size - 1  # <extra_id_0>
  for ex in outs:
    inputs, targets = ex["inputs"].tolist(), ex["targets"].tolist()
    assert len(inputs) <= LENGTHS["inputs"] and inputs[-1] == 1 and sentinel in inputs
    assert targets[0] == sentinel and targets[-1] == 1
  assert len(outs[0]["inputs"]) == LENGTHS["inputs"]  # full pieces fill the inputs exactly
  # Undo the corruption: put each target span back at its sentinel.
  ex = outs[0]
  spans, current = {}, None
  for t in ex["targets"].tolist()[:-1]:
    if t >= sp_vocab.vocab_size - sp_vocab.extra_ids:
      current = spans.setdefault(t, [])
    else:
      current.append(t)
  restored = [x for t in ex["inputs"].tolist()[:-1] for x in spans.get(t, [t])]
  # Documents are concatenated without separators before they are cut into pieces.
  stream = np.concatenate([sp_vocab.encode(t) for t in FAKE_TEXT * 4]).tolist()
  assert any(stream[i:i + len(restored)] == restored for i in range(len(stream)))


def test_c4_lm(tmp_path, monkeypatch):
  _write_c4_json(tmp_path, "train", 0, FAKE_TEXT)
  monkeypatch.setenv("T5LITE_C4_JSON", str(tmp_path / "c4-train.*.json.gz"))
  task = with_vocab("c4_lm")
  assert set(task.output_features) == {"targets"}
  source = task.get_source("train")
  outs = preprocess(task, _streamed(source))
  stream = np.concatenate([ByteVocabulary().encode(t) for t in FAKE_TEXT])
  assert [len(ex["targets"]) for ex in outs[:-1]] == [16] * (len(outs) - 1)
  np.testing.assert_array_equal(np.concatenate([ex["targets"] for ex in outs]), stream)


def test_package_is_t5lite_tasks():
  assert t5lite_tasks.glue is glue and t5lite_tasks.c4 is c4
