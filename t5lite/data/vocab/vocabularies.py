"""Vocabularies: text <-> int32 ids; here the T5 layout (pad 0, eos 1, unk 2, extra ids on top).

Two kinds here: SentencePieceVocabulary (T5, mT5, own models from `train_sentencepiece`)
and ByteVocabulary (ByT5). Extra ids (span-corruption sentinels) are the highest ids, in
reverse: `<extra_id_0>` is `vocab_size - 1`. BERT's WordPiece and GPT-2 / RoBERTa's
byte-level BPE, built on HF `tokenizers`, are in hf_vocabularies.py. A vocabulary saves
itself to a directory (`vocabulary.json` + its kind's files, e.g. `spiece.model`) so that
MODEL_DIR describes its own tokenizer; `load_vocabulary` reads any kind back.

Special tokens are part of every vocabulary's API: `pad_id`, `eos_id`, `unk_id`, `bos_id`,
`mask_id`, `cls_id`, `sep_id` (None where the vocabulary has no such token) and
`special_tokens` ({role: id} of those it has). The T5 layout: pad 0, eos 1, unk 2, no bos,
cls or sep; mask is `<extra_id_0>` (the highest id) when there are extra ids, else unk.
"""
from __future__ import annotations

import abc
import hashlib
import io
import itertools
import json
import os
import pathlib
from typing import Any, ClassVar, Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm
from google.protobuf.message import DecodeError
from sentencepiece import sentencepiece_model_pb2

from t5lite.util import atomic, paths, storage
from t5lite.errors import ConfigError, ConfigFileNotFoundError

CONFIG_FILE = "vocabulary.json"
SPIECE_FILE = "spiece.model"
MODEL_TYPES = ("unigram", "bpe")
SPECIAL_ROLES = ("pad", "eos", "unk", "bos", "mask", "cls", "sep")


class Vocabulary(abc.ABC):
  """Maps text to int32 ids and back. Subclasses implement the _methods.

  The class attributes are T5's layout (pad 0, eos 1, unk 2; no bos, cls or sep); a
  vocabulary of another layout overrides them (None: it has no such token). Subclasses that
  set `_kind` are what load_vocabulary dispatches on (see _load / _load_hf_directory).
  """

  pad_id: int | None = 0
  eos_id: int | None = 1
  unk_id: int | None = 2
  bos_id: int | None = None
  cls_id: int | None = None
  sep_id: int | None = None
  _kind: str  # The `kind` in vocabulary.json ("sentencepiece", "byte", "wordpiece", ...).
  _KINDS: ClassVar[dict[str, type[Vocabulary]]] = {}  # kind -> class, for load_vocabulary

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    # A kind defined in another module (hf_vocabularies.py, which imports this one) registers
    # here: load_vocabulary cannot import it without an import cycle.
    if "_kind" in cls.__dict__:
      Vocabulary._KINDS[cls._kind] = cls

  def __init__(self, extra_ids: int = 0):
    if extra_ids < 0:
      raise ConfigError(f"extra_ids must be >= 0, got {extra_ids}")
    self._extra_ids = int(extra_ids)

  @property
  def extra_ids(self) -> int:
    return self._extra_ids

  @property
  def vocab_size(self) -> int:
    """Number of ids, extra ids included (a model's embedding may be padded beyond it)."""
    return self._base_vocab_size + self._extra_ids

  @property
  def mask_id(self) -> int | None:
    """The MLM mask token. T5's layout has none of its own: `<extra_id_0>` (the highest id)
    when there are extra ids, else unk (what the encoder-only family has always used)."""
    return self.extra_id(0) if self.extra_ids else self.unk_id

  @property
  def special_tokens(self) -> dict[str, int]:
    """{role: id} for the roles of SPECIAL_ROLES this vocabulary has, e.g. T5 with 100 extra
    ids and 32000 pieces: {"pad": 0, "eos": 1, "unk": 2, "mask": 32099}."""
    ids = {role: getattr(self, f"{role}_id") for role in SPECIAL_ROLES}
    return {role: i for role, i in ids.items() if i is not None}

  def extra_id(self, i: int) -> int:
    """Id of `<extra_id_i>`: counted down from the top, so extra_id(0) = vocab_size - 1.

    i may exceed extra_ids: ByT5 (extra_ids=0) takes its sentinels from the top byte ids.
    """
    if not 0 <= i < self.vocab_size - 3:
      raise ValueError(f"extra id {i} out of range for vocab_size {self.vocab_size}")
    return self.vocab_size - 1 - i

  def encode(self, text: str) -> np.ndarray:
    """Text -> 1-D int32 ids, no EOS appended."""
    return np.asarray(self._encode_many([text])[0], np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    """Like [encode(t) for t in texts], in one call into the tokenizer."""
    return [np.asarray(ids, np.int32) for ids in self._encode_many(list(texts))]

  def decode(self, ids) -> str:
    """1-D ids -> text. Stops at the first EOS; drops pad and ids outside the vocabulary
    (the HF kinds, hf_vocabularies.py, also every special token, as HF's decode does).

    Example (bytes): [107, 108, 0, 1, 107] -> "hi"  (pad skipped, stop at eos)
    """
    return self._decode_many([self._clean(ids)])[0]

  def decode_batch(self, batch) -> list[str]:
    """2-D array (or sequence of 1-D id sequences) -> one string per row."""
    return self._decode_many([self._clean(ids) for ids in batch])

  def _clean(self, ids) -> list[int]:
    ids = np.asarray(ids).reshape(-1).tolist()
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    # Padded model vocabularies (32100 -> 32128) can emit ids past vocab_size: drop them.
    return [i for i in ids if i != self.pad_id and 0 <= i < self.vocab_size]

  def save(self, directory: str | os.PathLike) -> None:
    """Writes vocabulary.json (kind, extra_ids, vocab_size) and the kind's own files."""
    paths.makedirs(directory)
    directory = storage.path(directory)  # a pathlib.Path, or epath's for a bucket URL
    config = dict(kind=self._kind, extra_ids=self.extra_ids, vocab_size=self.vocab_size)
    self._save_files(directory, config)
    # Whole files or none (a killed save must not leave a cut-short spiece.model); the
    # config last, so a folder with one has its model too.
    atomic.write_file(str(directory / CONFIG_FILE), json.dumps(config, indent=2) + "\n")

  def __eq__(self, other: Any) -> bool:
    return type(self) is type(other) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash((type(self).__name__,) + self._key())

  def __repr__(self) -> str:
    return f"{type(self).__name__}(vocab_size={self.vocab_size}, extra_ids={self.extra_ids})"

  @property
  @abc.abstractmethod
  def _base_vocab_size(self) -> int:
    """Ids before the extra ids."""

  @abc.abstractmethod
  def _encode_many(self, texts: list[str]) -> list[list[int]]:
    ...

  @abc.abstractmethod
  def _decode_many(self, rows: list[list[int]]) -> list[str]:
    """Decodes rows already cleaned of eos, pad and out-of-range ids."""

  @abc.abstractmethod
  def _key(self) -> tuple:
    """Hashable content that defines the vocabulary (for __eq__ / __hash__)."""

  def _save_files(self, directory: pathlib.Path, config: dict) -> None:
    del directory, config  # Nothing beyond vocabulary.json by default.

  @classmethod
  def _load(cls, directory: pathlib.Path, config: dict) -> Vocabulary:
    """The vocabulary that save() wrote into directory, given its vocabulary.json."""
    raise NotImplementedError(f"{cls.__name__} cannot be loaded from a directory")

  @classmethod
  def _load_hf_directory(cls, directory: pathlib.Path) -> Vocabulary | None:
    """This kind from an HF tokenizer directory (no vocabulary.json), or None if it is not
    one of this kind's."""
    del directory
    return None


class SentencePieceVocabulary(Vocabulary):
  """A sentencepiece model with `extra_ids` sentinels appended, exactly like T5/seqio.

  With a 32000-piece model and 100 extra ids: vocab_size 32100, `<extra_id_0>` = 32099,
  `<extra_id_99>` = 32000. The sentinels are added to the model proto as user-defined
  pieces, so the text `<extra_id_5>` encodes to the single id vocab_size - 6 even in
  running text, and decodes back to `<extra_id_5>`.
  """

  _kind = "sentencepiece"

  def __init__(self, model: str | os.PathLike | bytes, extra_ids: int = 100):
    super().__init__(extra_ids)
    if isinstance(model, (bytes, bytearray)):
      self._model, where = bytes(model), "the sentencepiece model bytes"
    else:
      model = storage.path(model)
      if not model.is_file():
        raise ConfigFileNotFoundError(f"sentencepiece model file not found: {model}")
      self._model, where = model.read_bytes(), str(model)
    self._sp, self._num_pieces = self._processor(where)
    layout = (self._sp.pad_id(), self._sp.eos_id(), self._sp.unk_id())
    if layout != (self.pad_id, self.eos_id, self.unk_id):
      raise ConfigError(f"sentencepiece model has (pad, eos, unk) ids {layout}; t5lite needs "
                        "(0, 1, 2) (train with pad_id=0, eos_id=1, unk_id=2, bos_id=-1)")

  def _processor(self, where: str) -> tuple[spm.SentencePieceProcessor, int]:
    """The processor with the extra ids, and the model's own piece count. Bytes that are not
    a model (an empty or cut-short download, an HTML error page) make sentencepiece raise
    a RuntimeError or OSError, or protobuf a DecodeError, none naming the file: say it here."""
    if not self._model:
      raise ConfigError(f"{where} is empty: expected a sentencepiece model (spiece.model)")
    proto = sentencepiece_model_pb2.ModelProto()
    try:
      proto.ParseFromString(self._model)
      num_pieces = len(proto.pieces)
      if not num_pieces:
        raise ValueError("no pieces")
      # Reverse order puts <extra_id_0> last, i.e. at the highest id.
      for i in reversed(range(self.extra_ids)):
        proto.pieces.add(piece=f"<extra_id_{i}>", score=0.0,
                         type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED)
      return spm.SentencePieceProcessor(model_proto=proto.SerializeToString()), num_pieces
    except (DecodeError, RuntimeError, OSError, ValueError) as e:
      raise ConfigError(f"{where} is not a sentencepiece model ({len(self._model)} bytes that "
                        f"do not parse: {str(e).strip() or type(e).__name__}); replace it with "
                        "a real spiece.model") from None

  @property
  def serialized_model(self) -> bytes:
    """The sentencepiece model as given, without the extra ids (what spiece.model holds)."""
    return self._model

  @property
  def tokenizer(self) -> spm.SentencePieceProcessor:
    """The processor, extra ids included."""
    return self._sp

  @property
  def _base_vocab_size(self) -> int:
    return self._num_pieces

  def encode(self, text: str) -> np.ndarray:
    # One string, not a list of one: SentencePiece's list path sets up a thread pool per
    # call, which costs more than encoding a ~1 KB document (54 vs 138 us on an EPYC).
    return np.asarray(self._sp.encode(text, out_type=int), np.int32)

  def _encode_many(self, texts: list[str]) -> list[list[int]]:
    return self._sp.encode(texts, out_type=int) if texts else []

  def _decode_many(self, rows: list[list[int]]) -> list[str]:
    return self._sp.decode(rows) if rows else []

  def _key(self) -> tuple:
    return (hashlib.sha256(self._model).hexdigest(), self.extra_ids)

  def _save_files(self, directory: pathlib.Path, config: dict) -> None:
    atomic.write_file(str(directory / SPIECE_FILE), self._model)
    config["model_file"] = SPIECE_FILE

  @classmethod
  def _load(cls, directory: pathlib.Path, config: dict) -> SentencePieceVocabulary:
    return cls(directory / config.get("model_file", SPIECE_FILE), config["extra_ids"])

  # The processor is a C++ object: pickle (for grain workers) the model bytes instead.
  def __getstate__(self) -> dict:
    return dict(model=self._model, extra_ids=self.extra_ids)

  def __setstate__(self, state: dict) -> None:
    self.__init__(state["model"], state["extra_ids"])


class ByteVocabulary(Vocabulary):
  """ByT5: ids 0, 1, 2 are pad, eos, unk; byte b is id b + 3; extra ids above 258.

  Example: "hé" -> bytes [104, 195, 169] -> ids [107, 198, 172]. Decoding drops
  invalid UTF-8 (a cut multi-byte character) and the extra ids.
  """

  _kind = "byte"
  _OFFSET = 3

  def __init__(self, extra_ids: int = 0):
    super().__init__(extra_ids)

  @property
  def _base_vocab_size(self) -> int:
    return 256 + self._OFFSET

  def _encode_many(self, texts: list[str]) -> list[list[int]]:
    return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) + self._OFFSET
            for t in texts]

  def _decode_many(self, rows: list[list[int]]) -> list[str]:
    top = 256 + self._OFFSET
    return [bytes(i - self._OFFSET for i in row if self._OFFSET <= i < top)
            .decode("utf-8", errors="ignore") for row in rows]

  def _key(self) -> tuple:
    return (self.extra_ids,)

  @classmethod
  def _load(cls, directory: pathlib.Path, config: dict) -> ByteVocabulary:
    return cls(config["extra_ids"])


def load_vocabulary(directory: str | os.PathLike) -> Vocabulary:
  """Reads what Vocabulary.save wrote. A directory without vocabulary.json loads as the HF
  tokenizer it holds: spiece.model (a T5 checkpoint) as SentencePieceVocabulary with 100
  extra ids, like T5Tokenizer; vocab.txt (BERT) or vocab.json + merges.txt (GPT-2, RoBERTa)
  as hf_vocabularies reads them; else tokenizer.json (LLaMA, ...) as tokenizer_json does. `directory` may be a bucket URL (gs://, s3://)."""
  directory = storage.path(directory)
  config_path = directory / CONFIG_FILE
  if not config_path.is_file():
    if (directory / SPIECE_FILE).is_file():
      return SentencePieceVocabulary(directory / SPIECE_FILE, extra_ids=100)
    for kind in Vocabulary._KINDS.values():
      vocabulary = kind._load_hf_directory(directory)
      if vocabulary is not None:
        return vocabulary
    raise ConfigFileNotFoundError(f"no {CONFIG_FILE} or {SPIECE_FILE} in {directory} (nor an "
                                  "HF tokenizer's vocab.txt, vocab.json + merges.txt or "
                                  "tokenizer.json)")
  try:
    config = json.loads(config_path.read_text())
    kind, _ = config.get("kind"), config["extra_ids"]  # every kind's file has extra_ids
  except (ValueError, KeyError, AttributeError) as e:  # cut short, hand edited, not ours
    raise ConfigError(f"{config_path} is not a vocabulary.json that t5lite wrote "
                      f"({type(e).__name__}: {e})") from None
  if kind not in Vocabulary._KINDS:
    known = ", ".join(repr(k) for k in Vocabulary._KINDS)
    raise ConfigError(f"{config_path}: unknown vocabulary kind {kind!r}; expected one of {known}")
  return Vocabulary._KINDS[kind]._load(directory, config)


def _lines(texts: Iterable[str]) -> Iterator[str]:
  """Non-empty lines of texts; raises if there are none (sentencepiece would say less)."""
  lines = (line for text in texts for line in text.splitlines() if line.strip())
  first = next(lines, None)
  if first is None:
    raise ConfigError("train_sentencepiece: no text to train on (the iterator is empty "
                      "or holds only blank strings)")
  return itertools.chain([first], lines)


def train_sentencepiece(texts: Iterable[str], vocab_size: int, *,
                        model_type: str = "unigram", byte_fallback: bool = True,
                        character_coverage: float = 0.9995, max_sentence_length: int = 4192,
                        input_sentence_size: int = 0, seed: int = 0) -> bytes:
  """Trains a sentencepiece model in process; returns the serialized model (spiece.model).

  Layout is T5's: pad 0, eos 1, unk 2, no bos; extra ids are added later by
  SentencePieceVocabulary. Each text is split into lines, and a line is one sentence;
  sentencepiece skips lines longer than max_sentence_length bytes. input_sentence_size > 0
  samples that many lines (with `seed`); 0 uses them all.

  Normalization is "identity" and whitespace is kept as is, unlike T5's nmt_nfkc: with
  byte fallback, decode(encode(text)) == text for any text without U+2581 ('▁', which
  sentencepiece uses to mark spaces). Training runs on one thread with a fixed seed, so
  the same texts and arguments give the same bytes.
  """
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
  sentences = _lines(texts)
  writer = io.BytesIO()
  spm.set_random_generator_seed(seed)  # Process-wide; used when sampling sentences.
  spm.SentencePieceTrainer.train(
      sentence_iterator=sentences, model_writer=writer, vocab_size=vocab_size,
      model_type=model_type, byte_fallback=byte_fallback,
      character_coverage=character_coverage, max_sentence_length=max_sentence_length,
      input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
      normalization_rule_name="identity", remove_extra_whitespaces=False,
      num_threads=1, minloglevel=1)
  return writer.getvalue()
