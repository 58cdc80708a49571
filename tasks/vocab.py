"""The default vocabulary of the registered tasks: T5's `spiece.model`, loaded on first use.

Tasks register at import time and must not need the file then; the vocabulary is read the
first time something encodes, decodes or asks its size. Point `T5LITE_VOCAB` at it:

  export T5LITE_VOCAB=/path/to/t5-base/spiece.model   # a T5 sentencepiece model file, or
  export T5LITE_VOCAB=/path/to/t5-base                 # a directory holding spiece.model
                                                       # (an HF checkpoint or a t5lite MODEL_DIR)

A file gets T5's 100 extra ids (vocab_size 32100 for T5's 32000 pieces); a directory loads
as `t5lite.data.vocab.vocabularies.load_vocabulary` reads it.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from t5lite.data.registry import Feature
from t5lite.data.vocab.vocabularies import SentencePieceVocabulary, Vocabulary, load_vocabulary

VOCAB_ENV = "T5LITE_VOCAB"
EXTRA_IDS = 100


def load_from_env(env_var: str = VOCAB_ENV) -> Vocabulary:
  """Reads the vocabulary that $env_var points at (a spiece.model file or a directory)."""
  path = os.environ.get(env_var)
  if not path:
    raise RuntimeError(
        f"the default vocabulary is not set: environment variable {env_var} is unset. Set it "
        f"to T5's sentencepiece model, e.g. `export {env_var}=/path/to/t5-base/spiece.model` "
        "(the spiece.model file of a Hugging Face T5 checkpoint, or a directory holding it), "
        "or register your task with a vocabulary of its own.")
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    return load_vocabulary(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{env_var}={path!r}: no such file or directory (expected T5's "
                            "spiece.model, or a directory holding it)")
  return SentencePieceVocabulary(path, extra_ids=EXTRA_IDS)


class LazyVocabulary(Vocabulary):
  """A Vocabulary that builds the real one on first use and delegates everything to it.

  Registration only stores this object; `vocab.encode("hi")` (or vocab_size, decode,
  save, ...) calls `load()` once and caches the result. Pickles without the loaded
  vocabulary (each process loads its own), so `load` must be a module-level function.
  """

  def __init__(self, load=load_from_env, description: str = f"${VOCAB_ENV}"):
    super().__init__(extra_ids=0)
    self._load, self._description, self._vocab = load, description, None

  @property
  def vocabulary(self) -> Vocabulary:
    """The real vocabulary (loaded now if it is not yet)."""
    if self._vocab is None:
      self._vocab = self._load()
    return self._vocab

  # Everything the base class computes from these is delegated through them.
  @property
  def extra_ids(self) -> int:
    return self.vocabulary.extra_ids

  @property
  def vocab_size(self) -> int:
    return self.vocabulary.vocab_size

  @property
  def _base_vocab_size(self) -> int:
    return self.vocabulary.vocab_size - self.vocabulary.extra_ids

  # The special ids too: the class attributes inherited from Vocabulary are T5's, which a
  # WordPiece or byte-level BPE vocabulary (t5lite.data.vocab.hf_vocabularies) does not share.
  pad_id = property(lambda self: self.vocabulary.pad_id)
  eos_id = property(lambda self: self.vocabulary.eos_id)
  unk_id = property(lambda self: self.vocabulary.unk_id)
  bos_id = property(lambda self: self.vocabulary.bos_id)
  mask_id = property(lambda self: self.vocabulary.mask_id)
  cls_id = property(lambda self: self.vocabulary.cls_id)
  sep_id = property(lambda self: self.vocabulary.sep_id)
  special_tokens = property(lambda self: self.vocabulary.special_tokens)

  # encode / encode_batch straight to the real vocabulary: through _encode_many the ids
  # would go array -> list -> array, more than the tokenizing itself for short texts.
  def encode(self, text: str) -> np.ndarray:
    return self.vocabulary.encode(text)

  def encode_batch(self, texts) -> list[np.ndarray]:
    return self.vocabulary.encode_batch(texts)

  def _encode_many(self, texts: list[str]) -> list[list[int]]:
    return [list(ids) for ids in self.vocabulary.encode_batch(texts)]

  def _decode_many(self, rows: list[list[int]]) -> list[str]:
    return self.vocabulary.decode_batch(rows)

  def _key(self) -> tuple:
    return (type(self.vocabulary).__name__,) + self.vocabulary._key()

  def save(self, directory) -> None:
    self.vocabulary.save(directory)  # As the real one: MODEL_DIR must not depend on $VARS.

  def __eq__(self, other: Any) -> bool:
    other = other.vocabulary if isinstance(other, LazyVocabulary) else other
    return self.vocabulary == other

  def __hash__(self) -> int:
    return hash(self.vocabulary)

  def __getattr__(self, name: str) -> Any:
    # Only reached for attributes the class lacks (tokenizer, serialized_model, ...).
    if name.startswith("__") or name in ("_load", "_description", "_vocab"):
      raise AttributeError(name)
    return getattr(self.vocabulary, name)

  def __getstate__(self) -> dict:
    return {**self.__dict__, "_vocab": None}

  def __repr__(self) -> str:
    loaded = repr(self._vocab) if self._vocab is not None else "not loaded yet"
    return f"LazyVocabulary({self._description}: {loaded})"


_DEFAULT = LazyVocabulary()


def default_vocabulary() -> Vocabulary:
  """T5's vocabulary from $T5LITE_VOCAB, read on first use (one shared object)."""
  return _DEFAULT


def default_output_features(vocabulary: Vocabulary | None = None) -> dict[str, Feature]:
  """T5's DEFAULT_OUTPUT_FEATURES: inputs (optional) and targets, both with EOS."""
  if vocabulary is None:
    vocabulary = default_vocabulary()
  return {"inputs": Feature(vocabulary, add_eos=True, required=False),
          "targets": Feature(vocabulary, add_eos=True)}
