"""Vocabularies: T5 id layout, extra ids, byte-fallback round trips, save/load, training."""
from __future__ import annotations

import inspect
import json
import pickle
import textwrap

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from t5lite.data.vocab import vocabularies as vocab_lib
from t5lite.data.vocab.vocabularies import (ByteVocabulary, SentencePieceVocabulary,
                                            load_vocabulary, train_sentencepiece)

VOCAB = 400
EXTRA = 10
UNICODE = ["héllo wörld", "naïve café Ærø", "中文字符 and 日本語", "emoji 🙂🚀 mixed",
           "  two  spaces\tand tab ", "line\nbreak", ""]
# Any text: no lone surrogates (not encodable), no U+2581 (sentencepiece's space mark).
TEXT_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581")


def corpus() -> list[str]:
  """Real English text: docstrings of a few stdlib modules."""
  texts = []
  for module in (json, inspect, textwrap, pickle):
    for name in sorted(dir(module)):
      doc = getattr(getattr(module, name), "__doc__", None)
      if isinstance(doc, str):
        texts.append(doc)
  return texts


@pytest.fixture(scope="module")
def models() -> dict[str, bytes]:
  texts = corpus()
  return {t: train_sentencepiece(texts, VOCAB, model_type=t) for t in ("unigram", "bpe")}


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def vocab(request, models) -> SentencePieceVocabulary:
  return SentencePieceVocabulary(models[request.param], extra_ids=EXTRA)


@pytest.fixture(scope="module")
def both_vocabs(models) -> list[SentencePieceVocabulary]:
  return [SentencePieceVocabulary(m, extra_ids=EXTRA) for m in models.values()]


def test_t5_special_ids(vocab):
  sp = vocab.tokenizer
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
  assert sp.bos_id() == -1


def test_extra_id_layout(vocab):
  assert vocab.vocab_size == VOCAB + EXTRA and vocab.extra_ids == EXTRA
  assert vocab.extra_id(0) == vocab.vocab_size - 1
  assert vocab.extra_id(EXTRA - 1) == VOCAB
  assert vocab.tokenizer.id_to_piece(vocab.extra_id(0)) == "<extra_id_0>"
  assert vocab.tokenizer.id_to_piece(VOCAB) == f"<extra_id_{EXTRA - 1}>"
  with pytest.raises(ValueError):
    vocab.extra_id(-1)


def test_default_extra_ids_are_100(models):
  vocab = SentencePieceVocabulary(models["unigram"])
  assert vocab.vocab_size == VOCAB + 100 and vocab.extra_id(0) == VOCAB + 99


@pytest.mark.parametrize("text", ["<extra_id_5>", "a <extra_id_0> b", "x<extra_id_3>y z"])
def test_extra_id_is_one_piece_in_running_text(vocab, text):
  ids = vocab.encode(text).tolist()
  for n in (0, 3, 5):
    if f"<extra_id_{n}>" in text:
      assert ids.count(vocab.extra_id(n)) == 1
  assert vocab.decode(ids) == text


def test_decode_extra_ids_and_out_of_range(vocab):
  hello = vocab.encode("hello").tolist()
  assert vocab.decode(hello + [vocab.extra_id(2)]) == "hello<extra_id_2>"
  # Ids of a model vocab padded past vocab_size (e.g. 32128) decode as nothing.
  assert vocab.decode(hello + [vocab.vocab_size, vocab.vocab_size + 27]) == "hello"


@pytest.mark.parametrize("text", UNICODE)
def test_unicode_round_trip(vocab, text):
  ids = vocab.encode(text)
  assert ids.dtype == np.int32 and ids.ndim == 1
  assert vocab.unk_id not in ids.tolist()  # Byte fallback: nothing is unknown.
  assert vocab.decode(ids) == text


@hypothesis.settings(max_examples=50, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(text=st.text(TEXT_CHARS))
def test_round_trip_property(both_vocabs, text):
  for vocab in both_vocabs:
    assert vocab.decode(vocab.encode(text)) == text


def test_decode_stops_at_eos_and_skips_pad(vocab):
  a, b = vocab.encode("hello").tolist(), vocab.encode("world").tolist()
  assert vocab.decode([0] + a + [0, 0]) == "hello"
  assert vocab.decode(a + [1] + b) == "hello"
  assert vocab.decode(np.array(a + [1, 0, 0], np.int32)) == "hello"
  assert vocab.decode([1] + a) == ""
  width = max(len(a), len(b)) + 2
  rows = [ids + [1] + [0] * (width - len(ids) - 1) for ids in (a, b)]
  assert vocab.decode_batch(np.array(rows, np.int32)) == ["hello", "world"]
  assert vocab.decode_batch([a, b + [1] + a]) == ["hello", "world"]  # Ragged rows are fine.


def test_encode_batch_equals_encode(vocab):
  texts = UNICODE + ["a <extra_id_1> b"]
  batch = vocab.encode_batch(texts)
  assert len(batch) == len(texts)
  for ids, text in zip(batch, texts):
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, vocab.encode(text))
  assert vocab.encode_batch([]) == []


def test_save_load_round_trip(vocab, tmp_path):
  vocab.save(tmp_path)
  config = json.loads((tmp_path / "vocabulary.json").read_text())
  assert config["kind"] == "sentencepiece" and config["extra_ids"] == EXTRA
  loaded = load_vocabulary(tmp_path)
  assert loaded == vocab and hash(loaded) == hash(vocab)
  assert loaded.encode("héllo <extra_id_1>").tolist() == vocab.encode("héllo <extra_id_1>").tolist()
  # spiece.model holds the model as trained (no extra ids), like a T5 / HF checkpoint.
  assert (tmp_path / "spiece.model").read_bytes() == vocab.serialized_model


def test_load_from_model_file_and_hf_dir(models, tmp_path):
  (tmp_path / "spiece.model").write_bytes(models["bpe"])
  assert SentencePieceVocabulary(tmp_path / "spiece.model", 100) == SentencePieceVocabulary(
      models["bpe"], 100)
  assert load_vocabulary(tmp_path).extra_ids == 100  # No vocabulary.json: T5Tokenizer's default.


def test_equality_and_pickle(models):
  a = SentencePieceVocabulary(models["unigram"], extra_ids=EXTRA)
  assert a == SentencePieceVocabulary(models["unigram"], extra_ids=EXTRA)
  assert a != SentencePieceVocabulary(models["unigram"], extra_ids=EXTRA + 1)
  assert a != SentencePieceVocabulary(models["bpe"], extra_ids=EXTRA)
  assert a != ByteVocabulary(EXTRA)
  assert len({a, SentencePieceVocabulary(models["unigram"], extra_ids=EXTRA)}) == 1
  b = pickle.loads(pickle.dumps(a))
  assert b == a and b.encode("héllo").tolist() == a.encode("héllo").tolist()


def test_byte_vocabulary_layout_and_round_trip(tmp_path):
  vocab = ByteVocabulary()
  assert vocab.vocab_size == 259 and ByteVocabulary(125).vocab_size == 384
  assert ByteVocabulary(125).extra_id(0) == 383
  assert vocab.encode("hé").tolist() == [104 + 3, 0xC3 + 3, 0xA9 + 3]
  for text in UNICODE:
    assert vocab.decode(vocab.encode(text)) == text
  assert vocab.decode([107, 108, 0, 1, 107]) == "hi"
  assert vocab.decode([107, 0xC3 + 3, 1]) == "h"  # Cut multi-byte char: dropped.
  assert vocab.decode([107, 300, 259]) == "h"  # Extra / out-of-range ids: dropped.
  assert [a.tolist() for a in vocab.encode_batch(["a", ""])] == [[100], []]
  ByteVocabulary(7).save(tmp_path)
  assert load_vocabulary(tmp_path) == ByteVocabulary(7) != ByteVocabulary(8)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(text=st.text(st.characters(blacklist_categories=("Cs",))))
def test_byte_round_trip_property(text):
  vocab = ByteVocabulary(3)
  assert vocab.decode(vocab.encode(text)) == text


def test_training_is_deterministic(models):
  texts = corpus()
  assert train_sentencepiece(texts, VOCAB, model_type="bpe") == models["bpe"]
  assert train_sentencepiece(iter(texts), VOCAB, model_type="unigram") == models["unigram"]


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.model"):
    SentencePieceVocabulary(tmp_path / "nope.model")
  with pytest.raises(ValueError, match="no text"):
    train_sentencepiece(iter([]), VOCAB)
  with pytest.raises(ValueError, match="no text"):
    train_sentencepiece(["", "  \n"], VOCAB)
  with pytest.raises(ValueError, match="'unigram', 'bpe'"):
    train_sentencepiece(["some text"], VOCAB, model_type="word")
  with pytest.raises(FileNotFoundError, match="vocabulary.json"):
    load_vocabulary(tmp_path)
  (tmp_path / "vocabulary.json").write_text('{"kind": "wordpiece", "extra_ids": 0}')
  with pytest.raises(ValueError, match="wordpiece"):
    load_vocabulary(tmp_path)
  assert vocab_lib.MODEL_TYPES == ("unigram", "bpe")
