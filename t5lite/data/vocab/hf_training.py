"""Training BERT's WordPiece and GPT-2's byte-level BPE vocabularies in process, with the
`tokenizers` library's trainers (t5lite.data.vocab.hf_vocabularies holds the vocabularies).

Deterministic: the same texts and arguments give the same vocabulary in every process, which
`tokenizers`' trainers alone do not (train_wordpiece says why and what it adds)."""
from __future__ import annotations

import json
from typing import Iterable, Sequence

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from t5lite.data.vocab.hf_vocabularies import (BERT_SPECIALS, BYTE_ALPHABET, GPT2_EOS,
                                               ByteLevelBPEVocabulary, WordPieceVocabulary,
                                               bert_normalizer)
from t5lite.errors import ConfigError


def _texts(texts: Iterable[str], name: str) -> list[str]:
  texts = [t for t in texts if t.strip()]
  if not texts:
    raise ConfigError(f"{name}: no text to train on (the iterator is empty or holds only "
                      "blank strings)")
  return texts


def train_wordpiece(texts: Iterable[str], vocab_size: int, *, lowercase: bool = True,
                    strip_accents: bool | None = None,
                    min_frequency: int = 2) -> WordPieceVocabulary:
  """Trains a BERT WordPiece vocabulary in process with `tokenizers`' WordPieceTrainer.

  Ids: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, then every `##c` continuation symbol
  (sorted), the alphabet (sorted), and the learned pieces. Pairs seen fewer than
  min_frequency times are not merged (HF's BertWordPieceTokenizer default, 2), so a small
  corpus may give fewer than vocab_size tokens.

  Deterministic across processes, which the trainer alone is not: it gives each `##c` its
  id in the order it meets words in a per-process randomly seeded hash map, and ranks merges
  of equal count by id, so two runs learned different pieces. Declaring the `##c` symbols
  up front, sorted, as (trainer) special tokens fixes their ids; they come out as ordinary
  tokens of the vocabulary.
  """
  texts = _texts(texts, "train_wordpiece")
  normalizer, pre = bert_normalizer(lowercase, strip_accents), pre_tokenizers.BertPreTokenizer()
  continuations = sorted({c for text in texts
                          for word, _ in pre.pre_tokenize_str(normalizer.normalize_str(text))
                          for c in word[1:]})
  tokenizer = Tokenizer(models.WordPiece(unk_token=BERT_SPECIALS["unk"]))
  tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre
  trainer = trainers.WordPieceTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
      special_tokens=[*BERT_SPECIALS.values(), *("##" + c for c in continuations)])
  tokenizer.train_from_iterator(texts, trainer)
  vocab = tokenizer.get_vocab()
  return WordPieceVocabulary(sorted(vocab, key=vocab.__getitem__), lowercase=lowercase,
                             strip_accents=strip_accents)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, *,
                         special_tokens: Sequence[str] = (GPT2_EOS,),
                         min_frequency: int = 2) -> ByteLevelBPEVocabulary:
  """Trains a GPT-2 byte-level BPE vocabulary in process with `tokenizers`' BpeTrainer.

  Ids: the special tokens first (GPT-2's <|endoftext|> = 0 by default, which makes the
  converters' BOS, id 0 at each segment start, GPT-2's own <|endoftext|>; pass RoBERTa's
  ("<s>", "<pad>", "</s>", "<unk>", "<mask>") for its layout), the 256 byte symbols
  (sorted), then one token per merge. Every byte is in the alphabet whether the texts use it
  or not, so any text encodes, and the alphabet's ids do not depend on the order the trainer
  meets words in (see train_wordpiece): deterministic across processes.
  """
  if vocab_size < len(BYTE_ALPHABET) + len(special_tokens):
    raise ConfigError(f"train_byte_level_bpe: vocab_size {vocab_size} is below the 256 byte "
                      f"symbols + {len(special_tokens)} special tokens")
  texts = _texts(texts, "train_byte_level_bpe")
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                show_progress=False, special_tokens=list(special_tokens),
                                initial_alphabet=sorted(BYTE_ALPHABET))
  tokenizer.train_from_iterator(texts, trainer)
  # tokenizers >= 0.20 writes merges as pairs, older versions as "left right" strings.
  merges = json.loads(tokenizer.to_str())["model"]["merges"]
  return ByteLevelBPEVocabulary(tokenizer.get_vocab(), merges)
