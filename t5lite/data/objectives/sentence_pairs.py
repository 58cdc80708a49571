"""Sentence-level pretraining data: BERT / ALBERT sentence pairs and RoBERTa FULL-SENTENCES.

Documents are split into sentences with pysbd and tokenized sentence by sentence
(tokenize_sentences: `targets` text -> `targets` tokens and `sentence_lengths`, before the
task's CACHE_POINT). Then, per group of 128 documents (pretraining.CONCAT_GROUP), one of:

Sentence pairs (create_pairs; BERT's create_pretraining_data, document by document): a
target of max_length - 3 tokens (with probability short_seq_prob 0.1 a random one in
[2, max_length - 3], drawn once per document as BERT does); sentences are gathered into a
chunk until it reaches the target or the document ends; A = its first a_end sentences
(a_end random in [1, chunk - 1]), and B:
  nsp  the rest of the chunk, sentence_label 0 (IsNext); or, with probability 0.5 (always
       for a one-sentence chunk), sentences of a random OTHER document from a random start,
       until B reaches the target's remaining length, sentence_label 1, and the chunk's
       sentences after A are put back to start the next chunk (as BERT does).
  sop  the rest of the chunk; with probability 0.5 A and B swap, sentence_label 1 (ALBERT's
       sentence order). A one-sentence chunk is cut at a random token into A and B (ALBERT
       would take a random document's B here, which is no order to predict).
The pair is cut to max_length - 3 tokens by BERT's truncate_seq_pair (tokens leave the
longer side, from its front or back at random), never dropped: `truncated_tokens` counts
what it lost. Examples `[CLS] A [SEP] B [SEP]`, token_type_ids 0 up to the first [SEP]
included, 1 after; a group's pairs come out shuffled (BERT shuffles all instances).
Deviation from BERT: the random document comes from the same group of 128 documents (the
pipeline is a stream, BERT samples the whole corpus); the group's draws come from one
generator seeded by grain's random_map, so the pairs are deterministic and resumable.
A one-sentence chunk in a group with no other document makes no pair.

Worked example (nsp, max_length 12, [CLS] 2, [SEP] 3; documents [[5 6] [7 8 9] [10]] and
[[20 21 22] [23]], target 9): the chunk [5 6] [7 8 9] [10] (6 tokens, the document ends),
a_end 1; IsNext: A = [5 6], B = [7 8 9 10] ->
  targets        [2 5 6 3 7 8 9 10 3]   token_type_ids [0 0 0 0 1 1 1 1 1]
  sentence_label 0   truncated_tokens 0
or random: B = [20 21 22 23] from document 2 (start 0), label 1, and [7 8 9] [10] go back.

FULL-SENTENCES (full_sentences; RoBERTa): sentences packed in order across documents into
`[CLS] ... [SEP]` examples of at most `inputs` tokens; a [SEP] marks each document end
inside an example; a sentence that does not fit starts the next example, unless it is
longer than a whole example: then it fills this one and its rest continues in the next. No
sentence pair, one segment. Example, inputs 8 (6 tokens of room), documents [[5 6] [7]],
[[8 9]], [[10 11 12 13 14 15 16 17]]:
  [2 5 6 7 3 8 9 3]   [2 10 11 12 13 14 15 3]   [2 16 17 3]
A group's last example is shorter, as concat_and_split's last piece is.
"""
from __future__ import annotations

import functools
import re

import grain
import numpy as np

from t5lite.data.preprocessors import stream_preprocessor
from t5lite.data.objectives.chains import CONCAT_GROUP
from t5lite.errors import ConfigError

ORDERS = ("nsp", "sop")
_segmenter = None


@functools.lru_cache(maxsize=1 << 14)
def split_sentences(text: str) -> tuple[str, ...]:
  """Sentences of a text: paragraphs (blank-line separated) with their line breaks
  joined, each split by pysbd (English, clean=False). pysbd takes ~3 ms a document and
  every epoch splits the same texts again: cached per process.
  Example: "Return x.\\nIt is\\nbig. Ok.\\n\\nSee y." -> ("Return x.", "It is big.", "Ok.",
  "See y.")"""
  global _segmenter
  if _segmenter is None:
    import pysbd  # only the sentence tasks need it
    _segmenter = pysbd.Segmenter(language="en", clean=False)
  out = []
  for paragraph in re.split(r"\n\s*\n", text):
    # pysbd ends a sentence at every line break: wrapped docstring lines are not sentences.
    paragraph = " ".join(paragraph.split())
    if paragraph:
      out.extend(s.strip() for s in _segmenter.segment(paragraph) if s.strip())
  return tuple(out)


def tokenize_sentences(ex, output_features):
  """`targets` text -> `targets` (the tokens of its sentences, concatenated) and int32
  `sentence_lengths` (tokens per sentence; sentences without tokens are left out).
  Example (WordPiece): {"targets": "Hi there. Bye."} -> {"targets": [hi there . bye .],
  "sentence_lengths": [3, 2]}."""
  text = ex["targets"]
  text = text.decode("utf-8") if isinstance(text, bytes) else text
  vocabulary = output_features["targets"].vocabulary
  # One sentence at a time: encode_batch would start tokenizers' thread pool (vocabularies).
  pieces = [vocabulary.encode(s) for s in split_sentences(text)]
  pieces = [p for p in pieces if len(p)]
  tokens = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
  return {"targets": tokens, "sentence_lengths": np.array([len(p) for p in pieces], np.int32)}


def sentences_of(ex) -> list[np.ndarray]:
  """A tokenize_sentences example -> its sentences' token arrays."""
  tokens, lengths = np.asarray(ex["targets"], np.int32), np.asarray(ex["sentence_lengths"])
  return np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []


def truncation(a_length: int, b_length: int, room: int) -> tuple[int, int]:
  """Tokens truncate_seq_pair removes from A and from B: always from the longer side (B
  on a tie) until A + B fit `room`. Example: (10, 3, 9) -> (4, 0); (5, 5, 7) -> (1, 2)."""
  excess = max(0, a_length + b_length - room)
  first = min(excess, abs(a_length - b_length))  # the longer side down to the shorter
  rest = excess - first  # then alternately, B first
  return ((first if a_length > b_length else 0) + rest // 2,
          (first if b_length > a_length else 0) + rest - rest // 2)


def _cut(tokens: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
  """`count` tokens off, each from the front or the back with probability 1/2 (BERT draws
  one coin per token: the number from the front is Binomial(count, 1/2))."""
  if not count:
    return tokens
  front = int(rng.binomial(count, 0.5))
  return tokens[front:len(tokens) - (count - front)]


def _example(a, b, label: int, cls_id: int, sep_id: int, room: int, rng) -> dict:
  remove_a, remove_b = truncation(len(a), len(b), room)
  a, b = _cut(a, remove_a, rng), _cut(b, remove_b, rng)
  tokens = np.concatenate([[cls_id], a, [sep_id], b, [sep_id]]).astype(np.int32)
  types = np.zeros(tokens.size, np.int32)
  types[len(a) + 2:] = 1
  return {"targets": tokens, "token_type_ids": types, "sentence_label": np.int32(label),
          "truncated_tokens": np.int32(remove_a + remove_b)}


def _document_pairs(documents, index, rng, *, room, cls_id, sep_id, order, short_seq_prob,
                    random_next_prob) -> list[dict]:
  """BERT's create_instances_from_document (see the module docstring)."""
  document, examples = documents[index], []
  target = room
  if rng.random() < short_seq_prob:
    target = int(rng.integers(2, room + 1))
  chunk, length, i = [], 0, 0
  while i < len(document):
    chunk.append(document[i])
    length += len(document[i])
    if i == len(document) - 1 or length >= target:
      a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
      a = np.concatenate(chunk[:a_end])
      b, label = None, 0
      if order == "nsp":
        if len(documents) > 1 and (len(chunk) == 1 or rng.random() < random_next_prob):
          other = int(rng.integers(len(documents) - 1))
          other = documents[other + (other >= index)]
          pieces, start = [], int(rng.integers(len(other)))
          for sentence in other[start:]:
            pieces.append(sentence)
            if sum(map(len, pieces)) >= target - len(a):
              break
          b, label = np.concatenate(pieces), 1
          i -= len(chunk) - a_end  # the unused sentences start the next chunk
        elif len(chunk) >= 2:
          b = np.concatenate(chunk[a_end:])
      else:
        if len(chunk) >= 2:
          b = np.concatenate(chunk[a_end:])
        elif len(a) >= 2:
          cut = int(rng.integers(1, len(a)))
          a, b = a[:cut], a[cut:]
        if b is not None and rng.random() < 0.5:
          a, b, label = b, a, 1
      if b is not None:
        examples.append(_example(a, b, label, cls_id, sep_id, room, rng))
      chunk, length = [], 0
    i += 1
  return examples


def create_pairs(documents, rng: np.random.Generator, *, max_length: int, cls_id: int,
                 sep_id: int, order: str = "nsp", short_seq_prob: float = 0.1,
                 random_next_prob: float = 0.5) -> list[dict]:
  """Sentence-pair examples of a group of documents (lists of non-empty sentence token
  arrays), shuffled; see the module docstring."""
  if order not in ORDERS:
    raise ConfigError(f"sentence pairs: order {order!r} is neither 'nsp' (BERT) nor 'sop' "
                      "(ALBERT)")
  if max_length < 5:
    raise ConfigError(f"sentence pairs: an inputs length of {max_length} leaves no room for "
                      "[CLS] A [SEP] B [SEP] with a token in each; use >= 5")
  documents = [d for d in documents if len(d)]
  examples = []
  for index in range(len(documents)):
    examples.extend(_document_pairs(
        documents, index, rng, room=max_length - 3, cls_id=cls_id, sep_id=sep_id, order=order,
        short_seq_prob=short_seq_prob, random_next_prob=random_next_prob))
  return [examples[i] for i in rng.permutation(len(examples))]


def full_sentences(documents, room: int, sep_id: int) -> list[np.ndarray]:
  """RoBERTa's FULL-SENTENCES packing of documents (lists of sentence token arrays) into
  pieces of at most `room` tokens ([CLS] and [SEP] not included; module docstring)."""
  pieces, current, used = [], [], 0

  def close():
    pieces.append(np.concatenate(current))
    return [], 0
  for document in documents:
    for s, sentence in enumerate(document):
      sep = int(s == 0 and used > 0)  # a document ends inside this example
      # Start a fresh example where the sentence fits one, or where not even the
      # separator and one token fit here (an example never starts with the separator).
      if used and used + sep + len(sentence) > room and (len(sentence) <= room
                                                         or used + sep >= room):
        (current, used), sep = close(), 0
      if sep:
        current.append(np.array([sep_id], np.int32))
        used += 1
      piece = sentence
      while used + len(piece) > room:  # longer than a whole example: cut it
        current.append(piece[:room - used])
        piece = piece[room - used:]
        current, used = close()
      if len(piece):
        current.append(piece)
        used += len(piece)
  if current:
    close()
  return [p.astype(np.int32) for p in pieces]


def _has_tokens(ex) -> bool:
  return len(ex["targets"]) > 0


def _with_seed(group, rng: np.random.Generator):
  return group, int(rng.integers(0, 2 ** 63 - 1))


def _special_ids(output_features, what: str) -> tuple[int, int]:
  vocabulary = output_features["targets"].vocabulary
  if vocabulary.cls_id is None or vocabulary.sep_id is None:
    raise ConfigError(f"{what}: the targets vocabulary ({vocabulary!r}) has no [CLS] / [SEP] "
                      "token; use a WordPiece or RoBERTa BPE vocabulary")
  return int(vocabulary.cls_id), int(vocabulary.sep_id)


def _inputs_length(sequence_length, what: str) -> int:
  if not sequence_length or not sequence_length.get("inputs"):
    raise ConfigError(f"{what}: needs an 'inputs' task feature length (got {sequence_length})")
  return int(sequence_length["inputs"])


class _PairGroup(grain.experimental.FlatMapTransform):
  """(tokenize_sentences documents, seed) -> their sentence pairs."""
  max_fan_out = 1 << 20  # unused by IterDataset flat maps; required by the interface

  def __init__(self, **kwargs):
    self.kwargs = kwargs

  def flat_map(self, group):
    documents, seed = group
    return create_pairs([sentences_of(d) for d in documents], np.random.default_rng(seed),
                        **self.kwargs)


def sentence_pair_preprocessors(order: str = "nsp", *, short_seq_prob: float = 0.1,
                                random_next_prob: float = 0.5) -> list:
  """After `tokenize_sentences, CACHE_POINT`: groups of 128 documents -> `[CLS] A [SEP] B
  [SEP]` examples of at most `inputs` tokens with token_type_ids, sentence_label and
  truncated_tokens (order 'nsp': BERT's next sentence; 'sop': ALBERT's sentence order).
  Rows of sentence pairs need an unpacked converter (pack=False)."""
  if order not in ORDERS:
    raise ConfigError(f"sentence_pair_preprocessors: order {order!r} is neither 'nsp' nor "
                      "'sop'")

  @stream_preprocessor
  def apply(ds: grain.IterDataset, sequence_length, output_features, seed) -> grain.IterDataset:
    what = "sentence_pair_preprocessors"
    cls_id, sep_id = _special_ids(output_features, what)
    groups = (ds.filter(_has_tokens).batch(CONCAT_GROUP, batch_fn=list)
              .random_map(_with_seed, seed=seed))
    return grain.experimental.FlatMapIterDataset(groups, _PairGroup(
        max_length=_inputs_length(sequence_length, what), cls_id=cls_id, sep_id=sep_id,
        order=order, short_seq_prob=short_seq_prob, random_next_prob=random_next_prob))
  apply.__name__ = f"sentence_pairs({order})"
  return [apply]


class _FullSentencesGroup(grain.experimental.FlatMapTransform):
  """tokenize_sentences documents -> `[CLS] piece [SEP]` examples."""
  max_fan_out = 1 << 20

  def __init__(self, length: int, cls_id: int, sep_id: int):
    self.length, self.cls_id, self.sep_id = length, cls_id, sep_id

  def flat_map(self, documents):
    pieces = full_sentences([sentences_of(d) for d in documents], self.length - 2, self.sep_id)
    return [{"targets": np.concatenate([[self.cls_id], p, [self.sep_id]]).astype(np.int32)}
            for p in pieces]


def full_sentences_preprocessors() -> list:
  """After `tokenize_sentences, CACHE_POINT`: RoBERTa's FULL-SENTENCES examples
  `[CLS] sentences [SEP]` of at most `inputs` tokens, in `targets` (mask them next)."""
  @stream_preprocessor
  def apply(ds: grain.IterDataset, sequence_length, output_features) -> grain.IterDataset:
    what = "full_sentences_preprocessors"
    cls_id, sep_id = _special_ids(output_features, what)
    length = _inputs_length(sequence_length, what)
    if length < 3:
      raise ConfigError(f"{what}: an inputs length of {length} leaves no room between [CLS] "
                        "and [SEP]; use >= 3")
    groups = ds.filter(_has_tokens).batch(CONCAT_GROUP, batch_fn=list)
    return grain.experimental.FlatMapIterDataset(groups, _FullSentencesGroup(length, cls_id,
                                                                             sep_id))
  apply.__name__ = "full_sentences"
  return [apply]
