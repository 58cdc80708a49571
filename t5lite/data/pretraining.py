"""Preprocessor chains for the self-supervised objectives, as T5 builds its pretraining tasks.

Each chain follows `tokenize, CACHE_POINT` in a task whose text sits in `targets`:
  span corruption: select_random_chunk -> concatenate 128 documents, split into pieces of
    the raw length that corrupts to the inputs length -> span_corruption -> EOS on both
  causal LM:       concatenate, split into `targets`-length pieces (no EOS)
  prefix LM:       concatenate, split into inputs+targets-2 tokens, random split -> EOS on both
  MLM:             concatenate, split into `inputs`-length pieces, BERT 80/10/10 masking
  text infilling:  concatenate, split, BART span infilling -> EOS on the targets
Per-example randomness comes from the pipeline's per-example rng (deterministic, resumable).
"""
from __future__ import annotations

import grain
import numpy as np

from t5lite.data import corruption as sc, objectives
from t5lite.data.preprocessors import append_eos, stream_preprocessor

CONCAT_GROUP = 128  # T5's reduce_concat_tokens batch size


def _seed(rng: np.random.Generator) -> int:
  return int(rng.integers(0, 2 ** 63 - 1))


def select_random_chunk(ex, rng, max_length: int = 65536):
  """Keeps a random chunk of at most max_length tokens of `targets`; drops empty documents."""
  chunk = sc.select_random_chunk(np.asarray(ex["targets"]), seed=_seed(rng), max_length=max_length)
  return {"targets": chunk} if len(chunk) else None


class _SplitGroup(grain.experimental.FlatMapTransform):
  """A group of documents -> their concatenation cut into pieces of `length` tokens."""
  max_fan_out = 1 << 20  # unused by IterDataset flat maps; required by the interface

  def __init__(self, length: int):
    self.length = length

  def flat_map(self, documents):
    tokens = np.concatenate([np.asarray(d["targets"], np.int32) for d in documents])
    return [{"targets": piece} for piece in sc.split_tokens(tokens, self.length)]


def concat_and_split(length_fn):
  """Stream preprocessor: groups of 128 documents concatenated (no separator, no EOS) and
  split into pieces of length_fn(sequence_length) tokens; a group's last piece is shorter."""
  @stream_preprocessor
  def apply(ds: grain.IterDataset, sequence_length) -> grain.IterDataset:
    groups = ds.batch(CONCAT_GROUP, batch_fn=list)
    return grain.experimental.FlatMapIterDataset(groups, _SplitGroup(length_fn(sequence_length)))
  apply.__name__ = "concat_and_split"
  return apply


def span_corruption_preprocessors(noise_density: float = 0.15,
                                  mean_noise_span_length: float = 3.0) -> list:
  """T5's span corruption after `tokenize, CACHE_POINT` (REFERENCE §1)."""
  def raw_length(sequence_length):
    return sc.span_corruption_lengths(sequence_length["inputs"], noise_density,
                                      mean_noise_span_length)[0]

  def corrupt(ex, rng, output_features):
    vocab_size = output_features["targets"].vocabulary.vocab_size
    inputs, targets = sc.span_corruption(
        ex["targets"], seed=_seed(rng), vocab_size=vocab_size, noise_density=noise_density,
        mean_noise_span_length=mean_noise_span_length)
    return {"inputs": inputs, "targets": targets}

  return [select_random_chunk, concat_and_split(raw_length), corrupt, append_eos]


def causal_lm_preprocessors() -> list:
  """Causal LM: fixed-length pieces of the concatenated documents in `targets`."""
  return [select_random_chunk, concat_and_split(lambda lengths: lengths["targets"])]


def prefix_lm_preprocessors() -> list:
  """Prefix LM: a random split of each piece into inputs and targets, EOS on both."""
  def split(ex, rng):
    inputs, targets = objectives.prefix_lm(ex["targets"], seed=_seed(rng))
    return {"inputs": inputs, "targets": targets} if len(targets) else None
  room = lambda lengths: lengths["inputs"] + lengths["targets"] - 2  # both EOS must fit
  return [select_random_chunk, concat_and_split(room), split, append_eos]


def mlm_preprocessors(mask_id: int, **mlm_kwargs) -> list:
  """BERT MLM on `inputs`-length pieces: inputs (corrupted), targets (original), weights.

  Dynamic masking: the pipeline's rng differs per example and epoch, so each pass over the
  data draws new masks (RoBERTa)."""
  def mask(ex, rng, output_features):
    vocab_size = output_features["targets"].vocabulary.vocab_size
    return objectives.mlm(ex["targets"], seed=_seed(rng), vocab_size=vocab_size,
                          mask_id=mask_id, **mlm_kwargs)
  return [select_random_chunk, concat_and_split(lambda lengths: lengths["inputs"]), mask]


def text_infilling_preprocessors(mask_id: int, **infilling_kwargs) -> list:
  """BART text infilling: masked spans in inputs, the whole piece (plus EOS) as targets."""
  def infill(ex, rng):
    inputs, targets = objectives.text_infilling(ex["targets"], seed=_seed(rng), mask_id=mask_id,
                                                **infilling_kwargs)
    return {"inputs": inputs, "targets": targets}
  room = lambda lengths: min(lengths["inputs"], lengths["targets"]) - 1
  return [select_random_chunk, concat_and_split(room), infill, append_eos]
