"""Sentence pairs (BERT NSP, ALBERT SOP), truncation and RoBERTa FULL-SENTENCES
(t5lite.data.objectives.sentence_pairs), on numbered synthetic documents: fast, numpy only."""
import numpy as np
import pytest

from t5lite.data.objectives import sentence_pairs as sp
from t5lite.errors import ConfigError

CLS, SEP = 2, 3


def documents(rng, count=150, sentences=(3, 12), tokens=(2, 9)):
  """Documents of sentences whose token ids are unique (5, 6, 7, ...): where[id] = (doc,
  running position in the doc), so every token tells where it comes from."""
  docs, where, next_id = [], {}, 5
  for d in range(count):
    doc, position = [], 0
    for _ in range(int(rng.integers(*sentences))):
      n = int(rng.integers(*tokens))
      doc.append(np.arange(next_id, next_id + n, dtype=np.int32))
      for t in range(next_id, next_id + n):
        where[t] = (d, position)
        position += 1
      next_id += n
    docs.append(doc)
  return docs, where


def parts(example):
  """(A, B) of `[CLS] A [SEP] B [SEP]`, checking the layout and the token types."""
  tokens, types = example["targets"], example["token_type_ids"]
  assert tokens[0] == CLS and tokens[-1] == SEP and (tokens == SEP).sum() == 2
  first = int(np.flatnonzero(tokens == SEP)[0])
  assert (types[:first + 1] == 0).all() and (types[first + 1:] == 1).all()
  return tokens[1:first], tokens[first + 1:-1]


def contiguous(tokens, where):
  """Whether the tokens are one run of one document."""
  places = [where[int(t)] for t in tokens]
  return (len({d for d, _ in places}) == 1
          and all(b[1] == a[1] + 1 for a, b in zip(places, places[1:])))


@pytest.mark.parametrize("max_length", [13, 37, 64])
def test_nsp_pairs(max_length):
  rng = np.random.default_rng(max_length)
  docs, where = documents(rng)
  examples = sp.create_pairs(docs, rng, max_length=max_length, cls_id=CLS, sep_id=SEP)
  labels = np.array([e["sentence_label"] for e in examples])
  assert len(examples) > 100 and set(labels.tolist()) <= {0, 1}
  for e in examples:
    a, b = parts(e)
    assert len(e["targets"]) <= max_length and len(a) and len(b)
    assert e["targets"].dtype == e["token_type_ids"].dtype == np.int32
    doc_a, doc_b = where[int(a[0])][0], where[int(b[0])][0]
    if e["sentence_label"] == 1:
      assert doc_a != doc_b  # B really comes from another document
    else:
      assert doc_a == doc_b
      if not e["truncated_tokens"]:  # IsNext: B continues A in its document
        assert contiguous(np.concatenate([a, b]), where)
  assert 0.4 < labels.mean() < 0.75  # more than 50%: one-sentence chunks always take a random B


def test_nsp_takes_a_random_b_half_the_time():
  # Short sentences: nearly every chunk has several, so BERT's forced random B (for a
  # one-sentence chunk: at most a document's last) is rare.
  rng = np.random.default_rng(7)
  docs, _ = documents(rng, count=300, sentences=(10, 20), tokens=(1, 4))
  examples = sp.create_pairs(docs, rng, max_length=64, cls_id=CLS, sep_id=SEP)
  labels = np.array([e["sentence_label"] for e in examples])
  assert len(labels) > 500 and abs(labels.mean() - 0.5) < 0.06


@pytest.mark.parametrize("max_length", [13, 37, 64])
def test_sop_negatives_are_exact_swaps(max_length):
  rng = np.random.default_rng(max_length + 1)
  docs, where = documents(rng)
  examples = sp.create_pairs(docs, rng, max_length=max_length, cls_id=CLS, sep_id=SEP,
                             order="sop")
  labels = np.array([e["sentence_label"] for e in examples])
  assert abs(labels.mean() - 0.5) < 0.07
  checked = 0
  for e in examples:
    a, b = parts(e)
    assert len(e["targets"]) <= max_length and len(a) and len(b)
    assert where[int(a[0])][0] == where[int(b[0])][0]  # never another document
    if not e["truncated_tokens"]:
      first, second = (b, a) if e["sentence_label"] else (a, b)
      assert contiguous(np.concatenate([first, second]), where)
      checked += 1
  assert checked > 50


def test_truncation_matches_berts_loop():
  def bert(a, b, room):  # truncate_seq_pair's choice of side, token by token
    removed = [0, 0]
    while a + b > room:
      if a > b:
        a, removed[0] = a - 1, removed[0] + 1
      else:
        b, removed[1] = b - 1, removed[1] + 1
    return tuple(removed)
  for a in range(0, 30, 3):
    for b in range(0, 30, 2):
      for room in (5, 10, 34):
        assert sp.truncation(a, b, room) == bert(a, b, room)


def test_the_longer_side_is_truncated_and_counted():
  rng = np.random.default_rng(0)
  fronts = []
  for _ in range(200):
    a, b = np.arange(100, 120), np.arange(200, 203)
    e = sp._example(a, b, 0, CLS, SEP, 10, rng)
    ta, tb = parts(e)
    assert len(ta) == 7 and tb.tolist() == b.tolist() and e["truncated_tokens"] == 13
    assert (np.diff(ta) == 1).all()  # a contiguous part of A: cut from the ends
    fronts.append(ta[0] - 100)
  assert 5 < np.mean(fronts) < 8  # Binomial(13, 1/2) from the front: mean 6.5
  # Pairs are never dropped: over-long sentences are cut to fit, and counted.
  docs = [[np.arange(5, 45), np.arange(45, 85)], [np.arange(85, 125)]]
  examples = sp.create_pairs(docs, rng, max_length=13, cls_id=CLS, sep_id=SEP)
  assert examples and all(len(e["targets"]) == 13 and e["truncated_tokens"] > 0
                          for e in examples)


def test_worked_example_of_the_docstring():
  docs = [[np.array([5, 6]), np.array([7, 8, 9]), np.array([10])],
          [np.array([20, 21, 22]), np.array([23])]]
  seen = set()
  for seed in range(40):
    examples = sp._document_pairs(docs, 0, np.random.default_rng(seed), room=9, cls_id=CLS,
                                  sep_id=SEP, order="nsp", short_seq_prob=0.0,
                                  random_next_prob=0.5)
    for e in examples:
      seen.add((tuple(e["targets"].tolist()), int(e["sentence_label"])))
  assert ((2, 5, 6, 3, 7, 8, 9, 10, 3), 0) in seen
  assert ((2, 5, 6, 3, 20, 21, 22, 23, 3), 1) in seen
  # After a random B, [7 8 9] [10] go back: the next chunk pairs them (or a random B).
  assert any(t[:4] == (2, 7, 8, 9) for t, _ in seen)


def test_errors_name_the_fix():
  with pytest.raises(ConfigError, match="use >= 5"):
    sp.create_pairs([], np.random.default_rng(0), max_length=4, cls_id=CLS, sep_id=SEP)
  with pytest.raises(ConfigError, match="'nsp'.*'sop'"):
    sp.sentence_pair_preprocessors("mlm")


def test_full_sentences_worked_example_and_invariants():
  docs = [[np.array([5, 6]), np.array([7])], [np.array([8, 9])], [np.arange(10, 18)]]
  assert [p.tolist() for p in sp.full_sentences(docs, 6, SEP)] == [
      [5, 6, 7, 3, 8, 9], [10, 11, 12, 13, 14, 15], [16, 17]]
  rng = np.random.default_rng(5)
  for room in (11, 35, 62):
    docs, where = documents(rng, count=20, tokens=(2, 20))
    pieces = sp.full_sentences(docs, room, SEP)
    flat = np.concatenate(pieces)
    sentences = [s for d in docs for s in d]
    # Every token once, in order, a [SEP] where a document ends inside a piece.
    assert flat[flat != SEP].tolist() == np.concatenate(sentences).tolist()
    for piece in pieces:
      assert 0 < len(piece) <= room and piece[0] != SEP and piece[-1] != SEP
      for i in np.flatnonzero(piece == SEP):
        assert where[int(piece[i - 1])][0] + 1 == where[int(piece[i + 1])][0]
    # A sentence is only split when it is longer than a whole piece.
    starts = {int(s[0]): len(s) for s in sentences}
    for piece, following in zip(pieces, pieces[1:]):
      if int(following[0]) not in starts:
        head = int(following[0])
        sentence = next(s for s in sentences if head in s)
        assert len(sentence) > room or len(piece) == room
    assert np.mean([len(p) for p in pieces[:-1]]) > 0.8 * room  # full


def test_split_sentences_joins_wrapped_lines():
  assert sp.split_sentences("Return x.\nIt is\nbig. Ok.\n\nSee y.") == (
      "Return x.", "It is big.", "Ok.", "See y.")
  assert sp.split_sentences("") == ()
