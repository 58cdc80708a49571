"""The head tasks (tasks/glue_heads.py, squad_heads.py, conll_ner.py, embedded_heads.py), each
read through the real unpacked pipeline (task_row_dataset, as the evaluator reads a split) on
tiny fake local data, with a tiny WordPiece instead of the embedded one, then scored as the
evaluator will: postprocess_fn(None / head logits, example=ex) into the task's metric fns."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest

import t5lite_tasks  # noqa: F401 (registers the tasks)
from t5lite_tasks import conll_ner, embedded, embedded_heads, glue_heads
from t5lite.data.converters import head_features as hf
from t5lite.data.vocab.hf_training import train_wordpiece
from t5lite.data.registry import TaskRegistry
from t5lite.data.rows import PipelineConfig, task_row_dataset
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError

WORDS = ("the cat sat on a mat while rain fell over old city roads who won game home team "
         "last minute bo cup final season river mill town eu rejects german call to boycott "
         "british lamb peter blackburn").split()
TEXT = " ".join(WORDS)


@pytest.fixture(scope="module")
def vocab():
  return train_wordpiece([TEXT + " . , ? ! abcdefghijklmnopqrstuvwxyz"] * 3, 150)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("T5LITE_LOCAL_DATA_DIR", str(tmp_path))
  monkeypatch.delenv("T5LITE_TFDS_DATA_DIR", raising=False)
  return tmp_path


def write(root, dataset: str, split: str, rows) -> None:
  os.makedirs(root / dataset, exist_ok=True)
  with open(root / dataset / f"{split}.jsonl", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)


def task_with(name: str, vocabulary):
  task = TaskRegistry.get(name)
  return dataclasses.replace(task, output_features=hf.head_output_features(vocabulary))


def read(task, split: str, length: int = 64, limit: int | None = None) -> list[dict]:
  config = PipelineConfig(global_batch_size=1, task_feature_lengths={"inputs": length},
                          split=split, shuffle=False, num_epochs=1)
  return list(itertools.islice(task_row_dataset(task, 0, config), limit))


def evaluate(task, examples, outputs) -> dict:
  """What the evaluator does with head outputs (see Task's docstring)."""
  targets = [task.postprocess_fn(None, example=ex, is_target=True) for ex in examples]
  predictions = [task.postprocess_fn(out, example=ex) for ex, out in zip(examples, outputs)]
  result = {}
  for fn in task.metric_fns:
    result.update(fn(targets, predictions))
  return result


def sentence(rng, n=None) -> str:
  return " ".join(rng.choice(WORDS, n or int(rng.integers(3, 9))))


def test_default_vocabulary_is_the_embedded_wordpiece_unloaded():
  for name in ("glue_cola_head", "squad_v010_head", "conll2003_ner_head",
               "stdlib_docstring_module_head"):
    task = TaskRegistry.get(name)
    assert task.output_features["inputs"].vocabulary is embedded.MLM_VOCABULARY
    assert not task.output_features["inputs"].add_eos and task.head


@pytest.mark.parametrize("config", sorted(glue_heads.FIELDS))
def test_glue_heads_read_local_data(config, vocab, data_dir):
  rng = np.random.default_rng(0)
  name = f"glue_{config}_head"
  task = task_with(name, vocab)
  fields = glue_heads.FIELDS[config]
  regression = task.num_labels == 1
  for split in task.splits:
    rows = [{**{f: sentence(rng) for f in fields}, "idx": i,
             "label": round(float(rng.uniform(0, 5)), 2) if regression else i % task.num_labels}
            for i in range(6)]
    write(data_dir, f"glue/{config}", split, rows)
    examples = read(task, split)
    assert [ex["idx"] for ex in examples] == list(range(6))
    for ex, row in zip(examples, rows):
      a = list(vocab.encode(row[fields[0]]))
      assert list(ex["inputs"][:len(a) + 2]) == [vocab.cls_id, *a, vocab.sep_id]
      assert ex["inputs"].dtype == ex["token_type_ids"].dtype == np.int32
      assert ex["token_type_ids"].shape == ex["inputs"].shape
      assert bool(ex["token_type_ids"].any()) == (len(fields) == 2)
      assert ex["label"].dtype == (np.float32 if regression else np.int32)
      assert "targets" not in ex and "truncated_tokens" in ex
    if regression:
      outputs = [np.array([ex["label"]], np.float32) for ex in examples]
    else:
      outputs = [np.eye(task.num_labels, dtype=np.float32)[ex["label"]] for ex in examples]
    result = evaluate(task, examples, outputs)
    assert result and all(v == pytest.approx(100.0) for v in result.values()), result


def test_label_out_of_range_names_the_example(vocab, data_dir):
  write(data_dir, "glue/rte", "train", [
      {"sentence1": "the cat sat", "sentence2": "a cat", "label": 0, "idx": 0},
      {"sentence1": "the cat sat", "sentence2": "a cat", "label": 5, "idx": 42}])
  with pytest.raises(ConfigError, match=r"glue_rte_head.*example 42.*outside"):
    read(task_with("glue_rte_head", vocab), "train")


def test_truncation_is_counted_not_dropped(vocab, data_dir):
  hf.reset_truncation_stats()
  long = " ".join(WORDS[:20])
  write(data_dir, "glue/mrpc", "validation", [
      {"sentence1": long, "sentence2": long, "label": 1, "idx": 0},
      {"sentence1": "the cat", "sentence2": "a mat", "label": 0, "idx": 1}])
  examples = read(task_with("glue_mrpc_head", vocab), "validation", length=12)
  assert len(examples) == 2 and len(examples[0]["inputs"]) == 12
  cut = int(examples[0]["truncated_tokens"])
  assert cut == 2 * len(vocab.encode(long)) + 3 - 12 and examples[1]["truncated_tokens"] == 0
  assert hf.truncation_stats("glue_mrpc_head") == {"examples": 1, "tokens": cut}


def test_squad_head_windows_and_metric(vocab, data_dir):
  context = ("the cat sat on a mat while rain fell over old city roads . " * 4
             + "bo won the cup in the final season . " + "the river ran past the mill . " * 3)
  start = context.index("bo won")
  rows = [{"id": "long1", "question": "who won the cup ?", "context": context,
           "answers": {"text": ["bo", "bo won"], "answer_start": [start, start]}},
          {"id": "short2", "question": "who sat ?", "context": "the cat sat on a mat .",
           "answers": {"text": ["the cat"], "answer_start": [0]}}]
  write(data_dir, "squad/v1.1", "validation", rows)
  task = task_with("squad_v010_head", vocab)
  assert task.head == "question_answering" and task.num_labels == 2
  windows = read(task, "validation", length=32)
  by_id = {i: [w for w in windows if w["example_id"] == i] for i in ("long1", "short2")}
  assert len(by_id["long1"]) >= 3 and len(by_id["short2"]) == 1
  with_answer = [w for w in by_id["long1"] if w["start_position"]]
  assert with_answer and len(with_answer) < len(by_id["long1"])  # others point at [CLS]
  outputs = []
  for w in windows:
    logits = np.zeros((len(w["inputs"]), 2), np.float32)
    if w["start_position"]:
      logits[w["start_position"], 0] = logits[w["end_position"], 1] = 10.0
    outputs.append(logits)
    assert w["offsets"].shape == (len(w["inputs"]), 2) and w["offsets"].dtype == np.int32
  assert evaluate(task, windows, outputs) == {"em": 100.0, "f1": 100.0}
  bad = dict(rows[1], id="oops9", answers={"text": ["mat"], "answer_start": [2]})
  write(data_dir, "squad/v1.1", "validation", [bad])
  with pytest.raises(ConfigError, match=r"squad_v010_head.*'oops9'"):
    read(task, "validation")


def test_conll_ner_head(vocab, data_dir):
  rows = [{"id": "0", "tokens": ["EU", "rejects", "German", "call", "to", "boycott", "British",
                                 "lamb", "."], "ner_tags": [3, 0, 7, 0, 0, 0, 7, 0, 0]},
          {"id": "1", "tokens": ["Peter", "Blackburn"], "ner_tags": ["B-PER", "I-PER"]}]
  write(data_dir, "conll2003", "test", rows)
  task = task_with("conll2003_ner_head", vocab)
  assert task.num_labels == 9 and task.head == "token_classification"
  examples = read(task, "test", length=32)
  first = examples[0]
  assert first["token_labels"].shape == first["inputs"].shape
  assert first["token_labels"][0] == first["token_labels"][-1] == -100
  assert list(first["token_labels"][first["token_labels"] != -100]) == rows[0]["ner_tags"]
  outputs = [np.eye(9, dtype=np.float32)[np.maximum(ex["token_labels"], 0)] for ex in examples]
  result = evaluate(task, examples, outputs)
  assert result == {"entity_precision": 100.0, "entity_recall": 100.0, "entity_f1": 100.0,
                    "token_accuracy": 100.0}
  wrong = [np.eye(9, dtype=np.float32)[np.zeros(len(ex["inputs"]), int)] for ex in examples]
  assert evaluate(task, examples, wrong)["entity_f1"] == 0.0


def test_embedded_head_tasks(vocab):
  for name, classes in (("stdlib_docstring_module_head", 8), ("stdlib_sentence_pair_head", 2)):
    task = task_with(name, vocab)
    assert task.num_labels == classes and task.splits == ("train", "validation")
    for split in task.splits:
      source = task.get_source(split)
      labels = np.bincount([row["label"] for row in source], minlength=classes)
      assert labels.max() - labels.min() <= 1 and 0 < len(source) <= 3000  # balanced, small
      examples = read(task, split, length=32, limit=classes * 2)
      assert sorted(int(ex["label"]) for ex in examples) == sorted(list(range(classes)) * 2)
  train = {row["text"] for row in embedded_heads.module_examples("train")}
  assert not train & {row["text"] for row in embedded_heads.module_examples("validation")}


def test_register_head_tasks_with_another_vocabulary(vocab):
  names = glue_heads.register_head_tasks(vocab, "_tiny")
  try:
    assert "glue_cola_head_tiny" in names and "squad_v010_head_tiny" in names
    assert "conll2003_ner_head_tiny" in names and "stdlib_sentence_pair_head_tiny" in names
    assert len(names) == 15
    assert TaskRegistry.get("glue_qqp_head_tiny").output_features["inputs"].vocabulary is vocab
  finally:
    for name in names:
      TaskRegistry.remove(name)
  with pytest.raises(ConfigError, match="suffix"):
    glue_heads.register_head_tasks(vocab, "")
  with pytest.raises(ConfigError, match="cls_id"):
    glue_heads.register_head_tasks(ByteVocabulary(), "_bytes")
  assert conll_ner.LABELS[0] == "O"
