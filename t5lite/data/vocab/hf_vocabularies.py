"""BERT's WordPiece and GPT-2 / RoBERTa's byte-level BPE vocabularies, on HF `tokenizers`.

Both are `t5lite.data.vocab.vocabularies.Vocabulary`s: tasks, the pipeline, MODEL_DIR, export and
grain workers use them as they use a SentencePieceVocabulary. The tokenizer inside is the
`tokenizers` library's, assembled exactly as transformers assembles BertTokenizerFast,
GPT2TokenizerFast and RobertaTokenizerFast, so encode gives their ids with
add_special_tokens=False (t5lite's encode adds nothing; preprocessors add EOS, [CLS], [SEP]):

  WordPieceVocabulary     vocab.txt (one token per line, id = line number, `##` marks the
                          continuation of a word). BertNormalizer (clean text, spaces around
                          CJK characters, lower-casing, and accent stripping when lowercase
                          unless strip_accents says otherwise), BertPreTokenizer (whitespace
                          and punctuation), WordPiece (greedy longest match; [UNK] for a word
                          it cannot cover), WordPiece decoder. Specials [PAD] [UNK] [CLS]
                          [SEP] [MASK]; eos is [SEP], which ends every BERT sequence (and is
                          what HF's EncoderDecoderModel takes as EOS for BERT).
  ByteLevelBPEVocabulary  vocab.json + merges.txt. ByteLevel pre-tokenizer (GPT-2's regex,
                          no prefix space, each byte a printable character), BPE, ByteLevel
                          decoder: every text round-trips. Specials by name: GPT-2's
                          <|endoftext|> (eos = bos = unk, as in GPT2Tokenizer), or RoBERTa's
                          <s> (bos, cls) <pad> </s> (eos, sep) <unk> <mask>.

Special tokens typed in the text ("[MASK]", "<|endoftext|>") encode to their single id, as
in transformers. decode stops at the first EOS (generation ends there, and t5lite's
decoding pads after it) and then skips every special token, as HF's
decode(skip_special_tokens=True) does. GPT-2 has no pad token, so pad_id is None: the
pipeline still pads rows with id 0, but nothing reads padding as a token (segment id 0,
loss weight 0), and decode must not drop id 0, a real token ('!') in GPT-2's vocabulary.

Worked example (a hand-made vocab.txt; t5lite.data.vocab.hf_training trains one):

  >>> v = WordPieceVocabulary(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
  ...                          "hello", "world", "##s", ",", "!"])
  >>> v.encode("Héllo, WORLDS!").tolist()        # hello , world ##s !
  [5, 8, 6, 7, 9]
  >>> v.decode([2, 5, 8, 6, 7, 9, 3, 6])          # [CLS] skipped; stops at [SEP] (eos)
  'hello, worlds!'
  >>> v.pad_id, v.unk_id, v.cls_id, v.sep_id, v.mask_id, v.eos_id
  (0, 1, 2, 3, 4, 3)
  >>> v.save("out")      # out/vocabulary.json + out/vocab.txt; load_vocabulary("out") == v

"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from t5lite.util import atomic, storage
from t5lite.data.vocab.vocabularies import CONFIG_FILE, Vocabulary
from t5lite.errors import ConfigError, ConfigFileNotFoundError

VOCAB_TXT, VOCAB_JSON, MERGES_TXT = "vocab.txt", "vocab.json", "merges.txt"
HF_CONFIG = "tokenizer_config.json"
BERT_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
GPT2_EOS = "<|endoftext|>"
ROBERTA_SPECIALS = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
BYTE_ALPHABET = frozenset(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins


class _TokenizersVocabulary(Vocabulary):
  """A `tokenizers.Tokenizer` over a fixed token list (id = position); specials by role."""

  # Plain attributes (instances set them), shadowing the base class's T5 values and its
  # mask_id property: these layouts name every special token they have.
  pad_id = eos_id = unk_id = bos_id = mask_id = cls_id = sep_id = None

  def __init__(self, tokens: Sequence[str], where: str):
    super().__init__(extra_ids=0)
    self._tokens, self._digest = tuple(tokens), None
    self._ids = _check_tokens(self._tokens, where)

  def _finish(self, tokenizer: Tokenizer, roles: Mapping[str, str]) -> None:
    """Sets the role ids and declares the role tokens special: matched whole in raw text
    before normalization (as transformers adds them), skipped by decode."""
    self._tokenizer = tokenizer
    for role, token in roles.items():
      setattr(self, f"{role}_id", self._ids[token])
    specials = sorted(set(roles.values()), key=self._ids.__getitem__)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in specials])

  @property
  def tokenizer(self) -> Tokenizer:
    """The `tokenizers.Tokenizer` (no post-processor: it adds no special tokens)."""
    return self._tokenizer

  @property
  def tokens(self) -> tuple[str, ...]:
    """Every token, by id."""
    return self._tokens

  @property
  def _base_vocab_size(self) -> int:
    return len(self._tokens)

  def _encode_many(self, texts: list[str]) -> list[list[int]]:
    if len(texts) == 1:  # The pipeline's case. encode_batch would start tokenizers' thread
      # pool, after which every forked grain worker prints a warning and runs it serially.
      return [self._tokenizer.encode(texts[0], add_special_tokens=False).ids]
    return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

  def _decode_many(self, rows: list[list[int]]) -> list[str]:
    return self._tokenizer.decode_batch(rows, skip_special_tokens=True) if rows else []

  def _key(self) -> tuple:
    if self._digest is None:  # once: GPT-2's 50k tokens and merges take a while to hash
      content = json.dumps(self._state(), ensure_ascii=False, sort_keys=True)
      self._digest = hashlib.sha256(content.encode()).hexdigest()
    return (self._digest,)

  def _state(self) -> dict[str, Any]:
    """Constructor keyword arguments that rebuild this vocabulary (JSON-able)."""
    raise NotImplementedError

  # The Tokenizer pickles, but its content is the smaller and version-proof state.
  def __getstate__(self) -> dict:
    return self._state()

  def __setstate__(self, state: dict) -> None:
    self.__init__(**state)

  def __repr__(self) -> str:
    specials = ", ".join(f"{r}={i}" for r, i in self.special_tokens.items())
    return f"{type(self).__name__}(vocab_size={self.vocab_size}, {specials})"


class WordPieceVocabulary(_TokenizersVocabulary):
  """BERT's vocab.txt tokenized as BertTokenizerFast(vocab, do_lower_case=lowercase,
  strip_accents=strip_accents) does. vocab: a vocab.txt path, or the tokens by id."""

  _kind = "wordpiece"

  def __init__(self, vocab: str | os.PathLike | Sequence[str], *, lowercase: bool = True,
               strip_accents: bool | None = None):
    if isinstance(vocab, (str, os.PathLike)):
      tokens, where = _read_lines(vocab, "WordPiece vocab.txt"), os.fspath(vocab)
    else:
      tokens, where = list(vocab), "the WordPiece token list"
    super().__init__(tokens, where)
    if BERT_SPECIALS["unk"] not in self._ids:
      raise ConfigError(f"{where} has no [UNK] token, which WordPiece needs for words it cannot "
                        "cover: add a line [UNK] (BERT's vocab.txt has it at id 100)")
    self.lowercase, self.strip_accents = bool(lowercase), strip_accents
    tokenizer = Tokenizer(models.WordPiece(self._ids, unk_token=BERT_SPECIALS["unk"]))
    tokenizer.normalizer = bert_normalizer(self.lowercase, strip_accents)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    roles = {role: t for role, t in BERT_SPECIALS.items() if t in self._ids}
    if "sep" in roles:
      roles["eos"] = roles["sep"]
    self._finish(tokenizer, roles)

  def _state(self) -> dict[str, Any]:
    return dict(vocab=list(self._tokens), lowercase=self.lowercase,
                strip_accents=self.strip_accents)

  def _save_files(self, directory: pathlib.Path, config: dict) -> None:
    atomic.write_file(str(directory / VOCAB_TXT), "".join(t + "\n" for t in self._tokens))
    config.update(vocab_file=VOCAB_TXT, lowercase=self.lowercase,
                  strip_accents=self.strip_accents)

  @classmethod
  def _load(cls, directory: pathlib.Path, config: dict) -> WordPieceVocabulary:
    return cls(_saved_file(directory, config, "vocab_file", VOCAB_TXT),
               lowercase=config.get("lowercase", True), strip_accents=config.get("strip_accents"))

  @classmethod
  def _load_hf_directory(cls, directory: pathlib.Path) -> WordPieceVocabulary | None:
    if not (directory / VOCAB_TXT).is_file():
      return None
    hf = _hf_config(directory)  # BertTokenizer's defaults where it says nothing
    lowercase, strip_accents = hf.get("do_lower_case", True), hf.get("strip_accents")
    if not isinstance(lowercase, bool) or not (strip_accents is None
                                               or isinstance(strip_accents, bool)):
      raise ConfigError(f"{directory / HF_CONFIG}: do_lower_case={lowercase!r} and "
                        f"strip_accents={strip_accents!r} must be true or false (strip_accents "
                        "may be null)")
    return cls(directory / VOCAB_TXT, lowercase=lowercase, strip_accents=strip_accents)


class ByteLevelBPEVocabulary(_TokenizersVocabulary):
  """GPT-2's (or RoBERTa's) vocab.json + merges.txt tokenized as GPT2TokenizerFast (or
  RobertaTokenizerFast) does. vocab: a vocab.json path or {token: id} (ids 0..n-1);
  merges: a merges.txt path, or the merges in rank order as (left, right) pairs or
  "left right" strings."""

  _kind = "byte_level_bpe"

  def __init__(self, vocab: str | os.PathLike | Mapping[str, int],
               merges: str | os.PathLike | Sequence[tuple[str, str] | str],
               added_tokens: Sequence[str] = ()):
    """added_tokens: tokens of vocab (the last ids) that are matched whole and never split,
    like HF's `tokenizer.add_special_tokens` (GPT-1's [START], [DELIM], [EXTRACT])."""
    if isinstance(vocab, (str, os.PathLike)):
      ids, where = _read_json(vocab, 'a vocab.json, {"token": id, ...}'), os.fspath(vocab)
    else:
      ids, where = dict(vocab), "the byte-level BPE vocab"
    super().__init__(_tokens_by_id(ids, where), where)
    self.added_tokens = tuple(added_tokens)
    unknown = [t for t in self.added_tokens if t not in self._ids]
    if unknown:
      raise ConfigError(f"{where}: added tokens {unknown} are not in the vocabulary")
    missing = sorted(BYTE_ALPHABET - self._ids.keys())
    if missing:
      raise ConfigError(f"{where} lacks {len(missing)} of the 256 byte-level symbols (e.g. "
                        f"{missing[0]!r}): not a byte-level BPE vocabulary (GPT-2's and "
                        "RoBERTa's vocab.json have them all)")
    if isinstance(merges, (str, os.PathLike)):
      self._merges = _read_merges(merges, self._ids)
    else:
      self._merges = _check_merges(merges, self._ids, "the merges", first_line=1)
    tokenizer = Tokenizer(models.BPE(self._ids, list(self._merges), dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    roles = {role: GPT2_EOS for role in ("eos", "bos", "unk")} if GPT2_EOS in self._ids else {}
    roles.update((role, t) for role, t in ROBERTA_SPECIALS.items() if t in self._ids)
    if self.style == "roberta":
      roles.update(cls=ROBERTA_SPECIALS["bos"], sep=ROBERTA_SPECIALS["eos"])
    self._finish(tokenizer, roles)
    if self.added_tokens:
      tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in self.added_tokens])

  def with_added_tokens(self, tokens: Sequence[str]) -> "ByteLevelBPEVocabulary":
    """This vocabulary with `tokens` appended as new ids (HF's add_special_tokens; the model's
    embedding grows to match: t5lite.train.warm_start). Example: GPT-2's 50257 ids +
    ["[START]", "[DELIM]", "[EXTRACT]"] -> ids 50257, 50258, 50259."""
    present = [t for t in tokens if t in self._ids]
    if present:
      raise ConfigError(f"tokens {present} are already in the vocabulary")
    vocab = dict(zip(self._tokens, range(len(self._tokens))))
    vocab.update((t, len(self._tokens) + i) for i, t in enumerate(tokens))
    return ByteLevelBPEVocabulary(vocab, self._merges, self.added_tokens + tuple(tokens))

  def token_id(self, token: str) -> int:
    """The id of a token (e.g. an added one); a ConfigError naming it when absent."""
    if token not in self._ids:
      raise ConfigError(f"{token!r} is not in the vocabulary {self!r}")
    return self._ids[token]

  def extends(self, other) -> bool:
    """Whether this is `other` with tokens appended (what a checkpoint trained with `other`
    may be finetuned with, its embedding grown)."""
    return (isinstance(other, ByteLevelBPEVocabulary) and self._merges == other._merges
            and self._tokens[:len(other._tokens)] == other._tokens
            and self.added_tokens[:len(other.added_tokens)] == other.added_tokens)

  @property
  def style(self) -> str:
    """"roberta" when it has RoBERTa's <s> and </s>, else "gpt2" (HF's tokenizer class)."""
    return "roberta" if {"<s>", "</s>"} <= self._ids.keys() else "gpt2"

  @property
  def merges(self) -> tuple[tuple[str, str], ...]:
    return self._merges

  def _state(self) -> dict[str, Any]:
    return dict(vocab=dict(zip(self._tokens, range(len(self._tokens)))),
                merges=[list(m) for m in self._merges], added_tokens=list(self.added_tokens))

  def _save_files(self, directory: pathlib.Path, config: dict) -> None:
    atomic.write_file(str(directory / VOCAB_JSON), json.dumps(self._state()["vocab"],
                                                              ensure_ascii=False))
    atomic.write_file(str(directory / MERGES_TXT),
                      "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in self._merges))
    config.update(vocab_file=VOCAB_JSON, merges_file=MERGES_TXT)
    if self.added_tokens:
      config["added_tokens"] = list(self.added_tokens)

  @classmethod
  def _load(cls, directory: pathlib.Path, config: dict) -> ByteLevelBPEVocabulary:
    added = config.get("added_tokens", [])
    if not (isinstance(added, list) and all(isinstance(t, str) for t in added)):
      raise ConfigError(f"{directory / CONFIG_FILE}: added_tokens must be a list of strings")
    return cls(_saved_file(directory, config, "vocab_file", VOCAB_JSON),
               _saved_file(directory, config, "merges_file", MERGES_TXT), added)

  @classmethod
  def _load_hf_directory(cls, directory: pathlib.Path) -> ByteLevelBPEVocabulary | None:
    if not (directory / VOCAB_JSON).is_file() or not (directory / MERGES_TXT).is_file():
      return None
    return cls(directory / VOCAB_JSON, directory / MERGES_TXT)


def _saved_file(directory: pathlib.Path, config: dict, key: str, default: str) -> pathlib.Path:
  name = config.get(key, default)
  if not isinstance(name, str) or pathlib.Path(name).name != name or name in (".", ".."):
    raise ConfigError(f"{directory / CONFIG_FILE}: {key}={name!r} must be a file name inside "
                      "the vocabulary's folder")
  path = directory / name
  if not path.is_file():
    raise ConfigFileNotFoundError(f"{directory / CONFIG_FILE} describes a {config['kind']} "
                                  f"vocabulary, but its {path.name} is missing: copy it back "
                                  "or save the vocabulary again")
  return path


def bert_normalizer(lowercase: bool, strip_accents: bool | None):
  # strip_accents None follows lowercase, as in BERT's BasicTokenizer.
  return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                    strip_accents=strip_accents, lowercase=lowercase)


def _check_tokens(tokens: Sequence[str], where: str) -> dict[str, int]:
  """{token: id}; tokens must be non-empty, unique, and fit on one line of a vocab file."""
  if not tokens:
    raise ConfigError(f"{where} holds no tokens")
  ids: dict[str, int] = {}
  for i, token in enumerate(tokens):
    if not isinstance(token, str) or not token or "\n" in token:
      raise ConfigError(f"{where}: token {i} is {token!r}; a token is non-empty text without "
                        "line breaks")
    if ids.setdefault(token, i) != i:
      raise ConfigError(f"{where}: token {token!r} appears twice (ids {ids[token]} and {i}); "
                        "each token has one id")
  return ids


MAX_FILE_BYTES = 256 << 20  # vocabulary files of real tokenizers are a few MB


def _read_text(path: str | os.PathLike, what: str) -> str:
  path = storage.path(path)
  if not path.is_file():
    raise ConfigFileNotFoundError(f"{what} not found: {path}")
  size = storage.size(path)  # (one stat: a request when path is in a bucket)
  if size > MAX_FILE_BYTES:
    raise ConfigError(f"{path}: {size:,} bytes, too large for {what} (over "
                      f"{MAX_FILE_BYTES:,})")
  try:
    return path.read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not UTF-8 text (bad byte at offset {e.start}): expected "
                      f"{what}") from None


def _read_lines(path: str | os.PathLike, what: str) -> list[str]:
  """A vocab.txt's tokens: one per line, the final line break optional (\\r\\n too)."""
  lines = _read_text(path, what).split("\n")
  if lines[-1] == "":
    lines.pop()
  lines = [line[:-1] if line.endswith("\r") else line for line in lines]
  for n, line in enumerate(lines, 1):
    if not line:
      raise ConfigError(f"{os.fspath(path)} line {n} is empty: {what} has one token per line "
                        "(id = line number - 1); remove the blank line")
  return lines


def _read_json(path: str | os.PathLike, what: str) -> Any:
  text = _read_text(path, what)
  try:
    return json.loads(text)
  except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: absurd nesting
    raise ConfigError(f"{os.fspath(path)} is not JSON ({type(e).__name__}: {e}): expected "
                      f"{what}") from None


def _tokens_by_id(ids: Any, where: str) -> list[str]:
  """{token: id} with ids exactly 0..n-1 -> the tokens by id."""
  if not isinstance(ids, dict) or not all(type(i) is int for i in ids.values()):
    raise ConfigError(f"{where} must map each token to an integer id, "
                      f"got {type(ids).__name__}")
  tokens = sorted(ids, key=ids.__getitem__)
  if [ids[t] for t in tokens] != list(range(len(tokens))):
    gap = next(i for i, t in enumerate(tokens) if ids[t] != i)
    raise ConfigError(f"{where}: ids must be 0..{len(tokens) - 1}, each used once; id {gap} "
                      "is missing or repeated")
  return tokens


def _read_merges(path: str | os.PathLike, ids: Mapping[str, int]) -> tuple[tuple[str, str], ...]:
  lines = _read_text(path, "a BPE merges.txt").split("\n")
  first = 1
  if lines and lines[0].startswith("#version"):  # "#version: 0.2", as GPT-2's starts
    lines, first = lines[1:], 2
  while lines and not lines[-1].strip():
    lines.pop()
  return _check_merges(lines, ids, os.fspath(path), first)


def _check_merges(merges, ids: Mapping[str, int], where: str,
                  first_line: int) -> tuple[tuple[str, str], ...]:
  """Merges as pairs, each of two vocabulary tokens whose concatenation is one too."""
  out = []
  for n, merge in enumerate(merges, first_line):
    pair = merge.split(" ") if isinstance(merge, str) else list(merge)
    if len(pair) != 2 or not all(isinstance(p, str) and p for p in pair):
      raise ConfigError(f"{where} line {n}: {merge!r} is not a merge (two tokens separated by "
                        "one space, e.g. 'Ġ t')")
    for token in (*pair, pair[0] + pair[1]):
      if token not in ids:
        raise ConfigError(f"{where} line {n}: merge {' '.join(pair)!r} needs {token!r}, which "
                          "the vocab lacks: vocab.json and merges.txt must come from the same "
                          "tokenizer")
    out.append((pair[0], pair[1]))
  return tuple(out)


def _hf_config(directory: pathlib.Path) -> dict:
  path = directory / HF_CONFIG
  config = _read_json(path, "HF's tokenizer_config.json") if path.is_file() else {}
  if not isinstance(config, dict):
    raise ConfigError(f"{path} must hold a JSON object, as HF's tokenizer_config.json does")
  return config


__all__ = ["WordPieceVocabulary", "ByteLevelBPEVocabulary"]
