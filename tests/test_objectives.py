"""MLM, prefix LM and text infilling keep their statistical and structural promises."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from t5lite.data.objectives.token_objectives import infilling_spans, mlm, prefix_lm, text_infilling

MASK = 4
VOCAB = 1000


def long_sequence(n=40_000, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(5, VOCAB, n).astype(np.int32)
  tokens[rng.random(n) < 0.05] = 1  # Sprinkle specials (EOS) that must never be chosen.
  tokens[0] = 0
  return tokens


def test_mlm_proportions():
  tokens = long_sequence()
  out = mlm(tokens, seed=(1, 0), vocab_size=VOCAB, mask_id=MASK)
  inputs, targets, weights = out["inputs"], out["targets"], out["weights"]
  assert inputs.dtype == np.int32 and weights.dtype == np.float32
  np.testing.assert_array_equal(targets, tokens)
  special = np.isin(tokens, (0, 1, 2))
  chosen = weights == 1.0
  assert set(np.unique(weights)) <= {0.0, 1.0}
  assert not chosen[special].any()
  np.testing.assert_array_equal(inputs[special], tokens[special])
  assert chosen.sum() == round(0.15 * (~special).sum())  # Exact count, as BERT.
  assert not (inputs != tokens)[~chosen].any()  # Only chosen positions change.
  masked = (inputs == MASK)[chosen].mean()
  unchanged = (inputs == tokens)[chosen].mean()
  randomized = 1 - masked - unchanged
  # ~5,700 chosen: 3 sigma of a 10% share is ~1.2 points.
  assert abs(masked - 0.8) < 0.025 and abs(unchanged - 0.1) < 0.02
  assert abs(randomized - 0.1) < 0.02
  replaced = inputs[chosen & (inputs != MASK) & (inputs != tokens)]
  assert replaced.min() >= 3 and replaced.max() < VOCAB


def test_mlm_rates_and_edges():
  tokens = long_sequence(20_000, seed=2)
  out = mlm(tokens, seed=3, vocab_size=VOCAB, mask_id=MASK, mask_rate=0.3, random_rate=0.0,
            keep_rate=0.0)
  chosen = out["weights"] == 1
  assert (out["inputs"][chosen] == MASK).all()
  assert abs(chosen.mean() - 0.3 * 0.95) < 0.01
  one = mlm(np.array([1, 9, 1]), seed=0, vocab_size=VOCAB, mask_id=MASK)
  assert one["weights"].tolist() == [0.0, 1.0, 0.0]  # At least one position when possible.
  none = mlm(np.array([0, 1, 2, 1]), seed=0, vocab_size=VOCAB, mask_id=MASK)
  assert none["weights"].sum() == 0 and none["inputs"].tolist() == [0, 1, 2, 1]
  empty = mlm(np.zeros(0, np.int32), seed=0, vocab_size=VOCAB, mask_id=MASK)
  assert empty["inputs"].size == 0 and empty["weights"].size == 0


def test_mlm_dynamic_masking_is_seeded():
  tokens = long_sequence(2000)
  a = mlm(tokens, seed=(7, 0, 5), vocab_size=VOCAB, mask_id=MASK)
  b = mlm(tokens, seed=(7, 0, 5), vocab_size=VOCAB, mask_id=MASK)
  c = mlm(tokens, seed=(7, 1, 5), vocab_size=VOCAB, mask_id=MASK)  # Next epoch.
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(a["weights"], c["weights"])


def test_prefix_lm_split_covers():
  tokens = np.arange(10, 16)
  splits = []
  for seed in range(600):
    inputs, targets = prefix_lm(tokens, seed=seed)
    assert np.concatenate([inputs, targets]).tolist() == tokens.tolist()
    splits.append(len(inputs))
  counts = np.bincount(splits, minlength=6)
  assert counts[0] == 0 and (counts[1:] > 80).all()  # Uniform over [1, 5]: ~120 each.
  assert {len(prefix_lm(tokens, seed=s, min_prefix=3)[0]) for s in range(100)} == {3, 4, 5}
  assert {len(prefix_lm(tokens, seed=s, min_prefix=9)[0]) for s in range(10)} == {5}
  inputs, targets = prefix_lm(np.array([7]), seed=0)
  assert inputs.tolist() == [] and targets.tolist() == [7]
  inputs, targets = prefix_lm(np.zeros(0, np.int32), seed=0)
  assert inputs.size == 0 and targets.size == 0


def expand(inputs, tokens, starts, lengths):
  """Replace the j-th mask in inputs by tokens[starts[j]:starts[j]+lengths[j]]."""
  out, j = [], 0
  for tok in inputs.tolist():
    if tok == MASK:
      out += tokens[starts[j]:starts[j] + lengths[j]].tolist()
      j += 1
    else:
      out.append(tok)
  assert j == len(starts)
  return out


@settings(max_examples=150, deadline=None)
@given(length=st.integers(0, 600), seed=st.integers(0, 2**32),
       ratio=st.sampled_from([0.3, 0.3, 0.1, 0.5, 1.0]), lam=st.sampled_from([3.0, 3.0, 0.5, 8.0]))
def test_text_infilling_expands_back(length, seed, ratio, lam):
  tokens = np.random.default_rng(seed).integers(5, VOCAB, length)
  inputs, targets = text_infilling(tokens, seed=seed, mask_id=MASK, mask_ratio=ratio,
                                   poisson_lambda=lam)
  starts, lengths = infilling_spans(length, seed=seed, mask_ratio=ratio, poisson_lambda=lam)
  np.testing.assert_array_equal(targets, tokens)
  assert expand(inputs, tokens, starts, lengths) == tokens.tolist()
  budget = math.ceil(length * ratio)
  assert lengths.sum() == budget and (lengths >= 0).all()
  assert len(inputs) == length - budget + len(starts)
  ends = starts + lengths
  assert (starts[1:] >= ends[:-1]).all() and (starts >= 0).all() and (ends <= length).all()


def test_text_infilling_ratio_and_spans():
  tokens = np.random.default_rng(0).integers(5, VOCAB, 20_000)
  inputs, _ = text_infilling(tokens, seed=1, mask_id=MASK)
  starts, lengths = infilling_spans(tokens.size, seed=1)
  assert lengths.sum() == 6000  # ceil(0.3 * 20000) tokens masked: ratio 0.30.
  assert abs(lengths.mean() - 3.0) < 0.2  # Poisson(3) span lengths.
  assert abs((lengths == 0).mean() - math.exp(-3)) < 0.025  # Length-0 spans = inserted masks.
  assert (inputs == MASK).sum() == lengths.size
  # Docstring example.
  example = np.arange(10, 20)
  got = expand(np.array([10, 11, 4, 13, 14, 15, 4, 18, 19]), example, [2, 6], [1, 2])
  assert got == example.tolist()
