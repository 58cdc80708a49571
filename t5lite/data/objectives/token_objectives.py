"""Pretraining objectives other than span corruption: BERT MLM, prefix LM, BART text infilling.

Each objective is a pure per-example numpy function of one 1-D token array and a stateless
`seed` (an int or a sequence of ints such as (task_seed, example_index), fed to
np.random.default_rng), so any process can recompute any example. Causal LM (GPT) needs no
function here: `span_corruption.concat_and_split(documents, length)` makes the pieces (in a
task, through chains.causal_lm_preprocessors) and the feature converter shifts targets right
into decoder inputs.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from t5lite.data.objectives.span_corruption import Seed


def mlm(tokens: np.ndarray, *, seed: Seed, vocab_size: int, mask_id: int,
        mask_rate: float = 0.15, random_rate: float = 0.1, keep_rate: float = 0.1,
        special_ids: Sequence[int] = (0, 1, 2),
        random_above_specials: bool = True) -> dict[str, np.ndarray]:
  """BERT masked LM: choose ~mask_rate of the non-special positions; of those, a fraction
  `random_rate` become a random token, `keep_rate` stay unchanged, the rest become `mask_id`.

  As BERT's create_pretraining_data: exactly max(1, round(mask_rate * n)) of the n non-special
  positions are chosen (none if n == 0 or mask_rate == 0), uniformly without replacement;
  special ids are never chosen. Random tokens come from [max(special_ids) + 1, vocab_size)
  (T5's layout keeps its specials lowest), or with random_above_specials=False uniformly from
  every id in [0, vocab_size) but the special ids (BERT's vocab.txt has its specials at
  0 and 100-103, RoBERTa its <mask> on top).
  Returns int32 `inputs` (corrupted), int32 `targets` (the original tokens) and float32
  `weights` (1.0 on chosen positions, the only ones that carry loss).
  Dynamic masking (RoBERTa) = fresh masks each epoch: the caller folds the epoch into the
  seed, e.g. seed=(task_seed, epoch, example_index).
  Example (mask_id 4): [1 7 8 9 10 11 12 13 14 15 16 17 18 19 20 1] -> e.g.
  inputs [1 7 8 4 10 11 12 13 14 15 16 4 18 19 20 1], weights 1.0 at positions 3 and 11.
  """
  if random_rate + keep_rate > 1.0:
    raise ValueError(f"random_rate + keep_rate = {random_rate + keep_rate} > 1")
  tokens = np.asarray(tokens).astype(np.int32, copy=False)
  inputs = tokens.copy()
  weights = np.zeros(tokens.shape[0], np.float32)
  allowed = np.ones(tokens.shape[0], bool)
  for special in special_ids:  # A handful of ids: cheaper than np.isin's sort-based path.
    allowed &= tokens != special
  candidates = np.flatnonzero(allowed)
  if candidates.size == 0 or mask_rate <= 0.0:
    return {"inputs": inputs, "targets": tokens, "weights": weights}
  rng = np.random.default_rng(seed)
  count = min(candidates.size, max(1, round(mask_rate * candidates.size)))
  chosen = candidates[rng.choice(candidates.size, count, replace=False)]
  action = rng.random(count)  # < random_rate: random token; next keep_rate: keep; else mask.
  inputs[chosen[action >= random_rate + keep_rate]] = mask_id
  randomized = chosen[action < random_rate]
  if random_above_specials:
    low = max(special_ids) + 1 if len(special_ids) else 0
    inputs[randomized] = rng.integers(low, vocab_size, randomized.size, dtype=np.int32)
  else:
    # The r-th non-special id for r drawn in [0, vocab_size - #specials): step over each
    # special id (ascending) that the running value reaches.
    skipped = np.unique(np.asarray([i for i in special_ids if 0 <= i < vocab_size], np.int32))
    draws = rng.integers(0, vocab_size - skipped.size, randomized.size, dtype=np.int32)
    for special in skipped:
      draws += draws >= special
    inputs[randomized] = draws
  weights[chosen] = 1.0
  return {"inputs": inputs, "targets": tokens, "weights": weights}


def prefix_lm(tokens: np.ndarray, *, seed: Seed,
              min_prefix: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Split at a point drawn uniformly from [min_prefix, len - 1]: (prefix, rest).

  This is T5's prefix_lm (random_prefix_noise_mask at noise_density 0.5): the prefix is
  non-empty and at least one token is left to predict. min_prefix is capped at len - 1.
  Sequences shorter than 2 tokens cannot be split: inputs are empty and targets are the whole
  sequence, as the reference gives. Example: [5 6 7 8] -> one of ([5], [6 7 8]),
  ([5 6], [7 8]), ([5 6 7], [8]).
  """
  tokens = np.asarray(tokens).astype(np.int32, copy=False)
  length = tokens.shape[0]
  if length < 2:
    return tokens[:0], tokens
  low = min(max(min_prefix, 0), length - 1)
  split = int(np.random.default_rng(seed).integers(low, length))  # high is exclusive.
  return tokens[:split], tokens[split:]


def infilling_spans(length: int, *, seed: Seed, mask_ratio: float = 0.3,
                    poisson_lambda: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
  """Non-overlapping BART infilling spans of a `length`-token sequence: (starts, lengths).

  As fairseq's BART: masks ceil(length * mask_ratio) tokens in spans of Poisson(lambda)
  lengths, drawn until they cover the budget, the last one cut to fit. Length-0 spans mean
  "insert a mask here". Unlike fairseq, spans never overlap (so exactly the budget is masked):
  their order is shuffled and they are placed uniformly among the unmasked tokens (stars and
  bars). Sorted by start; a 0-length span may share its start with the next span.
  Example: length 10, ratio 0.3 -> e.g. starts [2 6], lengths [1 2] (3 tokens masked).
  """
  if poisson_lambda <= 0:
    raise ValueError(f"poisson_lambda must be > 0, got {poisson_lambda}")
  rng = np.random.default_rng(seed)
  budget = math.ceil(length * mask_ratio) if length and mask_ratio > 0 else 0
  if budget == 0:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  budget = min(budget, length)
  draws = rng.poisson(poisson_lambda, 2 * int(budget / poisson_lambda) + 8)
  while draws.sum() < budget:  # Rarely more than once: the first batch has ~2x the budget.
    draws = np.concatenate([draws, rng.poisson(poisson_lambda, draws.size)])
  cum = np.cumsum(draws)
  last = int(np.searchsorted(cum, budget))  # First span that reaches the budget.
  lengths = draws[:last + 1].astype(np.int64)
  lengths[last] = budget - (cum[last - 1] if last else 0)
  lengths = rng.permutation(lengths)  # Otherwise the cut-down span would always come last.
  # Stars and bars: the spans take `count` of the (length - budget + count) slots of the
  # output, uniformly; slot positions of the spans are also their mask positions in inputs.
  count = lengths.size
  slots = np.sort(rng.choice(length - budget + count, count, replace=False))
  starts = slots - np.arange(count) + np.cumsum(lengths) - lengths
  return starts, lengths


def text_infilling(tokens: np.ndarray, *, seed: Seed, mask_id: int, mask_ratio: float = 0.3,
                   poisson_lambda: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
  """BART text infilling: each span of `infilling_spans` becomes a single `mask_id`.

  Returns int32 (inputs, targets); targets are the original tokens. The spans are
  `infilling_spans(len(tokens), seed=seed, ...)` (same seed, same spans), which is how the
  inputs expand back to the targets. Example (mask_id 4, spans starts [2 6] lengths [1 2]):
  [10 11 12 13 14 15 16 17 18 19] -> inputs [10 11 4 13 14 15 4 18 19].
  """
  tokens = np.asarray(tokens).astype(np.int32, copy=False)
  length = tokens.shape[0]
  starts, lengths = infilling_spans(length, seed=seed, mask_ratio=mask_ratio,
                                    poisson_lambda=poisson_lambda)
  # Covered positions: for span j, starts[j] + (0 .. lengths[j]-1), as one ragged arange.
  offsets = np.cumsum(lengths) - lengths
  total = int(lengths.sum())
  covered = np.repeat(starts - offsets, lengths) + np.arange(total)
  kept = np.ones(length, bool)
  kept[covered] = False
  # Mask j lands after the kept tokens before span j and the j earlier masks.
  mask_pos = starts - offsets + np.arange(starts.size)
  is_mask = np.zeros(length - total + starts.size, bool)
  is_mask[mask_pos] = True
  inputs = np.empty(is_mask.size, np.int32)
  inputs[is_mask] = mask_id
  inputs[~is_mask] = tokens[kept]
  return inputs, tokens
