"""T5 span corruption, exactly as the reference C4 task does it, in pure numpy.

T5's pipeline (t5.data.preprocessors.span_corruption) is: select_random_chunk ->
concat_and_split (T5's reduce_concat_tokens + split_tokens, into pieces of
`span_corruption_lengths(512)[0]` = 568 tokens) -> span_corruption per piece (or
span_corruption_batch over equal-length pieces, same result) -> append EOS. Every random
choice comes from `np.random.default_rng(seed)` with a per-example seed, so each example is
stateless and reproducible, whatever order or process computes it.
"""
from __future__ import annotations

import functools
from typing import Iterable, Iterator, Sequence, Union

import numpy as np

Seed = Union[int, Sequence[int], np.random.Generator]


def span_corruption_lengths(inputs_length: int, noise_density: float = 0.15,
                            mean_noise_span_length: float = 3.0) -> tuple[int, int]:
  """Raw piece length and targets length that fill `inputs_length` (EOS included).

  Mirrors t5's random_spans_helper in Python float64 with round-half-to-even:
  512 -> (568, 114), 1024 -> (1137, 229), 2048 -> (2274, 456).
  """
  def lengths(tokens: int) -> tuple[int, int]:
    noise = int(round(tokens * noise_density))
    spans = int(round(noise / mean_noise_span_length))
    # One sentinel per span on each side, plus EOS.
    return tokens - noise + spans + 1, noise + spans + 1

  tokens = inputs_length - 1
  while lengths(tokens + 1)[0] <= inputs_length:
    tokens += 1
  targets_length = lengths(tokens)[1]
  # The reference's hack for noise_density 0.5: make targets no longer than inputs.
  if noise_density == 0.5 and targets_length > inputs_length:
    tokens, targets_length = tokens - 1, targets_length - 1
  return tokens, targets_length


@functools.lru_cache(maxsize=4096)
def _noise_counts(length: int, noise_density: float,
                  mean_noise_span_length: float) -> tuple[int, int]:
  """(num_noise, num_spans) for a piece of `length` >= 2, in float32 as TF computes them.

  float32 matters for ~1% of lengths: L=190 gives 190 * 0.15 = 28.500002 in float32 -> 29 noise
  tokens in 10 spans, where float64 (28.499999 -> 28) would give 28 in 9.
  """
  f32 = np.float32
  noise = int(np.round(f32(length) * f32(noise_density)))
  noise = min(max(noise, 1), length - 1)
  spans = max(int(np.round(f32(noise) / f32(mean_noise_span_length))), 1)
  # The reference fails when spans outnumber noise or non-noise tokens (only at extreme
  # settings); capping keeps the "alternating positive spans" shape well defined there.
  return noise, min(spans, noise, length - noise)


def _cut_points(keys: np.ndarray, parts: int) -> np.ndarray:
  """Per row, the sorted indices of the parts - 1 smallest keys: (B, n) -> (B, parts - 1).

  With i.i.d. uniform keys these are a uniformly random set of cuts, the same distribution as
  the reference's shuffled "first in segment" flags. Example: [[.9 .1 .5 .3]], 3 -> [[1 3]].
  """
  batch = keys.shape[0]
  if parts == 1:
    return np.zeros((batch, 0), np.int64)
  # A partition threshold yields the chosen indices already sorted (no argsort of all keys).
  threshold = np.partition(keys, parts - 2, axis=1)[:, parts - 2, None]
  flat = np.flatnonzero(keys <= threshold)
  if flat.size != batch * (parts - 1):  # Tied float64 keys: vanishingly rare, but stay exact.
    return np.sort(np.argpartition(keys, parts - 2, axis=1)[:, :parts - 1], axis=1)
  flat = flat.reshape(batch, parts - 1)
  return flat % keys.shape[1] if batch > 1 else flat


def _span_starts(keys: np.ndarray, length: int, noise: int,
                 spans: int) -> tuple[np.ndarray, np.ndarray]:
  """Starts of the k non-noise and k noise spans, (B, k) each, from (B, length - 2) keys.

  The first noise - 1 keys split the noise tokens, the other nonnoise - 1 the non-noise ones.
  Non-noise span i starts after i spans of each kind; noise span i after i + 1 and i.
  Example: non-noise lengths [3 2], noise lengths [1 4] -> ([[0 4]], [[3 6]]).
  """
  bounds = np.zeros((2, keys.shape[0], spans + 1), np.int64)  # [noise, non-noise] cumulative.
  bounds[0, :, 1:-1] = _cut_points(keys[:, :noise - 1], spans) + 1
  bounds[1, :, 1:-1] = _cut_points(keys[:, noise - 1:], spans) + 1
  bounds[0, :, -1], bounds[1, :, -1] = noise, length - noise
  return bounds[1, :, :-1] + bounds[0, :, :-1], bounds[1, :, 1:] + bounds[0, :, :-1]


def _noise_mask(size: int, nonnoise_starts: np.ndarray, noise_starts: np.ndarray) -> np.ndarray:
  """Flat (B * L) mask from flat (B, k) span starts: +1 at noise starts, -1 at non-noise
  starts, cumsum. Example: size 5, starts [[0 3]] and [[2 4]] -> [0 0 1 0 1]."""
  steps = np.zeros(size, np.int8)
  steps[noise_starts] = 1
  # Rows end in noise, so every non-noise start but the very first steps back down.
  steps[nonnoise_starts.reshape(-1)[1:]] = -1
  return np.cumsum(steps, dtype=np.int8).view(bool)


def random_spans_noise_mask(length: int, *, rng_or_seed: Seed, noise_density: float = 0.15,
                            mean_noise_span_length: float = 3.0) -> np.ndarray:
  """Boolean noise mask of random spans, starting with non-noise and ending with noise.

  Counts as the reference (float32): num_noise = clip(round(L * density), 1, L - 1),
  num_spans = max(round(num_noise / mean), 1); noise and non-noise lengths are each a uniformly
  random split into num_spans positive parts. L < 2 is computed at L = 2 and truncated; density
  0 gives no noise. Example: length=10, density 0.3, mean 1.5 -> 3 noise tokens in 2 spans,
  e.g. [0 0 0 1 0 0 0 0 1 1].
  """
  if noise_density == 0.0:
    return np.zeros(length, bool)
  padded = max(length, 2)  # As the reference: avoid degeneracy, truncate the mask afterwards.
  noise, spans = _noise_counts(padded, noise_density, mean_noise_span_length)
  keys = np.random.default_rng(rng_or_seed).random(padded - 2)[None]
  return _noise_mask(padded, *_span_starts(keys, padded, noise, spans))[:length]


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray,
                                  vocab_size: int) -> np.ndarray:
  """First token of noise span i -> `vocab_size - 1 - i`; the rest of each span is dropped.

  Example: tokens [5 6 7 8 9], mask [0 1 1 0 1], vocab 100 -> [5 99 8 98].
  """
  tokens = np.asarray(tokens, np.int32)
  mask = np.asarray(noise_mask, bool)
  prev = np.zeros_like(mask)  # prev[i]: token i - 1 is noise.
  prev[1:] = mask[:-1]
  first = mask & ~prev
  out = tokens.copy()
  out[first] = vocab_size - 1 - np.arange(np.count_nonzero(first), dtype=np.int32)
  return out[~(mask & prev)]


def _corrupt(tokens: np.ndarray, keys: np.ndarray, vocab_size: int, noise_density: float,
             mean_noise_span_length: float) -> tuple[np.ndarray, np.ndarray]:
  """Span corruption of (B, L >= 2) int32 tokens with (B, L - 2) uniform keys."""
  batch, length = tokens.shape
  noise, spans = _noise_counts(length, noise_density, mean_noise_span_length)
  nonnoise_starts, noise_starts = _span_starts(keys, length, noise, spans)
  if batch > 1:  # Flat positions in the raveled (B * L) arrays: 1-D indexing is the fast kind.
    offsets = np.arange(0, batch * length, length)[:, None]
    nonnoise_starts, noise_starts = nonnoise_starts + offsets, noise_starts + offsets
  mask = _noise_mask(batch * length, nonnoise_starts, noise_starts)
  tokens = tokens.reshape(-1)
  sentinels = np.arange(vocab_size - 1, vocab_size - 1 - spans, -1, dtype=np.int32)
  # With the span starts known, sentinels are written in place and each output is one
  # boolean gather: no per-span work in Python.
  keep = ~mask  # Inputs keep the non-noise tokens and the first token of each noise span.
  keep[noise_starts] = True
  out = tokens.copy()
  out[noise_starts] = sentinels
  inputs = out[keep].reshape(batch, length - noise + spans)
  mask[nonnoise_starts] = True  # Targets keep the noise and each non-noise span's first.
  out = tokens.copy()
  out[nonnoise_starts] = sentinels
  return inputs, out[mask].reshape(batch, noise + spans)


def span_corruption(tokens: np.ndarray, *, seed: Seed, vocab_size: int,
                    noise_density: float = 0.15,
                    mean_noise_span_length: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
  """T5 span corruption of one 1-D token array; no EOS is added. Returns int32 (inputs, targets).

  inputs = nn_0 <X0> nn_1 <X1> ... <X_{k-1}>, targets = <X0> n_0 <X1> n_1 ... <X_{k-1}> n_{k-1},
  with <Xi> = vocab_size - 1 - i. Example (vocab 100; mask [0 0 1 0 0 0 1 1]):
  [10 11 12 13 14 15 16 17] -> inputs [10 11 99 13 14 15 98], targets [99 12 98 16 17].
  A 568-token piece always gives 511 inputs and 113 targets (512 / 114 with EOS).
  `seed`: a non-negative int or a sequence of them such as (task_seed, example_index), fed to
  np.random.default_rng. An empty array gives two empty arrays (as the reference).
  """
  tokens = np.asarray(tokens).astype(np.int32, copy=False)
  length = tokens.shape[0]
  if length < 2 or noise_density == 0.0:
    # Degenerate cases go through the plain mask path to reproduce the reference exactly.
    mask = random_spans_noise_mask(length, rng_or_seed=seed, noise_density=noise_density,
                                   mean_noise_span_length=mean_noise_span_length)
    return (noise_span_to_unique_sentinel(tokens, mask, vocab_size),
            noise_span_to_unique_sentinel(tokens, ~mask, vocab_size))
  keys = np.random.default_rng(seed).random(length - 2)[None]
  inputs, targets = _corrupt(tokens[None], keys, vocab_size, noise_density,
                             mean_noise_span_length)
  return inputs[0], targets[0]


def span_corruption_batch(tokens: np.ndarray, *, seeds: Sequence[Seed], vocab_size: int,
                          noise_density: float = 0.15,
                          mean_noise_span_length: float = 3.0) -> tuple[np.ndarray, np.ndarray]:
  """`span_corruption` of each row of (B, L) tokens with seeds[b]; same result, vectorized.

  Only the per-row random draws loop in Python, so full-length pieces (all the same L) go
  several times faster than row by row. Needs L >= 2 and noise_density > 0 (use
  `span_corruption` for the short last piece of a group). Example: (2, 568) tokens,
  seeds [(7, 0), (7, 1)] -> inputs (2, 511), targets (2, 113).
  """
  tokens = np.asarray(tokens).astype(np.int32, copy=False)
  batch, length = tokens.shape
  if length < 2 or noise_density == 0.0 or len(seeds) != batch:
    raise ValueError(f"need L >= 2, noise_density > 0 and one seed per row: {tokens.shape}, "
                     f"{noise_density}, {len(seeds)} seeds")
  keys = np.empty((batch, length - 2))
  for row, seed in zip(keys, seeds):
    np.random.default_rng(seed).random(out=row)  # The same draw as span_corruption's.
  return _corrupt(tokens, keys, vocab_size, noise_density, mean_noise_span_length)


def select_random_chunk(tokens: np.ndarray, *, seed: Seed, max_length: int = 65536) -> np.ndarray:
  """One random aligned chunk of at most `max_length` tokens (t5's select_random_chunk).

  The document is cut into ceil(n / max_length) aligned chunks and one is picked uniformly, so
  the last (shorter) chunk is as likely as any. Example: 10 tokens, max_length 4 -> one of
  tokens[0:4], tokens[4:8], tokens[8:10]. An empty document gives an empty array (the
  reference filters empty documents first; callers drop them).
  """
  tokens = np.asarray(tokens)
  n = tokens.shape[0]
  if n <= max_length:
    return tokens
  num_chunks = -(-n // max_length)
  start = max_length * int(np.random.default_rng(seed).integers(num_chunks))
  return tokens[start:start + max_length]


def split_tokens(tokens: np.ndarray, length: int) -> list[np.ndarray]:
  """Consecutive pieces of exactly `length` tokens; the last may be shorter.

  Example: [1 2 3 4 5], length 2 -> [1 2], [3 4], [5]. Empty input -> [].
  """
  tokens = np.asarray(tokens)
  return [tokens[i:i + length] for i in range(0, tokens.shape[0], length)]


def concat_and_split(documents: Iterable[np.ndarray], length: int, *,
                     group_size: int | None = 128) -> Iterator[np.ndarray]:
  """Concatenate documents (no separator, no EOS) and cut the stream into `length` pieces.

  group_size=128 (default) is the reference (t5 reduce_concat_tokens(batch_size=128) then
  split_tokens): every 128 non-empty documents are concatenated and split on their own, so no
  piece spans two groups and each group ends with a shorter piece. group_size=None is one
  endless stream: the remainder carries across documents and only the final one is short.
  Empty documents are skipped and do not count towards a group. Example (length 3):
  [1 2], [3 4 5 6], [7]: group_size=None -> [1 2 3], [4 5 6], [7];
  group_size=2 -> [1 2 3], [4 5 6], [7]; group_size=1 -> [1 2], [3 4 5], [6], [7].
  (The reference also strips id 0 from groups, as padding; tokenized text has none.)
  """
  buffer: list[np.ndarray] = []
  buffered = docs = 0
  for doc in documents:
    doc = np.asarray(doc)
    if doc.shape[0] == 0:
      continue
    buffer.append(doc)
    buffered += doc.shape[0]
    docs += 1
    if group_size is not None:
      if docs == group_size:
        yield from split_tokens(np.concatenate(buffer), length)
        buffer, buffered, docs = [], 0, 0
    elif buffered >= length:
      # Concatenate only when a full piece is ready, so long streams stay linear time.
      blob = np.concatenate(buffer)
      full = (blob.shape[0] // length) * length
      yield from split_tokens(blob[:full], length)
      buffer = [blob[full:]] if full < blob.shape[0] else []
      buffered = blob.shape[0] - full
  if buffered:
    yield from split_tokens(np.concatenate(buffer), length)
