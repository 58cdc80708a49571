"""t5lite.data.converters.head_features: BERT's templates, truncation and its counting, label
checks, word-piece tag alignment, QA windows (checked against `tokenizers`' own overflowing windows)
and multiple choice; entity F1 (t5lite.eval.metrics) against seqeval on random tags."""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
from tokenizers import processors

from t5lite.data.converters import head_features as hf
from t5lite.data.vocab.hf_training import train_wordpiece
from t5lite.data.vocab.hf_vocabularies import WordPieceVocabulary
from t5lite.data.registry import Feature
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError
from t5lite.eval import metrics

TEXTS = ["Bo won the cup in the final game of the long season.", "Who won the cup?",
         "The river runs past the old mill near the town."]


@pytest.fixture(scope="module")
def vocab() -> WordPieceVocabulary:
  return train_wordpiece(TEXTS * 5, 200)


def features(vocabulary):
  return hf.head_output_features(vocabulary)


def test_truncate_longest_first_matches_hf_loop():
  rng = np.random.default_rng(0)
  for _ in range(300):
    la, lb, room = (int(x) for x in rng.integers(0, 12, 3))
    a, b = np.arange(la), np.arange(lb)
    ra, rb = list(a), list(b)
    for _ in range(max(0, la + lb - room)):  # HF's python tokenizers' loop
      if len(ra) > len(rb):
        ra.pop()
      else:
        rb.pop()
    ta, tb, cut = hf.truncate_longest_first(a, b, room)
    assert (list(ta), list(tb), cut) == (ra, rb, la + lb - len(ra) - len(rb))
  a, _, cut = hf.truncate_longest_first(np.arange(5), None, 3)
  assert list(a) == [0, 1, 2] and cut == 2


def test_pair_template_truncation_and_counting(vocab, caplog):
  hf.reset_truncation_stats()
  feats = features(vocab)
  ex = hf.encode_pair("t_pair", ("a", "b"), 2)(
      {"a": "Who won the cup?", "b": "Bo won the cup in the final game.", "label": 1, "idx": 4},
      output_features=feats)
  a, b = vocab.encode("Who won the cup?"), vocab.encode("Bo won the cup in the final game.")
  full = hf.pair_inputs("t_pair")(ex, output_features=feats, sequence_length={"inputs": 64})
  assert list(full["inputs"]) == [vocab.cls_id, *a, vocab.sep_id, *b, vocab.sep_id]
  assert list(full["token_type_ids"]) == [0] * (len(a) + 2) + [1] * (len(b) + 1)
  assert full["label"] == 1 and full["label"].dtype == np.int32 and full["idx"] == 4
  assert full["truncated_tokens"] == 0 and hf.truncation_stats("t_pair")["examples"] == 0
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      cut = hf.pair_inputs("t_pair")(ex, output_features=feats, sequence_length={"inputs": 10})
  assert len(cut["inputs"]) == len(cut["token_type_ids"]) == 10
  assert cut["truncated_tokens"] == len(a) + len(b) + 3 - 10
  stats = hf.truncation_stats("t_pair")
  assert stats == {"examples": 2, "tokens": 2 * int(cut["truncated_tokens"])}
  assert sum("t_pair" in r.getMessage() for r in caplog.records) == 1  # warned once
  single = hf.encode_pair("t1", ("a",), 2)({"a": "Who won?", "label": 0}, output_features=feats)
  single = hf.pair_inputs("t1")(single, output_features=feats, sequence_length={"inputs": 8})
  assert list(single["token_type_ids"]) == [0] * len(single["inputs"])
  assert single["inputs"][-1] == vocab.sep_id


def test_label_checks_name_the_task_and_example(vocab):
  feats = features(vocab)
  for label in (2, -1, 0.5, None, "x", float("nan")):
    with pytest.raises(ConfigError, match=r"'t_lab'.*example 17"):
      hf.encode_pair("t_lab", ("a",), 2)({"a": "x", "label": label, "idx": 17},
                                         output_features=feats)
  assert hf.check_label("1", "t", 0, 2) == 1  # TSV files give text
  value = hf.check_label(3.8, "t", 0, 1, "regression")
  assert value.dtype == np.float32 and value == np.float32(3.8)
  hot = hf.check_label([0, 2], "t", 0, 3, "multi")
  assert hot.dtype == np.float32 and list(hot) == [1, 0, 1]
  with pytest.raises(ConfigError, match="outside"):
    hf.check_label([3], "t", 0, 3, "multi")


def test_vocabulary_without_cls_sep_is_a_config_error():
  feats = hf.head_output_features(ByteVocabulary())
  ex = hf.encode_pair("t_bytes", ("a",), 2)({"a": "x", "label": 0}, output_features=feats)
  with pytest.raises(ConfigError, match="t_bytes.*cls_id"):
    hf.pair_inputs("t_bytes")(ex, output_features=feats, sequence_length={"inputs": 8})


def test_word_pieces_label_only_the_first_piece():
  v = WordPieceVocabulary(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "eu", "reject", "##s",
                           "german", "call", "."])
  feats = features(v)
  ex = hf.encode_words("t_ner", ("O", "B-ORG", "B-MISC"))(
      {"id": "s1", "tokens": ["EU", "rejects", "German", "call", "."],
       "ner_tags": [1, 0, "B-MISC", 0, 0]}, output_features=feats)
  out = hf.tagging_inputs("t_ner")(ex, output_features=feats, sequence_length={"inputs": 16})
  assert list(out["inputs"]) == [2, 5, 6, 7, 8, 9, 10, 3]
  assert list(out["token_labels"]) == [-100, 1, 0, -100, 2, 0, 0, -100]
  assert out["id"] == "s1" and out["truncated_tokens"] == 0
  short = hf.tagging_inputs("t_ner")(ex, output_features=feats, sequence_length={"inputs": 5})
  assert list(short["token_labels"]) == [-100, 1, 0, -100, -100]
  assert short["truncated_tokens"] == 3
  names = hf.tagging_postprocess(("O", "B-ORG", "B-MISC"))
  logits = np.eye(3, dtype=np.float32)[[0, 1, 0, 0, 2, 1, 0, 0]]
  assert names(None, example=out, is_target=True) == ["B-ORG", "O", "B-MISC", "O", "O"]
  assert names(logits, example=out) == ["B-ORG", "O", "B-MISC", "B-ORG", "O"]
  with pytest.raises(ConfigError, match="'t_ner'.*'s2'"):
    hf.encode_words("t_ner", ("O", "B-ORG"))({"id": "s2", "tokens": ["EU"], "ner_tags": [5]},
                                             output_features=feats)


def test_qa_windows_match_tokenizers_overflow(vocab):
  """Our windows = `tokenizers`' own (truncation only_second, stride = overlap) under BERT's
  template; each answer span, read back through the offsets, is the answer text."""
  context = " ".join(TEXTS[i % 3] for i in range(8))
  question = "Who won the cup?"
  answer_start = context.index("final", 100)
  ex = {"id": "q1", "question": question, "context": context,
        "answers": {"text": ["final game"], "answer_start": [answer_start]}}
  encoded = hf.encode_qa("t_qa")(ex, output_features=features(vocab))
  length, stride = 24, 5
  windows = hf.qa_window_examples(encoded, length, vocab.cls_id, vocab.sep_id, stride, "t_qa")
  tokenizer = copy.deepcopy(vocab.tokenizer)
  tokenizer.post_processor = processors.TemplateProcessing(
      single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
      special_tokens=[("[CLS]", vocab.cls_id), ("[SEP]", vocab.sep_id)])
  tokenizer.enable_truncation(length, stride=stride, strategy="only_second")
  first = tokenizer.encode(question, context)
  reference = [first] + list(first.overflowing)
  assert len(windows) == len(reference) > 3
  found = 0
  for window, ref in zip(windows, reference):
    assert list(window["inputs"]) == ref.ids and list(window["token_type_ids"]) == ref.type_ids
    context_mask = np.asarray(ref.sequence_ids) == 1
    assert (window["offsets"][~context_mask] == -1).all()
    assert [tuple(o) for o in window["offsets"][context_mask]] == [
        o for o, m in zip(ref.offsets, context_mask) if m]
    s, e = int(window["start_position"]), int(window["end_position"])
    if s:
      found += 1
      assert context[window["offsets"][s][0]:window["offsets"][e][1]] == "final game"
    else:
      assert e == 0
    assert window["example_id"] == "q1" and window["answers"] == ["final game"]
  assert found >= 1


def test_qa_answer_mismatch_is_an_error(vocab):
  ex = {"id": "bad7", "question": "Who?", "context": "Bo won.",
        "answers": {"text": ["Bo"], "answer_start": [3]}}
  with pytest.raises(ConfigError, match="'t_qa'.*'bad7'"):
    hf.encode_qa("t_qa")(ex, output_features=features(vocab))


def test_multiple_choice(vocab):
  out = hf.encode_multiple_choice("t_mc", "ctx", "endings", 3, question_field="q")(
      {"ctx": "Bo won the cup.", "q": "Then", "endings": ["he won.", "the river ran.", "x"],
       "label": 1, "idx": 2}, output_features=features(vocab), sequence_length={"inputs": 12})
  assert out["inputs"].shape == out["token_type_ids"].shape == (3, 12)
  assert out["inputs"].dtype == np.int32 and out["label"] == 1
  assert (out["inputs"][:, 0] == vocab.cls_id).all()
  assert hf.class_postprocess(np.array([0.1, 2.0, -1.0]), example=out) == 1


@pytest.mark.parity
def test_entity_f1_matches_seqeval():
  seqeval = pytest.importorskip("seqeval.metrics")
  rng = np.random.default_rng(1)
  tags = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"]
  for trial in range(40):
    sizes = rng.integers(1, 12, rng.integers(1, 6))
    true = [[tags[i] for i in rng.integers(0, len(tags), n)] for n in sizes]
    pred = [[t if rng.random() < 0.6 else tags[rng.integers(len(tags))] for t in s] for s in true]
    ours = metrics.entity_f1(true, pred)
    assert ours["entity_precision"] == pytest.approx(100 * seqeval.precision_score(true, pred))
    assert ours["entity_recall"] == pytest.approx(100 * seqeval.recall_score(true, pred))
    assert ours["entity_f1"] == pytest.approx(100 * seqeval.f1_score(true, pred))
    assert metrics.token_accuracy(true, pred)["token_accuracy"] == pytest.approx(
        100 * seqeval.accuracy_score(true, pred))
  assert metrics.entity_spans([["B-PER", "I-PER", "O", "I-LOC"]]) == {("PER", 0, 1),
                                                                      ("LOC", 3, 3)}
