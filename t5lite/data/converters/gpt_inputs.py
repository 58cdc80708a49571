"""GPT-1's input transformations (Radford et al. 2018, figure 1): a structured input as one
token stream for a decoder, with its classifier reading the last token.

  classification  [START] text [EXTRACT]
  entailment      [START] premise [DELIM] hypothesis [EXTRACT]

The three tokens are added to the vocabulary (ByteLevelBPEVocabulary.with_added_tokens, as
HF's `add_special_tokens`) and to the model's embedding: a checkpoint with fewer rows grows
fresh ones (t5lite.train.warm_start); a table padded past the vocabulary (4096 rows for
4000 ids) already has rows for them, never read in pretraining. The model is a decoder-only
model with ModelConfig.head = 'sequence_classification' (the classifier on the last real
token, which is [EXTRACT]) and lm_loss_weight = 0.5, GPT-1's auxiliary LM objective
L3 = L2 + 0.5 L1 over the same tokens.

Worked example (inputs length 8, word pieces shown as text; [START] 4000, [DELIM] 4001,
[EXTRACT] 4002):

  {"tokens_a": [the cat sat], "tokens_b": [a dog ran off], "label": 1}      (encode_pair)
  -> gpt1_inputs(task)
  -> {"inputs": [4000 the cat sat 4001 a dog 4002], "label": 1, "truncated_tokens": 2}

Truncation is longest first, as the BERT-style pairs (t5lite.data.converters.head_features),
counted. Not built: GPT-1's similarity transform (both orders, representations summed) and its
multiple-choice transform (one stream per answer): they need a head over several streams.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from t5lite.data.converters import head_features
from t5lite.errors import ConfigError

START, DELIM, EXTRACT = "[START]", "[DELIM]", "[EXTRACT]"
GPT1_TOKENS = (START, DELIM, EXTRACT)


def gpt1_vocabulary(vocabulary):
  """A byte-level BPE vocabulary with [START], [DELIM] and [EXTRACT] appended."""
  return vocabulary.with_added_tokens(GPT1_TOKENS)


def gpt1_token_ids(vocabulary, task: str) -> tuple[int, int, int]:
  token_id = getattr(vocabulary, "token_id", None)
  added = getattr(vocabulary, "added_tokens", ())
  if token_id is None or not set(GPT1_TOKENS) <= set(added):
    raise ConfigError(f"task {task!r}: GPT-1's input transformation needs a vocabulary with "
                      f"{GPT1_TOKENS} added (t5lite.data.converters.gpt_inputs.gpt1_vocabulary); "
                      f"{vocabulary!r} has not")
  return tuple(token_id(t) for t in GPT1_TOKENS)


def build_gpt1(a: np.ndarray, b: np.ndarray | None, length: int, ids: tuple[int, int, int]):
  """[START] a ([DELIM] b) [EXTRACT] cut to `length` -> (inputs, tokens cut)."""
  start, delim, extract = ids
  a, b, cut = head_features.truncate_longest_first(a, b, length - (2 if b is None else 3))
  middle = [a] if b is None else [a, [delim], b]
  return np.concatenate([[start], *middle, [extract]]).astype(np.int32), cut


def gpt1_inputs(task: str) -> Callable:
  """After CACHE_POINT (following head_features.encode_pair): tokens_a / tokens_b -> GPT-1's
  `inputs`, truncated_tokens (counted in head_features.truncation_stats)."""
  def apply(ex: dict, output_features, sequence_length) -> dict:
    length = head_features.inputs_length(sequence_length, task)
    ids = gpt1_token_ids(output_features["inputs"].vocabulary, task)
    inputs, cut = build_gpt1(ex["tokens_a"], ex.get("tokens_b"), length, ids)
    head_features.count_truncation(task, cut, length)
    out = {k: v for k, v in ex.items() if k not in ("tokens_a", "tokens_b")}
    return {**out, "inputs": inputs, "truncated_tokens": np.int32(cut)}
  apply.__name__ = f"gpt1_inputs({task})"
  return apply
