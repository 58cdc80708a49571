"""WordPiece and byte-level BPE vocabularies (t5lite.data.vocab.hf_vocabularies): parity with
transformers' fast tokenizers, special tokens, save / load / pickle, deterministic training,
clear errors, HF export, and the special ids through the data pipeline.

Nothing is downloaded: the vocabularies are trained here on the embedded stdlib corpus, or
written by hand. transformers 5 takes the vocabulary file as `vocab=` (its `vocab_file=` is
silently ignored and gives a tokenizer of only the special tokens).
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
import transformers

from t5lite.data.objectives import token_objectives as objectives
from t5lite.data.objectives import chains as pretraining
from t5lite.data import preprocessors as pp
from t5lite.data.vocab.hf_training import train_byte_level_bpe, train_wordpiece
from t5lite.data.vocab.hf_vocabularies import ByteLevelBPEVocabulary, WordPieceVocabulary
from t5lite.data.registry import Feature
from t5lite.data.sources.stdlib_corpus import stdlib_documents
from t5lite.data.vocab.vocabularies import (ByteVocabulary, SentencePieceVocabulary,
                                            load_vocabulary, train_sentencepiece)
from t5lite.errors import ConfigError
from t5lite.interop.hf.tokenizer import write_hf_tokenizer

ROBERTA = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
EDGES = ["Héllo Wörld, naïve café Ærø façade", "ÅNGSTRÖM résumé São Paulo Düsseldorf",
         "中文字符 and 日本語のテキスト, 한국어", "emoji 🙂🚀 mixed 👩‍👩‍👧 in",
         "Ω ≈ ∑ ∞ — “quoted” ‘single’",
         "  two  spaces\tand tab ", "line\nbreak\r\nwindows", "control \x00\x07 chars \u200b zwsp",
         "combining e\u0301 and ﬁ ligature", "a [MASK] b [CLS]", "x <|endoftext|> y", "", " ",
         "snake_case_identifier(arg=1, **kwargs) -> None", "http://example.com/a?b=c&d=e#f",
         "A" * 150 + " long word", "naïve" * 30]


@pytest.fixture(scope="module")
def documents() -> list[str]:
  return [d["text"] for d in stdlib_documents()]


@pytest.fixture(scope="module")
def sentences(documents) -> list[str]:
  """A few hundred real lines of the embedded corpus, plus the edge cases."""
  lines = [line for text in documents[::7] for line in text.splitlines() if line.strip()]
  return lines[::max(1, len(lines) // 300)][:300] + EDGES


@pytest.fixture(scope="module")
def train_texts(documents) -> list[str]:
  return documents[:300]


@pytest.fixture(scope="module")
def wordpiece(train_texts) -> WordPieceVocabulary:
  return train_wordpiece(train_texts, 1500)


@pytest.fixture(scope="module")
def bpe(train_texts) -> ByteLevelBPEVocabulary:
  return train_byte_level_bpe(train_texts, 1500)


@pytest.fixture(scope="module")
def roberta(train_texts) -> ByteLevelBPEVocabulary:
  return train_byte_level_bpe(train_texts, 1000, special_tokens=ROBERTA)


def hand_tokens() -> list[str]:
  """BERT's layout by hand: [PAD] 0, [unused*], [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103."""
  words = ["the", "of", "return", "list", "string", "hello", "world", "naive", "cafe",
           "café", "naïve", "Hello", "World", "中", "文", "字", "符", "un", "##s",
           "##ing", "##ed", "##e", "##a", "##b", "##c", "##é", "##ï", "ab", "##cd"]
  return (["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
          + list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + list("abcdefghijklmnopqrstuvwxyz")
          + words)


@pytest.fixture(scope="module")
def hand_vocab_txt(tmp_path_factory) -> str:
  path = tmp_path_factory.mktemp("hand") / "vocab.txt"
  path.write_text("\n".join(hand_tokens()) + "\n", encoding="utf-8")
  return str(path)


def bert_fast(vocab: WordPieceVocabulary, tmp_path, **kwargs):
  path = tmp_path / "vocab.txt"
  path.write_text("".join(t + "\n" for t in vocab.tokens), encoding="utf-8")
  return transformers.BertTokenizerFast(vocab=str(path), **kwargs)


def bpe_fast(vocab: ByteLevelBPEVocabulary, tmp_path, cls=transformers.GPT2TokenizerFast):
  vocab.save(tmp_path)
  return cls(vocab=str(tmp_path / "vocab.json"), merges=str(tmp_path / "merges.txt"))


def assert_same_encodings(vocab, hf, texts):
  theirs = hf(texts, add_special_tokens=False).input_ids
  ours = vocab.encode_batch(texts)
  assert [o.tolist() for o in ours] == theirs
  assert [vocab.encode(t).tolist() for t in texts[:40]] == theirs[:40]  # one at a time too
  assert all(o.dtype == np.int32 for o in ours)
  return theirs


def assert_same_decodes(vocab, hf, rows):
  """decode = HF's decode(skip_special_tokens=True) of the ids before the first EOS."""
  for row in rows:
    cut = row[:row.index(vocab.eos_id)] if vocab.eos_id in row else row
    assert vocab.decode(row) == hf.decode(cut, skip_special_tokens=True), row


# --- parity with transformers -----------------------------------------------------------------

def test_trained_wordpiece_matches_bert_tokenizer_fast(wordpiece, sentences, tmp_path):
  hf = bert_fast(wordpiece, tmp_path)
  rows = assert_same_encodings(wordpiece, hf, sentences)
  assert_same_decodes(wordpiece, hf, rows)
  # Lower-cased, accents stripped, CJK split per character, as BERT's uncased tokenizer.
  assert wordpiece.encode("Héllo").tolist() == wordpiece.encode("hello").tolist()
  assert wordpiece.tokens[wordpiece.encode("a [MASK] b")[1]] == "[MASK]"
  flat = np.concatenate(rows[:300])
  assert np.mean(flat == wordpiece.unk_id) < 0.01  # a real subword vocabulary, few [UNK]


def test_hand_built_vocab_txt_matches_bert_tokenizer_fast(hand_vocab_txt, sentences):
  for lowercase in (True, False):
    vocab = WordPieceVocabulary(hand_vocab_txt, lowercase=lowercase)
    hf = transformers.BertTokenizerFast(vocab=hand_vocab_txt, do_lower_case=lowercase)
    rows = assert_same_encodings(vocab, hf, sentences)
    assert_same_decodes(vocab, hf, rows)
  cased = WordPieceVocabulary(hand_vocab_txt, lowercase=False)
  assert cased.tokens[cased.encode("café")[0]] == "café"  # kept as typed
  stripped = WordPieceVocabulary(hand_vocab_txt, lowercase=False, strip_accents=True)
  hf = transformers.BertTokenizerFast(vocab=hand_vocab_txt, do_lower_case=False,
                                      strip_accents=True)
  assert_same_encodings(stripped, hf, sentences)


def test_byte_level_bpe_matches_gpt2_tokenizer_fast(bpe, sentences, tmp_path):
  hf = bpe_fast(bpe, tmp_path)
  rows = assert_same_encodings(bpe, hf, sentences)
  assert_same_decodes(bpe, hf, rows)
  for text in sentences:  # bytes: every text round-trips (up to the first <|endoftext|>)
    if "<|endoftext|>" not in text:
      assert bpe.decode(bpe.encode(text)) == text


def test_roberta_layout_matches_roberta_tokenizer_fast(roberta, sentences, tmp_path):
  hf = bpe_fast(roberta, tmp_path, transformers.RobertaTokenizerFast)
  texts = sentences + ["a <mask> b <s> c </s> d <pad>"]
  rows = assert_same_encodings(roberta, hf, texts)
  assert_same_decodes(roberta, hf, rows)


# --- special tokens -------------------------------------------------------------------------

def test_special_ids_of_each_layout(wordpiece, bpe, roberta, hand_vocab_txt):
  assert wordpiece.special_tokens == {"pad": 0, "eos": 3, "unk": 1, "mask": 4, "cls": 2, "sep": 3}
  assert wordpiece.tokens[:5] == ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
  hand = WordPieceVocabulary(hand_vocab_txt)
  assert (hand.pad_id, hand.unk_id, hand.cls_id, hand.sep_id, hand.mask_id) == (0, 100, 101,
                                                                                 102, 103)
  # GPT-2: <|endoftext|> is eos, bos and unk; no pad, mask, cls or sep.
  assert bpe.special_tokens == {"eos": 0, "unk": 0, "bos": 0} and bpe.tokens[0] == "<|endoftext|>"
  assert bpe.pad_id is None and bpe.mask_id is None and bpe.style == "gpt2"
  assert roberta.special_tokens == {"pad": 1, "eos": 2, "unk": 3, "bos": 0, "mask": 4, "cls": 0,
                                    "sep": 2}
  assert roberta.style == "roberta"
  # decode stops at EOS, and skips the other specials (HF's skip_special_tokens).
  hello = wordpiece.encode("hello world").tolist()
  assert wordpiece.decode([2] + hello + [3] + hello) == "hello world"
  assert bpe.decode(bpe.encode("hi there").tolist() + [0, 5, 6]) == "hi there"
  assert bpe.decode([bpe.vocab_size + 3] + bpe.encode("ok").tolist()) == "ok"  # out of range


def test_t5_layout_special_ids_are_unchanged(documents):
  model = train_sentencepiece(documents[:50], 500)
  t5 = SentencePieceVocabulary(model, extra_ids=100)
  # mask: what the encoder-only family computes (<extra_id_0>, else unk).
  assert t5.special_tokens == {"pad": 0, "eos": 1, "unk": 2, "mask": t5.vocab_size - 1}
  assert (t5.bos_id, t5.cls_id, t5.sep_id) == (None, None, None)
  assert SentencePieceVocabulary(model, extra_ids=0).mask_id == 2
  assert ByteVocabulary().mask_id == 2 and ByteVocabulary(100).mask_id == 258 + 100


def test_lazy_vocabulary_delegates_special_ids(wordpiece):
  from t5lite_tasks.vocab import LazyVocabulary
  lazy = LazyVocabulary(load=lambda: wordpiece, description="test")
  assert lazy.special_tokens == wordpiece.special_tokens
  assert (lazy.pad_id, lazy.eos_id, lazy.unk_id, lazy.cls_id, lazy.mask_id) == (0, 3, 1, 2, 4)
  assert lazy.decode([2, 3]) == "" and lazy == wordpiece


# --- save, load, pickle, equality -------------------------------------------------------------

def test_save_load_pickle_and_equality(wordpiece, bpe, roberta, tmp_path):
  for i, vocab in enumerate([wordpiece, bpe, roberta]):
    directory = tmp_path / str(i)
    vocab.save(directory)
    config = json.loads((directory / "vocabulary.json").read_text())
    assert config["kind"] == vocab._kind and config["vocab_size"] == vocab.vocab_size
    assert not [p.name for p in directory.iterdir() if p.name.startswith(".")]  # no temporaries
    loaded = load_vocabulary(directory)
    assert loaded == vocab and hash(loaded) == hash(vocab) and type(loaded) is type(vocab)
    assert loaded.special_tokens == vocab.special_tokens
    copy = pickle.loads(pickle.dumps(vocab))
    assert copy == vocab and copy.encode_batch(EDGES)[0].tolist() == vocab.encode(EDGES[0]).tolist()
  assert sorted(p.name for p in (tmp_path / "0").iterdir()) == ["vocab.txt", "vocabulary.json"]
  assert sorted(p.name for p in (tmp_path / "1").iterdir()) == ["merges.txt", "vocab.json",
                                                                "vocabulary.json"]
  assert wordpiece != WordPieceVocabulary(wordpiece.tokens, lowercase=False)
  assert bpe != roberta and wordpiece != bpe


def test_load_an_hf_tokenizer_directory(hand_vocab_txt, bpe, tmp_path):
  bert = tmp_path / "bert"
  bert.mkdir()
  (bert / "vocab.txt").write_text(open(hand_vocab_txt, encoding="utf-8").read(), encoding="utf-8")
  assert load_vocabulary(bert) == WordPieceVocabulary(hand_vocab_txt)  # do_lower_case default
  (bert / "tokenizer_config.json").write_text('{"do_lower_case": false}')
  assert load_vocabulary(bert) == WordPieceVocabulary(hand_vocab_txt, lowercase=False)
  gpt2 = tmp_path / "gpt2"
  bpe.save(gpt2)
  (gpt2 / "vocabulary.json").unlink()  # only HF's files left
  assert load_vocabulary(gpt2) == bpe


# --- training -------------------------------------------------------------------------------

DETERMINISM = """
import sys
from t5lite.data.sources.stdlib_corpus import stdlib_documents
from t5lite.data.vocab.hf_training import train_byte_level_bpe, train_wordpiece
texts = [d["text"] for d in stdlib_documents()][:300]
print(train_wordpiece(texts, 1500)._key()[0], train_byte_level_bpe(texts, 1500)._key()[0])
"""


def test_training_is_deterministic_within_and_across_processes(train_texts, wordpiece, bpe):
  # tokenizers' trainer gives word-continuation symbols ids in hash-map order, seeded per
  # process (and per map): without train_wordpiece's fix, runs differed.
  assert train_wordpiece(train_texts, 1500) == wordpiece
  assert train_byte_level_bpe(iter(train_texts), 1500) == bpe
  out = subprocess.run([sys.executable, "-c", DETERMINISM], capture_output=True, text=True,
                       check=True, timeout=120).stdout.split()
  assert out == [wordpiece._key()[0], bpe._key()[0]]
  assert wordpiece.vocab_size == bpe.vocab_size == 1500


def test_training_options_and_errors(train_texts):
  cased = train_wordpiece(train_texts[:50], 400, lowercase=False)
  assert not cased.lowercase and cased.decode(cased.encode("The Python")) == "The Python"
  with pytest.raises(ConfigError, match="no text"):
    train_wordpiece(["", "  "], 100)
  with pytest.raises(ConfigError, match="no text"):
    train_byte_level_bpe(iter([]), 1000)
  with pytest.raises(ConfigError, match="256 byte"):
    train_byte_level_bpe(train_texts, 200)


# --- bad files --------------------------------------------------------------------------------

def write(path, text: str | bytes):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
  return path


def test_bad_vocab_files_name_the_file_and_the_fix(tmp_path, bpe):
  vocab_json = json.dumps(dict(zip(bpe.tokens, range(bpe.vocab_size))))
  merges = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in bpe.merges)
  vocab_txt = {"a.txt": b"[UNK]\n\xff\xfe\n", "b.txt": "[UNK]\n\nx\n", "c.txt": "[UNK]\nx\nx\n",
               "d.txt": "[PAD]\nx\n"}
  for name, content in vocab_txt.items():
    write(tmp_path / name, content)
  cases = [
      (lambda: WordPieceVocabulary(tmp_path / "nope.txt"), "not found: .*nope.txt"),
      (lambda: WordPieceVocabulary(tmp_path / "a.txt"), "a.txt is not UTF-8"),
      (lambda: WordPieceVocabulary(tmp_path / "b.txt"), "b.txt line 2 is empty"),
      (lambda: WordPieceVocabulary(tmp_path / "c.txt"), "'x' appears twice"),
      (lambda: WordPieceVocabulary(tmp_path / "d.txt"), "d.txt has no \\[UNK\\]"),
      (lambda: ByteLevelBPEVocabulary(write(tmp_path / "e.json", "{not json"), tmp_path / "m"),
       "e.json is not JSON"),
      (lambda: ByteLevelBPEVocabulary({"a": 0, "b": 2}, []), "id 1 is missing"),
      (lambda: ByteLevelBPEVocabulary({"[x]": 0, "[y]": 1}, []), "lacks 256 of the 256 byte"),
      (lambda: ByteLevelBPEVocabulary(write(tmp_path / "f.json", vocab_json),
                                      write(tmp_path / "m1.txt", "#version: 0.2\nĠ t x\n")),
       "m1.txt line 2: 'Ġ t x' is not a merge"),
      (lambda: ByteLevelBPEVocabulary(write(tmp_path / "g.json", vocab_json),
                                      write(tmp_path / "m2.txt", merges + "zqzq xq\n")),
       "needs 'zqzq', which the vocab lacks"),
  ]
  for make, message in cases:
    with pytest.raises(ConfigError, match=message):
      make()
  # vocabulary.json names a kind whose files are gone; a bad tokenizer_config.json.
  write(tmp_path / "w" / "vocabulary.json", '{"kind": "wordpiece", "extra_ids": 0}')
  with pytest.raises(FileNotFoundError, match="wordpiece vocabulary, but its vocab.txt"):
    load_vocabulary(tmp_path / "w")
  write(tmp_path / "h" / "vocab.txt", "[UNK]\n")
  write(tmp_path / "h" / "tokenizer_config.json", "{oops")
  with pytest.raises(ConfigError, match="tokenizer_config.json is not JSON"):
    load_vocabulary(tmp_path / "h")
  with pytest.raises(FileNotFoundError, match="merges.txt or tokenizer.json"):
    load_vocabulary(tmp_path / "empty")


# --- export -----------------------------------------------------------------------------------

def test_export_loads_in_transformers_and_encodes_the_same(wordpiece, bpe, roberta, sentences,
                                                          tmp_path):
  expected = {"wordpiece": ("BertTokenizer", ["vocab.txt"]),
              "gpt2": ("GPT2Tokenizer", ["merges.txt", "vocab.json"]),
              "roberta": ("RobertaTokenizer", ["merges.txt", "vocab.json"])}
  for name, vocab in (("wordpiece", wordpiece), ("gpt2", bpe), ("roberta", roberta)):
    out = tmp_path / name
    out.mkdir()
    files = write_hf_tokenizer(vocab, str(out), model_max_length=256)
    hf_class, vocab_files = expected[name]
    assert files == sorted(vocab_files + ["special_tokens_map.json", "tokenizer.json",
                                          "tokenizer_config.json"])
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == hf_class and config["model_max_length"] == 256
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert type(tokenizer).__name__ == hf_class
    assert_same_encodings(vocab, tokenizer, sentences)
    ids = vocab.encode("hello world").tolist()
    with_specials = tokenizer("hello world").input_ids
    if name == "gpt2":
      assert with_specials == ids
    else:
      assert with_specials == [vocab.cls_id] + ids + [vocab.sep_id]
    assert tokenizer.pad_token_id == vocab.pad_id and tokenizer.mask_token_id == vocab.mask_id
    assert load_vocabulary(out) == vocab  # the exported folder reads back as the vocabulary
  assert json.loads((tmp_path / "wordpiece" / "tokenizer_config.json").read_text())[
      "do_lower_case"] is True


# --- the special ids through the pipeline ---------------------------------------------------

def test_append_eos_uses_the_vocabulary_eos(wordpiece, bpe):
  t5 = ByteVocabulary()
  ex = {"targets": np.array([5, 6], np.int32)}
  assert pp.append_eos(ex, {"targets": Feature(t5)})["targets"].tolist() == [5, 6, 1]
  assert pp.append_eos(ex, {"targets": Feature(wordpiece)})["targets"].tolist() == [5, 6, 3]
  out = pp.append_eos_after_trim(ex, {"targets": Feature(bpe)}, {"targets": 2})
  assert out["targets"].tolist() == [5, 0]
  no_eos = WordPieceVocabulary(["[UNK]", "a"])
  with pytest.raises(ConfigError, match="no EOS token: set add_eos=False"):
    pp.append_eos(ex, {"targets": Feature(no_eos)})


def test_mlm_random_tokens_skip_specials_anywhere():
  tokens = np.arange(200, 2200, dtype=np.int32)
  specials = (0, 100, 101, 102, 103, 2999)
  out = objectives.mlm(tokens, seed=3, vocab_size=3000, mask_id=103, random_rate=1.0,
                       keep_rate=0.0, special_ids=specials, random_above_specials=False)
  drawn = out["inputs"][out["weights"] > 0]
  assert drawn.size == 300 and not np.isin(drawn, specials).any()
  assert drawn.min() < 100 and drawn.max() < 2999


def test_mlm_preprocessor_wraps_pieces_and_never_masks_specials(wordpiece):
  steps = pretraining.mlm_preprocessors(add_cls_sep=True, vocabulary_specials=True,
                                        mask_rate=0.5)
  features = {"targets": Feature(wordpiece, add_eos=False)}
  mask = steps[-1]
  assert steps[1].__name__ == "concat_and_split"
  rng = np.random.default_rng(0)
  text = wordpiece.encode("a [MASK] in the middle of [CLS] some words " * 3)
  for _ in range(20):
    ex = mask({"targets": text}, rng=rng, output_features=features)
    assert ex["targets"][0] == wordpiece.cls_id and ex["targets"][-1] == wordpiece.sep_id
    special = np.isin(ex["targets"], list(wordpiece.special_tokens.values()))
    assert special.sum() == 8 and not ex["weights"][special].any()
    assert ((ex["inputs"] == wordpiece.mask_id) <= (special | (ex["weights"] > 0))).all()
    random = (ex["weights"] > 0) & (ex["inputs"] != ex["targets"])
    assert not np.isin(ex["inputs"][random], [0, 1, 2, 3]).any()
