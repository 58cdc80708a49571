"""Preprocessor chains for the self-supervised objectives, as T5 builds its pretraining tasks.

Each chain follows `tokenize, CACHE_POINT` in a task whose text sits in `targets`:
  span corruption: drop empty documents -> per group of 128: select_random_chunk of each,
    concatenate, split into pieces of the raw length that corrupts to the inputs length,
    span-corrupt, EOS on both (one fused step; full-length pieces as one vectorized batch)
  causal LM:       concatenate, split into `targets`-length pieces (no EOS)
  prefix LM:       concatenate, split into min(inputs, targets) - 1 tokens, random split -> EOS
                   on both (both halves always fit: the converter never cuts a token)
  MLM:             concatenate, split into `inputs`-length pieces (or `[CLS] piece [SEP]`),
                   BERT 80/10/10 masking of tokens, or of whole words, n-grams or spans
                   (the one MLM chain: mlm_preprocessors, its `kind` picks the masking)
  text infilling:  concatenate, split, BART span infilling -> EOS on the targets
Per-example randomness comes from the pipeline's per-example rng (deterministic, resumable);
span corruption draws from one generator per group of 128 documents, seeded the same way.
"""
from __future__ import annotations

import grain
import numpy as np

from t5lite.data.objectives import span_corruption as sc
from t5lite.data.objectives.masking import masking_step
from t5lite.data.objectives import token_objectives as objectives
from t5lite.data.preprocessors import append_eos, eos_id, stream_preprocessor
from t5lite.errors import ConfigError

CONCAT_GROUP = 128  # T5's reduce_concat_tokens batch size


def _seed(rng: np.random.Generator) -> int:
  return int(rng.integers(0, 2 ** 63 - 1))


def select_random_chunk(ex, rng, max_length: int = 65536):
  """Keeps a random chunk of at most max_length tokens of `targets`; drops empty documents."""
  # The Generator itself as the seed: it is only drawn from for documents longer than
  # max_length, so short documents (nearly all) skip a draw.
  chunk = sc.select_random_chunk(np.asarray(ex["targets"]), seed=rng, max_length=max_length)
  return {"targets": chunk} if len(chunk) else None


class _SplitGroup(grain.experimental.FlatMapTransform):
  """A group of documents -> their concatenation cut into pieces of `length` tokens."""
  max_fan_out = 1 << 20  # unused by IterDataset flat maps; required by the interface

  def __init__(self, length: int):
    self.length = length

  def flat_map(self, documents):
    # One group of T5's reduce_concat_tokens: the array-level concat_and_split over the group.
    pieces = sc.concat_and_split((np.asarray(d["targets"], np.int32) for d in documents),
                                 self.length, group_size=None)
    return [{"targets": piece} for piece in pieces]


def concat_and_split(length_fn):
  """Stream preprocessor: groups of 128 documents concatenated (no separator, no EOS) and
  split into pieces of length_fn(sequence_length) tokens; a group's last piece is shorter."""
  @stream_preprocessor
  def apply(ds: grain.IterDataset, sequence_length) -> grain.IterDataset:
    groups = ds.batch(CONCAT_GROUP, batch_fn=list)
    return grain.experimental.FlatMapIterDataset(groups, _SplitGroup(length_fn(sequence_length)))
  apply.__name__ = "concat_and_split"
  return apply


def _with_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
  """EOS after the last axis: [[5 6]] -> [[5 6 1]] (eos_id 1, T5's)."""
  eos = np.full(tokens.shape[:-1] + (1,), eos_id, np.int32)
  return np.concatenate([tokens, eos], axis=-1)


class _CorruptGroup(grain.experimental.FlatMapTransform):
  """(non-empty documents, seed) -> T5 span-corrupted examples of their concatenation's pieces.

  The same examples as select_random_chunk -> concat_and_split -> span_corruption ->
  append_eos document by document and piece by piece (corruption.py), but every random draw of
  a group comes from one generator and its full-length pieces go through
  span_corruption_batch at once: per document and per piece, a generator of its own and a
  pass through grain's map and filter stages cost more than the corruption itself. Example
  (length 568, 128 documents of 470 tokens): 105 examples of 512 / 114 tokens (EOS
  included), then the last piece's shorter one.
  """
  max_fan_out = 1 << 20  # unused by IterDataset flat maps; required by the interface

  def __init__(self, length: int, vocab_size: int, eos: tuple[int | None, int | None],
               noise_density: float, mean_noise_span_length: float, max_length: int = 65536):
    self.length, self.eos, self.max_length = length, eos, max_length
    self.kwargs = dict(vocab_size=vocab_size, noise_density=noise_density,
                       mean_noise_span_length=mean_noise_span_length)

  def _example(self, inputs: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    return {"inputs": inputs if self.eos[0] is None else _with_eos(inputs, self.eos[0]),
            "targets": targets if self.eos[1] is None else _with_eos(targets, self.eos[1])}

  def flat_map(self, group):
    documents, rng = group  # rng: a numpy Generator or a seed for one
    rng = np.random.default_rng(rng)
    # select_random_chunk; documents of max_length tokens or fewer (nearly all) draw nothing.
    tokens = np.concatenate([sc.select_random_chunk(np.asarray(d["targets"], np.int32),
                                                    seed=rng, max_length=self.max_length)
                             for d in documents])
    full = tokens.shape[0] // self.length
    if self.kwargs["noise_density"] <= 0 or self.length < 2:
      full = 0  # outside span_corruption_batch's domain: every piece goes one by one
    examples = []
    if full:
      pieces = tokens[:full * self.length].reshape(full, self.length)  # (full, length)
      # The same Generator for every row: rows draw consecutive keys, no per-row seeding.
      batch = self._example(*sc.span_corruption_batch(pieces, seeds=[rng] * full, **self.kwargs))
      examples = [{"inputs": i, "targets": t} for i, t in zip(batch["inputs"], batch["targets"])]
    for start in range(full * self.length, tokens.shape[0], self.length):  # the short last piece
      examples.append(self._example(*sc.span_corruption(
          tokens[start:start + self.length], seed=rng, **self.kwargs)))
    return examples


class _CorruptedGroupsIterator(grain.DatasetIterator):
  """State {"parent": P, "group": g, "emitted": k}: the current group is the g-th (0-based),
  read from parent state P, and k of its examples were returned. Restoring re-reads and
  re-corrupts that group (its seed is (seed, g)) and skips k: the same examples follow."""

  def __init__(self, parent: grain.DatasetIterator, corrupt: _CorruptGroup, seed: int):
    super().__init__(parent)
    self._corrupt, self._seed = corrupt, seed
    self._group, self._start = -1, parent.get_state()
    self._examples: list = []
    self._emitted = 0

  def _next_group(self) -> None:
    self._start = self._parent.get_state()
    documents = []
    for document in self._parent:  # empty documents do not count towards a group
      if len(document["targets"]):
        documents.append(document)
        if len(documents) == CONCAT_GROUP:
          break
    self._group += 1
    self._emitted = 0
    self._examples = self._corrupt.flat_map(
        (documents, np.random.default_rng([self._seed, self._group]))) if documents else []
    if not documents:
      raise StopIteration

  def __next__(self):
    while self._emitted == len(self._examples):
      self._next_group()
    self._emitted += 1
    return self._examples[self._emitted - 1]

  def get_state(self):
    if self._emitted == len(self._examples):  # between groups: the next one starts here
      return {"parent": self._parent.get_state(), "group": self._group + 1, "emitted": 0}
    return {"parent": self._start, "group": self._group, "emitted": self._emitted}

  def set_state(self, state):
    if not {"parent", "group", "emitted"} <= set(state):
      raise ConfigError(
          "this span corruption data state was saved by an earlier t5lite (its groups went "
          f"through grain's filter, batch and flat_map stages; keys {sorted(state)}): resume "
          "the run with the t5lite that saved it, or train in a new MODEL_DIR")
    self._parent.set_state(state["parent"])
    self._group, self._examples, self._emitted = state["group"] - 1, [], 0
    if state["emitted"]:
      self._next_group()
      self._emitted = state["emitted"]


class _CorruptedGroups(grain.IterDataset):
  """Groups of 128 non-empty documents of the parent, each span-corrupted by _CorruptGroup
  with a generator of its own ((seed, group index)), as a stream of examples.

  One step instead of filter -> batch(128) -> random_map -> flat_map: grain's per-element
  statistics and state bookkeeping in those four stages cost more per document than the
  corruption itself (bench data: ~30% of the pipeline's time)."""

  def __init__(self, parent: grain.IterDataset, corrupt: _CorruptGroup, seed: int):
    super().__init__(parent)
    self._corrupt, self._seed = corrupt, seed

  def __iter__(self):
    return _CorruptedGroupsIterator(iter(self._parent), self._corrupt, self._seed)


def _corrupt_groups(raw_length, noise_density: float, mean_noise_span_length: float):
  """Stream preprocessor: groups of 128 non-empty documents -> random chunks, concatenated,
  split, span-corrupted, with EOS."""
  @stream_preprocessor
  def apply(ds: grain.IterDataset, sequence_length, output_features,
            seed) -> grain.IterDataset:
    vocab_size = output_features["targets"].vocabulary.vocab_size
    # Each feature's EOS id (its vocabulary's), or None where it gets none.
    eos = tuple(int(eos_id(output_features[name], name))
                if name in output_features and output_features[name].add_eos else None
                for name in ("inputs", "targets"))
    return _CorruptedGroups(ds, _CorruptGroup(raw_length(sequence_length), vocab_size, eos,
                                              noise_density, mean_noise_span_length), seed)
  apply.__name__ = "concat_split_and_span_corrupt"
  return apply


def span_corruption_preprocessors(noise_density: float = 0.15,
                                  mean_noise_span_length: float = 3.0) -> list:
  """T5's span corruption after `tokenize, CACHE_POINT` (see corruption.py), as one step:
  select_random_chunk, concatenate 128 documents, split, span-corrupt, append EOS."""
  def raw_length(sequence_length):
    return sc.span_corruption_lengths(sequence_length["inputs"], noise_density,
                                      mean_noise_span_length)[0]

  return [_corrupt_groups(raw_length, noise_density, mean_noise_span_length)]


def causal_lm_preprocessors() -> list:
  """Causal LM: fixed-length pieces of the concatenated documents in `targets`."""
  return [select_random_chunk, concat_and_split(lambda lengths: lengths["targets"])]


def prefix_lm_preprocessors() -> list:
  """Prefix LM: a random split of each piece into inputs and targets, EOS on both."""
  def split(ex, rng):
    inputs, targets = objectives.prefix_lm(ex["targets"], seed=_seed(rng))
    return {"inputs": inputs, "targets": targets} if len(targets) else None
  # Pieces of min(I, T) - 1 tokens, split anywhere: both halves plus EOS always fit their
  # feature lengths, so the converter never cuts a token (T5's prefix_lm splits
  # inputs-length pieces by a random prefix the same way).
  room = lambda lengths: min(lengths["inputs"], lengths["targets"]) - 1
  return [select_random_chunk, concat_and_split(room), split, append_eos]


def mlm_preprocessors(mask_id: int | None = None, *, kind: str | None = None,
                      add_cls_sep: bool = False, vocabulary_specials: bool = False,
                      **mlm_kwargs) -> list:
  """Masked LM on `inputs`-length pieces: inputs (corrupted), targets (original), weights.

  kind: None is BERT's MLM over single tokens by objectives.mlm (T5's specials 0, 1, 2 and the
    ids above them, unless vocabulary_specials); 'token', 'whole_word', 'ngram' or 'span' are
    the masking variants of t5lite.data.objectives.masking over the vocabulary's pieces (the
    vocabulary's special tokens are never chosen; 'span' also gives SpanBERT's boundary
    features). mlm_kwargs go to the masking (mask_rate, random_rate, keep_rate, ...).
  mask_id: None takes the targets vocabulary's mask_id ([MASK] for BERT's WordPiece;
    T5's <extra_id_0>, or unk without extra ids). kind=None only.
  add_cls_sep: each piece is `[CLS] tokens [SEP]` (the vocabulary's cls_id and sep_id),
    `inputs` tokens in all, as BERT's create_pretraining_data makes them.
  vocabulary_specials: (kind=None) never choose any of the vocabulary's special tokens
    (vocabulary.special_tokens, wherever their ids are) and draw random replacements from
    all other ids, instead of objectives.mlm's special_ids (T5's 0, 1, 2) and the ids above
    them. A BERT task wants both, so that [CLS], [SEP] (and [MASK] typed in the text) are
    never masked nor drawn as a random token.
  Dynamic masking: the pipeline's rng differs per example and epoch, so each pass over the
  data draws new masks (RoBERTa)."""
  name = "mlm_preprocessors" + (f"(kind={kind!r})" if kind else "")
  if kind is not None:
    if mask_id is not None or vocabulary_specials:
      raise ConfigError(f"{name}: mask_id and vocabulary_specials are for kind=None; the "
                        "masking variants take the vocabulary's [MASK] and special tokens")
    mask = masking_step(kind, add_cls_sep=add_cls_sep, **mlm_kwargs)
  elif vocabulary_specials and "special_ids" in mlm_kwargs:
    raise ConfigError("mlm_preprocessors: pass special_ids or vocabulary_specials, not both")
  else:
    def mask(ex, rng, output_features):
      vocabulary = output_features["targets"].vocabulary
      tokens = ex["targets"]
      if add_cls_sep:
        if vocabulary.cls_id is None or vocabulary.sep_id is None:
          raise ConfigError(f"mlm_preprocessors(add_cls_sep=True): the vocabulary "
                            f"({vocabulary!r}) has no [CLS] / [SEP] token")
        tokens = np.concatenate([[vocabulary.cls_id], tokens, [vocabulary.sep_id]])
      kwargs = dict(mlm_kwargs)
      if vocabulary_specials:
        kwargs.update(special_ids=tuple(sorted(set(vocabulary.special_tokens.values()))),
                      random_above_specials=False)
      return objectives.mlm(tokens, seed=_seed(rng), vocab_size=vocabulary.vocab_size,
                            mask_id=vocabulary.mask_id if mask_id is None else mask_id,
                            **kwargs)

  def room(lengths):
    if not add_cls_sep:
      return lengths["inputs"]
    if lengths["inputs"] < 3:
      raise ConfigError(f"{name} with add_cls_sep=True: the inputs length "
                        f"{lengths['inputs']} leaves no room for a token between [CLS] and "
                        "[SEP]; use >= 3")
    return lengths["inputs"] - 2
  return [select_random_chunk, concat_and_split(room), mask]


def text_infilling_preprocessors(mask_id: int, **infilling_kwargs) -> list:
  """BART text infilling: masked spans in inputs, the whole piece (plus EOS) as targets."""
  def infill(ex, rng):
    inputs, targets = objectives.text_infilling(ex["targets"], seed=_seed(rng), mask_id=mask_id,
                                                **infilling_kwargs)
    return {"inputs": inputs, "targets": targets}
  room = lambda lengths: min(lengths["inputs"], lengths["targets"]) - 1
  return [select_random_chunk, concat_and_split(room), infill, append_eos]
