"""T5 span corruption and its chunk/concat/split helpers agree with T5's own
(t5.data.preprocessors.span_corruption)."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t5lite.data.objectives.span_corruption import (concat_and_split, noise_span_to_unique_sentinel,
                                         random_spans_noise_mask, select_random_chunk,
                                         span_corruption, span_corruption_batch,
                                         span_corruption_lengths, split_tokens)

VOCAB = 32100
FIRST_SENTINEL = VOCAB - 1
TOKENS_BELOW = 30000  # Test tokens stay below every sentinel (<= 1250 spans in these tests).


def reference_counts(length, density=0.15, mean=3.0):
  """(num_noise, num_spans) exactly as the TF reference computes them (float32)."""
  length = max(length, 2)
  noise = int(np.round(np.float32(length) * np.float32(density)))
  noise = min(max(noise, 1), length - 1)
  return noise, max(int(np.round(np.float32(noise) / np.float32(mean))), 1)


def split_at_sentinels(seq):
  """[a a S b S c] -> [[a a], [b], [c]] where S is any sentinel id."""
  parts = [[]]
  for tok in seq.tolist():
    if tok >= TOKENS_BELOW:
      parts.append([])
    else:
      parts[-1].append(tok)
  return parts


def reconstruct(inputs, targets):
  """Interleave nn_0 n_0 nn_1 n_1 ... from inputs (nn_0 X0 nn_1 ...) and targets (X0 n_0 ...)."""
  nonnoise = split_at_sentinels(inputs)
  noise = split_at_sentinels(targets)[1:]
  out = []
  for i in range(max(len(nonnoise), len(noise))):
    out += (nonnoise[i] if i < len(nonnoise) else []) + (noise[i] if i < len(noise) else [])
  return out


def sentinels(seq):
  return seq[seq >= TOKENS_BELOW]


def check_example(tokens, seed, density=0.15, mean=3.0):
  inputs, targets = span_corruption(tokens, seed=seed, vocab_size=VOCAB, noise_density=density,
                                    mean_noise_span_length=mean)
  assert inputs.dtype == np.int32 and targets.dtype == np.int32
  assert reconstruct(inputs, targets) == tokens.tolist()
  n = len(tokens)
  if n >= 2:
    noise, spans = reference_counts(n, density, mean)
    spans = min(spans, noise, n - noise)
    assert len(inputs) == n - noise + spans and len(targets) == noise + spans
    expected = np.arange(FIRST_SENTINEL, FIRST_SENTINEL - spans, -1)
    np.testing.assert_array_equal(sentinels(inputs), expected)
    np.testing.assert_array_equal(sentinels(targets), expected)
    assert targets[0] == FIRST_SENTINEL      # Mask starts with non-noise ...
    assert inputs[-1] == expected[-1]        # ... and ends with noise.
    assert inputs[0] != FIRST_SENTINEL
  # The fast path equals the reference's mask path (same seed, same mask).
  mask = random_spans_noise_mask(n, rng_or_seed=seed, noise_density=density,
                                 mean_noise_span_length=mean)
  np.testing.assert_array_equal(inputs, noise_span_to_unique_sentinel(tokens, mask, VOCAB))
  np.testing.assert_array_equal(targets, noise_span_to_unique_sentinel(tokens, ~mask, VOCAB))
  return inputs, targets


# 128: t=141 has 21 noise in 7 spans -> 141 - 21 + 7 + 1 = 128; t=142 would give 129.
@pytest.mark.parametrize("inputs_length,expected", [(512, (568, 114)), (1024, (1137, 229)),
                                                     (2048, (2274, 456)), (128, (141, 29))])
def test_lengths_exact(inputs_length, expected):
  assert span_corruption_lengths(inputs_length) == expected


def test_lengths_is_largest_fit():
  def inputs_len(t):  # Python float64, round-half-to-even, EOS included.
    nn = round(t * 0.15)
    return t - nn + round(nn / 3) + 1
  for n in (64, 100, 512, 777, 1024):
    t, _ = span_corruption_lengths(n)
    assert inputs_len(t) <= n < inputs_len(t + 1)


def test_float32_counts_l190():
  # float64: 190 * 0.15 = 28.499999 -> 28; TF's float32 product is 28.500002 -> 29.
  assert round(190 * 0.15) == 28
  assert reference_counts(190) == (29, 10)
  for seed in range(20):
    mask = random_spans_noise_mask(190, rng_or_seed=seed)
    assert mask.sum() == 29
    assert np.count_nonzero(mask[1:] & ~mask[:-1]) == 10
  inputs, targets = span_corruption(np.arange(3, 193), seed=0, vocab_size=VOCAB)
  assert (len(inputs), len(targets)) == (190 - 29 + 10, 29 + 10)


def test_568_piece_gives_511_and_113():
  # The reference: 568 raw tokens -> 85 noise in 28 spans -> inputs 483 + 28 = 511 = 512 - 1 and
  # targets 85 + 28 = 113 = 114 - 1: EOS then fills exactly 512 / 114.
  raw, targets_length = span_corruption_lengths(512)
  assert raw == 568 and reference_counts(568) == (85, 28)
  tokens = np.random.default_rng(0).integers(3, TOKENS_BELOW, raw)
  for seed in range(500):
    inputs, targets = check_example(tokens, (1, seed))
    assert len(inputs) == 512 - 1 and len(targets) == targets_length - 1


@settings(max_examples=150, deadline=None)
@given(length=st.integers(0, 2500), seed=st.integers(0, 2**32),
       density=st.sampled_from([0.15, 0.15, 0.3, 0.5]), mean=st.sampled_from([3.0, 3.0, 1.0, 8.0]))
def test_invariants(length, seed, density, mean):
  tokens = np.random.default_rng(seed).integers(3, TOKENS_BELOW, length)
  inputs, targets = check_example(tokens, seed, density, mean)
  if length == 0:
    assert inputs.size == 0 and targets.size == 0


def test_mask_shape_over_lengths():
  for length in range(2, 400):
    mask = random_spans_noise_mask(length, rng_or_seed=(3, length))
    noise, spans = reference_counts(length)
    assert mask.shape == (length,) and mask.sum() == noise
    assert not mask[0] and mask[-1]
    assert np.count_nonzero(mask[1:] & ~mask[:-1]) == spans


def test_tiny_and_degenerate():
  assert [a.tolist() for a in span_corruption(np.array([7]), seed=0, vocab_size=100)] == [[7], [99]]
  mask = random_spans_noise_mask(1, rng_or_seed=0)
  assert mask.tolist() == [False]
  for a in span_corruption(np.zeros(0, np.int64), seed=0, vocab_size=100):
    assert a.shape == (0,) and a.dtype == np.int32
  inputs, targets = span_corruption(np.array([5, 6, 7]), seed=0, vocab_size=100, noise_density=0.0)
  assert inputs.tolist() == [5, 6, 7] and targets.tolist() == [99]


def test_masks_uniform():
  # L=20, density 0.3: 6 noise tokens in 2 spans, 14 non-noise in 2 -> 5 * 13 equally likely masks.
  counts = collections.Counter(
      random_spans_noise_mask(20, rng_or_seed=(9, s), noise_density=0.3).tobytes()
      for s in range(6500))
  assert len(counts) == 65
  assert 55 < min(counts.values()) and max(counts.values()) < 150


@pytest.mark.parametrize("length,density,mean", [(568, 0.15, 3.0), (190, 0.15, 3.0),
                                                 (2, 0.15, 3.0), (57, 0.5, 1.0), (300, 0.3, 8.0)])
def test_batch_equals_per_example(length, density, mean):
  tokens = np.random.default_rng(length).integers(3, TOKENS_BELOW, (17, length))
  seeds = [(5, i) for i in range(17)]
  inputs, targets = span_corruption_batch(tokens, seeds=seeds, vocab_size=VOCAB,
                                          noise_density=density, mean_noise_span_length=mean)
  for row, seed, got_inputs, got_targets in zip(tokens, seeds, inputs, targets):
    want_inputs, want_targets = check_example(row, seed, density, mean)
    np.testing.assert_array_equal(got_inputs, want_inputs)
    np.testing.assert_array_equal(got_targets, want_targets)
  with pytest.raises(ValueError):
    span_corruption_batch(tokens[:, :1], seeds=seeds, vocab_size=VOCAB)
  with pytest.raises(ValueError):
    span_corruption_batch(tokens, seeds=seeds[:3], vocab_size=VOCAB)


def test_tied_keys_stay_exact():
  from t5lite.data.objectives.span_corruption import _cut_points
  keys = np.array([[.5, .5, .5, .1], [.2, .9, .2, .2]])
  cuts = _cut_points(keys, 3)
  assert cuts.shape == (2, 2) and cuts[0, 1] == 3 and set(cuts[1]) < {0, 2, 3}
  assert (np.diff(cuts, axis=1) > 0).all()


def test_determinism():
  tokens = np.random.default_rng(1).integers(3, TOKENS_BELOW, 568)
  a = span_corruption(tokens, seed=(4, 2), vocab_size=VOCAB)
  b = span_corruption(tokens.tolist(), seed=[4, 2], vocab_size=VOCAB)
  c = span_corruption(tokens, seed=(4, 3), vocab_size=VOCAB)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert a[0].shape == c[0].shape and not np.array_equal(a[0], c[0])
  outputs = {span_corruption(tokens, seed=s, vocab_size=VOCAB)[1].tobytes() for s in range(200)}
  assert len(outputs) == 200


def test_docstring_example():
  tokens = np.arange(10, 18)
  mask = np.array([0, 0, 1, 0, 0, 0, 1, 1], bool)
  f = noise_span_to_unique_sentinel
  assert f(tokens, mask, 100).tolist() == [10, 11, 99, 13, 14, 15, 98]
  assert f(tokens, ~mask, 100).tolist() == [99, 12, 98, 16, 17]


def test_split_tokens():
  assert [p.tolist() for p in split_tokens(np.arange(1, 6), 2)] == [[1, 2], [3, 4], [5]]
  assert [p.tolist() for p in split_tokens(np.arange(6), 3)] == [[0, 1, 2], [3, 4, 5]]
  assert split_tokens(np.zeros(0), 3) == []


def expected_pieces(docs, length, group_size):
  docs = [d for d in docs if d]
  groups = ([sum(docs, [])] if group_size is None else
            [sum(docs[i:i + group_size], []) for i in range(0, len(docs), group_size)])
  return [g[i:i + length] for g in groups for i in range(0, len(g), length)]


@settings(max_examples=150, deadline=None)
@given(docs=st.lists(st.lists(st.integers(1, 50), max_size=12), max_size=20),
       length=st.integers(1, 9), group_size=st.sampled_from([None, 1, 2, 3, 128]))
def test_concat_and_split(docs, length, group_size):
  pieces = [p.tolist() for p in concat_and_split((np.array(d, np.int32) for d in docs), length,
                                                 group_size=group_size)]
  assert sum(pieces, []) == sum(docs, [])  # Nothing dropped or reordered.
  assert pieces == expected_pieces(docs, length, group_size)
  assert all(0 < len(p) <= length for p in pieces)
  if group_size is None:
    assert all(len(p) == length for p in pieces[:-1])


def test_concat_and_split_docstring():
  docs = [np.array([1, 2]), np.array([3, 4, 5, 6]), np.array([], np.int32), np.array([7])]
  run = lambda g: [p.tolist() for p in concat_and_split(iter(docs), 3, group_size=g)]
  assert run(None) == [[1, 2, 3], [4, 5, 6], [7]]
  assert run(2) == [[1, 2, 3], [4, 5, 6], [7]]
  assert run(1) == [[1, 2], [3, 4, 5], [6], [7]]


def test_select_random_chunk():
  doc = np.arange(10)
  seen = set()
  for seed in range(200):
    chunk = select_random_chunk(doc, seed=seed, max_length=4)
    assert 0 < len(chunk) <= 4 and chunk[0] % 4 == 0
    np.testing.assert_array_equal(chunk, np.arange(chunk[0], chunk[0] + len(chunk)))
    seen.add(chunk[0])
  assert seen == {0, 4, 8}
  np.testing.assert_array_equal(select_random_chunk(doc, seed=0), doc)  # Short: whole doc.
  assert select_random_chunk(np.zeros(0), seed=0).size == 0
  long_doc = np.arange(200_000)
  chunk = select_random_chunk(long_doc, seed=3)
  assert len(chunk) <= 65536 and np.all(np.diff(chunk) == 1)
