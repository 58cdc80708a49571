"""Masking variants of BERT-line pretraining: whole words, SpanBERT spans, ALBERT n-grams.

Every variant chooses about 15% of a sequence's non-special tokens in units of whole words,
then replaces them by one shared 80/10/10 rule (apply_replacements): 80% [MASK], 10% a
random non-special token, 10% kept. They differ in the unit and in where the rule is drawn:

  token       BERT's MLM: single tokens, per token (objectives.mlm, unchanged)
  whole_word  BERT's whole-word masking: one word at a time, 80/10/10 per token
  ngram       ALBERT: n consecutive words, n <= 3 with p(n) proportional to 1/n (6/11,
              3/11, 2/11), 80/10/10 per token
  span        SpanBERT: spans of Geometric(0.2) words cut off at 10 (renormalized over
              1..10: mean 3.8 words), 80/10/10 per span; also the span boundary features

Word boundaries come from the vocabulary's pieces (TokenTable): a WordPiece piece starting
with `##` continues a word, a SentencePiece piece starting with `▁` or a byte-level BPE
piece starting with `Ġ` begins one. Special tokens ([CLS], [SEP], [MASK], ...) are words of
their own, never chosen and never drawn as random replacements.

Choosing (choose_spans): draw a length (in words), then put the span uniformly at one of the
places where that many consecutive free words fit in the remaining budget; where none fits,
the length shrinks. So spans never overlap, never cut a word, and every span but the last
(which the budget shortens) has exactly the drawn length. The budget is objectives.mlm's:
max(1, round(0.15 * non-special tokens)).

Worked example (span, mask_rate 0.3: 7 non-special tokens, a budget of 2; WordPiece
[CLS] the cat ##s sat on the mat [SEP]):
  tokens       [2 10 11 12 13 14 10 15 3]     words: [CLS] | the | cat ##s | sat | ...
  chosen span  tokens 2..3 ("cat ##s", one word), drawn as [MASK] for the whole span:
  inputs       [2 10  4  4 13 14 10 15 3]    weights [0 0 1 1 0 0 0 0 0]
  span_left    [0  0  1  1  0  0  0  0 0]    (position 1, "the", just before the span)
  span_right   [0  0  4  4  0  0  0  0 0]    (position 4, "sat", just after it)
  span_offset  [0  0  1  2  0  0  0  0 0]    (1-based place in the span; 0 outside)

masking_step(kind) is the per-example preprocessor: `targets` (the tokens) -> `inputs`
(masked), `targets` (original) and `weights` (1.0 on chosen tokens), as the default masking of
chains.mlm_preprocessors gives (which takes these variants as its `kind`), plus `span_left` /
`span_right` / `span_offset` for spans; every other key of the example (token_type_ids,
sentence_label of sentence pairs) is kept.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import numpy as np

from t5lite.data.objectives import token_objectives as objectives
from t5lite.errors import ConfigError

# How pieces mark words: (prefix, whether a piece with it starts a word or continues one).
SCHEMES = {"wordpiece": ("##", False), "sentencepiece": ("\u2581", True),
           "byte_level_bpe": ("\u0120", True)}
SPAN_P, SPAN_MAX = 0.2, 10   # SpanBERT's Geometric(0.2), at most 10 words
NGRAM_MAX = 3                # ALBERT's n-grams


@dataclasses.dataclass(frozen=True, eq=False)
class TokenTable:
  """Per-id facts the maskings need: word_start[i] (piece i begins a word), special[i],
  the [MASK] id, and the ids a random replacement is drawn from (all non-special ones)."""
  word_start: np.ndarray
  special: np.ndarray
  mask_id: int
  replacements: np.ndarray

  @classmethod
  def from_pieces(cls, pieces: Sequence[str], scheme: str, special_ids: Sequence[int],
                  mask_id: int, vocab_size: int | None = None) -> "TokenTable":
    """pieces[i] is id i's piece; ids past len(pieces) up to vocab_size (T5's extra ids) are
    special. Example: (["[PAD]", "[CLS]", "cat", "##s"], "wordpiece", [0, 1], 0) ->
    word_start [T T T F]."""
    if scheme not in SCHEMES:
      raise ConfigError(f"TokenTable: unknown word scheme {scheme!r}; use one of {list(SCHEMES)}")
    prefix, starts = SCHEMES[scheme]
    size = max(vocab_size or 0, len(pieces))
    marked = np.array([p.startswith(prefix) for p in pieces] + [False] * (size - len(pieces)))
    special = np.zeros(size, bool)
    special[len(pieces):] = True
    special[[i for i in special_ids if 0 <= i < size]] = True
    word_start = (marked if starts else ~marked) | special
    return cls(word_start, special, int(mask_id), np.flatnonzero(~special).astype(np.int32))

  @classmethod
  def from_vocabulary(cls, vocabulary) -> "TokenTable":
    return _table(vocabulary)


@functools.lru_cache(maxsize=16)
def _table(vocabulary) -> TokenTable:
  """Once per vocabulary and process: 50k pieces take a few ms to scan."""
  from t5lite.data.vocab.hf_vocabularies import ByteLevelBPEVocabulary, WordPieceVocabulary
  from t5lite.data.vocab.vocabularies import SentencePieceVocabulary
  inner = getattr(vocabulary, "vocabulary", vocabulary)  # tasks' LazyVocabulary wraps one
  if vocabulary.mask_id is None:
    raise ConfigError(f"masking: the vocabulary {vocabulary!r} has no mask token; use one "
                      "with [MASK] / <mask> (WordPiece, RoBERTa's BPE) or T5's extra ids")
  specials = list(vocabulary.special_tokens.values())
  if isinstance(inner, WordPieceVocabulary):
    scheme, pieces = "wordpiece", inner.tokens
  elif isinstance(inner, ByteLevelBPEVocabulary):
    scheme, pieces = "byte_level_bpe", inner.tokens
  elif isinstance(inner, SentencePieceVocabulary):
    sp = inner.tokenizer
    pieces = [sp.id_to_piece(i) for i in range(inner.vocab_size - inner.extra_ids)]
    scheme = "sentencepiece"
  else:
    raise ConfigError(f"masking: cannot tell word boundaries in {type(inner).__name__} "
                      "(whole-word, n-gram and span masking need WordPiece, SentencePiece or "
                      "byte-level BPE pieces); use masking 'token' for this vocabulary")
  return TokenTable.from_pieces(pieces, scheme, specials, vocabulary.mask_id,
                                vocabulary.vocab_size)


def word_starts(tokens: np.ndarray, table: TokenTable) -> np.ndarray:
  """Whether each token begins a word: its piece says so, it is special, it follows a
  special token, or it is the first. [CLS] cat ##s [SEP] ##x -> [T T F T T]."""
  tokens = np.asarray(tokens)
  if tokens.size and (tokens.min() < 0 or tokens.max() >= table.special.size):
    raise ConfigError(f"masking: token ids {tokens.min()}..{tokens.max()} fall outside the "
                      f"vocabulary's {table.special.size} ids")
  special = table.special[tokens]
  start = table.word_start[tokens] | special
  start[1:] |= special[:-1]  # a continuation piece cannot join a special token
  start[:1] = True
  return start


def budget(eligible_tokens: int, mask_rate: float) -> int:
  """objectives.mlm's count: max(1, round(rate * n)), 0 without candidates or rate."""
  if eligible_tokens == 0 or mask_rate <= 0:
    return 0
  return min(eligible_tokens, max(1, round(mask_rate * eligible_tokens)))


def choose_spans(word_lengths: np.ndarray, eligible: np.ndarray, budget: int,
                 rng: np.random.Generator, draw_words: Callable[[np.random.Generator], int]
                 ) -> list[tuple[int, int]]:
  """Non-overlapping spans of whole words, (first word, number of words), in draw order,
  covering at most `budget` tokens (see the module docstring).

  word_lengths: tokens per word; eligible: words that may be chosen (not special).
  Example: lengths [1 1 2 1], eligible [F T T T], budget 3, draw_words -> 2: [(1, 2)] or
  [(2, 2)] (3 tokens each; word 0 may not be chosen); budget 2: no 2-word place fits, so
  one word: [(1, 1)], [(2, 1)] or [(3, 1)].
  """
  free = np.asarray(eligible, bool).copy()
  ends = np.concatenate([[0], np.cumsum(word_lengths)])  # token offset of each word
  spans, chosen = [], 0
  while chosen < budget:
    remaining = budget - chosen
    blocked = np.concatenate([[0], np.cumsum(~free)])
    for n in range(min(draw_words(rng), free.size), 0, -1):  # shrink only where none fits
      first = np.arange(free.size - n + 1)
      fits = (blocked[first + n] == blocked[first]) & (ends[first + n] - ends[first] <= remaining)
      places = np.flatnonzero(fits)
      if places.size:
        break
    else:
      break  # not even one free word fits the budget left
    start = int(places[rng.integers(places.size)])
    free[start:start + n] = False
    spans.append((start, n))
    chosen += int(ends[start + n] - ends[start])
  return spans


def apply_replacements(tokens: np.ndarray, spans: Sequence[tuple[int, int]],
                       rng: np.random.Generator, table: TokenTable, *, per_span: bool,
                       random_rate: float = 0.1, keep_rate: float = 0.1) -> dict[str, np.ndarray]:
  """The 80/10/10 rule on token spans [start, end): `random_rate` of the draws become
  random non-special tokens, `keep_rate` stay, the rest [MASK]; one draw per span
  (per_span) or per token. Returns int32 inputs / targets, float32 weights (1.0 chosen)."""
  if random_rate + keep_rate > 1.0:
    raise ConfigError(f"masking: random_rate + keep_rate = {random_rate + keep_rate} > 1")
  tokens = np.asarray(tokens).astype(np.int32, copy=False)
  inputs, weights = tokens.copy(), np.zeros(tokens.shape[0], np.float32)
  if len(spans):
    starts, ends = np.asarray(spans, np.int64).T
    lengths = ends - starts
    chosen = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
    action = (np.repeat(rng.random(len(spans)), lengths) if per_span
              else rng.random(chosen.size))  # < random_rate: random; next keep_rate: keep
    inputs[chosen[action >= random_rate + keep_rate]] = table.mask_id
    randomized = chosen[action < random_rate]
    inputs[randomized] = table.replacements[rng.integers(0, table.replacements.size,
                                                         randomized.size)]
    weights[chosen] = 1.0
  return {"inputs": inputs, "targets": tokens, "weights": weights}


def _words(tokens, table):
  """(token offset of each word, its length, whether it may be chosen)."""
  starts = np.flatnonzero(word_starts(tokens, table))
  lengths = np.diff(np.append(starts, len(tokens)))
  return starts, lengths, ~table.special[np.asarray(tokens)[starts]]


def _masked_words(tokens, rng, table, mask_rate, draw_words, per_span, **rates):
  tokens = np.asarray(tokens).astype(np.int32, copy=False)
  if tokens.size == 0:
    return apply_replacements(tokens, [], rng, table, per_span=per_span, **rates), []
  starts, lengths, eligible = _words(tokens, table)
  count = budget(int(lengths[eligible].sum()), mask_rate)
  words = choose_spans(lengths, eligible, count, rng, draw_words)
  ends = np.append(starts, len(tokens))
  spans = [(int(starts[w]), int(ends[w + n])) for w, n in words]
  return apply_replacements(tokens, spans, rng, table, per_span=per_span, **rates), spans


def whole_word_mask(tokens, rng: np.random.Generator, table: TokenTable, *,
                    mask_rate: float = 0.15, **rates) -> dict[str, np.ndarray]:
  """BERT's whole-word masking: words drawn uniformly until ~mask_rate of the tokens are
  chosen; every piece of a chosen word is chosen; 80/10/10 per token."""
  return _masked_words(tokens, rng, table, mask_rate, lambda _: 1, False, **rates)[0]


def _ngram_words(rng: np.random.Generator) -> int:
  p = 1.0 / np.arange(1, NGRAM_MAX + 1)
  return int(rng.choice(NGRAM_MAX, p=p / p.sum())) + 1


def ngram_mask(tokens, rng: np.random.Generator, table: TokenTable, *,
               mask_rate: float = 0.15, **rates) -> dict[str, np.ndarray]:
  """ALBERT's n-gram masking: n-word spans, n in 1..3 with p(n) proportional to 1/n;
  80/10/10 per token."""
  return _masked_words(tokens, rng, table, mask_rate, _ngram_words, False, **rates)[0]


def _span_words(rng: np.random.Generator) -> int:
  p = SPAN_P * (1 - SPAN_P) ** np.arange(SPAN_MAX)  # P(1 word), P(2), ..., renormalized
  return int(rng.choice(SPAN_MAX, p=p / p.sum())) + 1


def span_mask(tokens, rng: np.random.Generator, table: TokenTable, *,
              mask_rate: float = 0.15, **rates) -> dict[str, np.ndarray]:
  """SpanBERT's span masking: spans of whole words (Geometric(0.2) words, at most 10, mean
  3.8), 80/10/10 per span, and the span boundary features (module docstring): int32
  span_left = s - 1, span_right = e + 1 for the span [s, e] holding the token (clipped to
  the sequence), span_offset = its 1-based place there (0 outside every span)."""
  out, spans = _masked_words(tokens, rng, table, mask_rate, _span_words, True, **rates)
  size = out["targets"].shape[0]
  left, right, offset = (np.zeros(size, np.int32) for _ in range(3))
  for start, end in spans:
    left[start:end] = max(start - 1, 0)
    right[start:end] = min(end, size - 1)
    offset[start:end] = np.arange(1, end - start + 1)
  return {**out, "span_left": left, "span_right": right, "span_offset": offset}


def token_mask(tokens, rng: np.random.Generator, table: TokenTable, *,
               mask_rate: float = 0.15, **rates) -> dict[str, np.ndarray]:
  """BERT's MLM (objectives.mlm) with the table's special ids: single tokens, 80/10/10 per
  token, random tokens from every non-special id."""
  specials = tuple(np.flatnonzero(table.special).tolist())
  return objectives.mlm(tokens, seed=rng, vocab_size=table.special.size, mask_id=table.mask_id,
                        mask_rate=mask_rate, special_ids=specials, random_above_specials=False,
                        **rates)


MASKINGS = {"token": token_mask, "whole_word": whole_word_mask, "ngram": ngram_mask,
            "span": span_mask}


def _masking(kind: str):
  if kind not in MASKINGS:
    raise ConfigError(f"masking: unknown kind {kind!r}; use one of {sorted(MASKINGS)}")
  return MASKINGS[kind]


def masking_step(kind: str = "whole_word", *, add_cls_sep: bool = False, **kwargs) -> Callable:
  """Per-example preprocessor: `targets` tokens -> masking `kind`'s features (module
  docstring), other keys kept. add_cls_sep: mask `[CLS] targets [SEP]` instead (pieces of
  concat_and_split). Draws from the pipeline's per-example rng: new masks every epoch
  (RoBERTa's dynamic masking)."""
  fn = _masking(kind)

  def mask(ex, rng, output_features):
    vocabulary = output_features["targets"].vocabulary
    table = TokenTable.from_vocabulary(vocabulary)
    tokens = np.asarray(ex["targets"], np.int32)
    if add_cls_sep:
      if vocabulary.cls_id is None or vocabulary.sep_id is None:
        raise ConfigError(f"masking_step(add_cls_sep=True): the vocabulary ({vocabulary!r}) "
                          "has no [CLS] / [SEP] token")
      tokens = np.concatenate([[vocabulary.cls_id], tokens, [vocabulary.sep_id]]).astype(np.int32)
    return {**ex, **fn(tokens, rng, table, **kwargs)}
  mask.__name__ = f"masking_step({kind})"
  return mask
