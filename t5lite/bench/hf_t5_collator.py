"""HF's T5 span-corruption data path, re-implemented in numpy: the baseline of `bench data`.

Follows transformers' `examples/flax/language-modeling/run_t5_mlm_flax.py` (current main)
step by step, one function per HF function, same names:

  compute_input_and_target_lengths  T5's random_spans_helper: 512 -> (568, 114)
  group_texts        one `datasets.map(batched=True)` batch of 1000 tokenized documents ->
                     concatenated, cut into expanded_inputs_length chunks, remainder dropped
  FlaxDataCollatorForT5MLM.__call__  per example a random span mask (a Python loop, as HF's),
                     then for the batch: create_sentinel_ids, filter_input_ids (+ EOS) on the
                     mask and on its inverse, then shift_tokens_right for decoder inputs
  HFBatches          the training loop's data side: group, permute chunks, collate batches

Every HF example is exactly input_length / target_length tokens, so HF needs no packing; the
t5lite side packs (as T5X), and its full-length pieces fill one row each too: the same rows.

Where it follows HF exactly: every numpy operation of the collator (np.roll / cumsum / where
sentinel construction, boolean-gather filtering, `np.unique` segment counts), the per-example
Python loop over `random_spans_noise_mask`, the lengths helper, float64 noise counts, and the
output dict (input_ids, labels, decoder_input_ids; int64 as HF's dtype promotion makes them).

HF bugs and quirks, kept or fixed:
  * Sentinels as HF main has them, `len(tokenizer) - i` for span i = 1, 2, ...: the first is
    vocab_size - 1 (<extra_id_0>), as in T5. (HF's first version computed
    `tokenizer.vocab_size - 1 + i`, ids from vocab_size upwards, outside the vocabulary; fixed
    upstream, not reproduced.)
  * filter_input_ids keeps ids >= 0 (HF main; the first version's `> 0` also dropped token 0).
  * Kept: num_noise_spans = round(min(noise, nonnoise) / mean), and num_nonnoise_tokens taken
    *before* num_noise_tokens is clipped to [1, L - 1]; for L <= 3 this raises IndexError, as in
    HF. Never reached here: every chunk has expanded_inputs_length tokens.
  * Kept: counts in float64 where T5's TF code uses float32. They differ for ~1% of lengths;
    HF's lengths helper uses the same float64, so HF stays consistent with itself, and at the
    lengths this benchmark uses (568 for inputs 512) both agree with T5.
  * Kept: group_texts keeps a lone short chunk when a 1000-document batch holds fewer than
    expanded_inputs_length tokens (the collator's np.array then fails, as HF's does).

Where it differs from HF, each change only makes HF's side faster or is cost-neutral:
  * No tokenizer object: `vocab_size` is `len(tokenizer)` (the vocabulary with its extra ids,
    e.g. 32100 for T5) and `eos_token_id` = 1; tokens arrive pre-tokenized as numpy arrays.
  * Randomness: HF calls the global `np.random.shuffle`; here a seeded `np.random.RandomState`
    (the same legacy generator and shuffle algorithm), so runs are reproducible.
  * group_texts concatenates with np.concatenate; HF's `sum(lists, [])` is quadratic in the
    number of documents. Rows reach the collator as numpy arrays; HF's come from an Arrow
    dataset as Python lists that `np.array` converts int by int.
  * The batch is a plain dict, not a `BatchEncoding`; chunks are permuted within each
    1000-document block rather than over the whole epoch (the same work per chunk).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Sequence

import numpy as np

GROUP_TEXTS_BATCH = 1000  # datasets.map(batched=True)'s default batch size in HF's script


def compute_input_and_target_lengths(inputs_length: int, noise_density: float,
                                     mean_noise_span_length: float) -> tuple[int, int]:
  """(raw chunk length, targets length) so a chunk corrupts to exactly inputs_length (with EOS).

  HF's copy of T5's random_spans_helper. Example: 512, 0.15, 3.0 -> (568, 114).
  """
  def inputs_and_targets(tokens_length: int) -> tuple[int, int]:
    num_noise_tokens = int(round(tokens_length * noise_density))
    num_nonnoise_tokens = tokens_length - num_noise_tokens
    num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
    # Inputs: non-noise tokens + one sentinel per span + EOS; targets: the complement.
    return num_nonnoise_tokens + num_noise_spans + 1, num_noise_tokens + num_noise_spans + 1

  tokens_length = inputs_length
  while inputs_and_targets(tokens_length + 1)[0] <= inputs_length:
    tokens_length += 1
  _, targets_length = inputs_and_targets(tokens_length)
  # HF's (and T5's) hack: at density 0.5 keep targets no longer than inputs.
  if noise_density == 0.5 and targets_length > inputs_length:
    tokens_length -= 1
    targets_length -= 1
  return tokens_length, targets_length


def group_texts(documents: Sequence[np.ndarray], expanded_inputs_length: int) -> list[np.ndarray]:
  """One map batch of tokenized documents -> chunks of expanded_inputs_length tokens.

  The remainder is dropped (unless the whole batch is shorter than one chunk: HF then keeps
  it). Example (length 3): [1 2], [3 4 5 6], [7 8] -> [1 2 3], [4 5 6] (7 8 dropped).
  """
  concatenated = np.concatenate(documents) if len(documents) else np.zeros(0, np.int32)
  total_length = len(concatenated)
  if total_length >= expanded_inputs_length:
    total_length = (total_length // expanded_inputs_length) * expanded_inputs_length
  return [concatenated[i:i + expanded_inputs_length]
          for i in range(0, total_length, expanded_inputs_length)]


def shift_tokens_right(input_ids: np.ndarray, pad_token_id: int,
                       decoder_start_token_id: int) -> np.ndarray:
  """HF's Flax shift: [[5 6 1]] -> [[0 5 6]]; -100 (ignored label) becomes pad."""
  shifted_input_ids = np.zeros_like(input_ids)
  shifted_input_ids[:, 1:] = input_ids[:, :-1]
  shifted_input_ids[:, 0] = decoder_start_token_id
  return np.where(shifted_input_ids == -100, pad_token_id, shifted_input_ids)


@dataclasses.dataclass
class FlaxDataCollatorForT5MLM:
  """HF's collator: a list of {"input_ids": (expanded_inputs_length,)} -> a batch dict.

  Example (vocab_size 100, one chunk [10 .. 17], mask [0 0 1 0 0 0 1 1]):
    input_ids         [[10 11 99 13 14 15 98  1]]
    labels            [[99 12 98 16 17  1]]
    decoder_input_ids [[ 0 99 12 98 16 17]]
  """
  vocab_size: int
  noise_density: float = 0.15
  mean_noise_span_length: float = 3.0
  input_length: int = 512
  target_length: int = 114
  pad_token_id: int = 0
  decoder_start_token_id: int = 0
  eos_token_id: int = 1
  seed: int = 0

  def __post_init__(self):
    # HF shuffles with the global legacy RandomState; a private one keeps runs reproducible.
    self.rng = np.random.RandomState(self.seed)

  def __call__(self, examples: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    batch = {k: np.array([examples[i][k] for i in range(len(examples))]) for k in examples[0]}
    input_ids = batch["input_ids"]  # (B, expanded_inputs_length)
    batch_size, expanded_input_length = input_ids.shape

    # One mask per example, in a Python loop: HF's cost model.
    mask_indices = np.asarray([self.random_spans_noise_mask(expanded_input_length)
                               for _ in range(batch_size)])
    labels_mask = ~mask_indices

    input_ids_sentinel = self.create_sentinel_ids(mask_indices.astype(np.int8))
    labels_sentinel = self.create_sentinel_ids(labels_mask.astype(np.int8))

    batch["input_ids"] = self.filter_input_ids(input_ids, input_ids_sentinel)  # (B, input_length)
    batch["labels"] = self.filter_input_ids(input_ids, labels_sentinel)  # (B, target_length)

    if batch["input_ids"].shape[-1] != self.input_length:
      raise ValueError(f"`input_ids` are incorrectly preprocessed: length "
                       f"{batch['input_ids'].shape[-1]}, should be {self.input_length}")
    if batch["labels"].shape[-1] != self.target_length:
      raise ValueError(f"`labels` are incorrectly preprocessed: length "
                       f"{batch['labels'].shape[-1]}, should be {self.target_length}")

    batch["decoder_input_ids"] = shift_tokens_right(batch["labels"], self.pad_token_id,
                                                    self.decoder_start_token_id)
    return batch

  def create_sentinel_ids(self, mask_indices: np.ndarray) -> np.ndarray:
    """(B, L) int8 mask -> sentinel id at each span start, -1 inside spans, 0 elsewhere.

    Example (vocab_size 100): [[0 1 1 0 1]] -> [[0 99 -1 0 98]].
    """
    start_indices = mask_indices - np.roll(mask_indices, 1, axis=-1) * mask_indices
    start_indices[:, 0] = mask_indices[:, 0]  # np.roll wrapped the last column round

    sentinel_ids = np.where(start_indices != 0, np.cumsum(start_indices, axis=-1), start_indices)
    sentinel_ids = np.where(sentinel_ids != 0, (self.vocab_size - sentinel_ids), 0)
    sentinel_ids -= mask_indices - start_indices
    return sentinel_ids

  def filter_input_ids(self, input_ids: np.ndarray, sentinel_ids: np.ndarray) -> np.ndarray:
    """Sentinels over the tokens, span continuations (-1) deleted, EOS appended.

    Example: tokens [[5 6 7 8 9]], sentinels [[0 99 -1 0 98]] -> [[5 99 8 98 1]].
    """
    batch_size = input_ids.shape[0]
    input_ids_full = np.where(sentinel_ids != 0, sentinel_ids, input_ids)
    # Tokens and sentinels are >= 0; negative entries are masked tokens after a sentinel.
    input_ids = input_ids_full[input_ids_full >= 0].reshape((batch_size, -1))
    return np.concatenate(
        [input_ids, np.full((batch_size, 1), self.eos_token_id, dtype=np.int32)], axis=-1)

  def random_spans_noise_mask(self, length: int) -> np.ndarray:
    """Boolean (length,) mask of alternating non-noise / noise spans (noise last).

    num_noise = round(L * density) clipped to [1, L - 1]; num_spans = round(min(num_noise,
    num_nonnoise) / mean), at least 1; both kinds split uniformly into num_spans positive parts.
    Example: length 10, density 0.3, mean 1.5 -> 3 noise tokens in 2 spans, e.g.
    [0 0 1 0 0 0 0 0 1 1].
    """
    orig_length = length

    num_noise_tokens = int(np.round(length * self.noise_density))
    num_nonnoise_tokens = length - num_noise_tokens  # before the clip, as HF (see docstring)
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = int(np.round(min(num_noise_tokens, num_nonnoise_tokens)
                                   / self.mean_noise_span_length))
    num_noise_spans = max(num_noise_spans, 1)

    def random_segmentation(num_items: int, num_segments: int) -> np.ndarray:
      """num_items split into num_segments positive lengths, uniformly at random."""
      mask_indices = np.arange(num_items - 1) < (num_segments - 1)
      self.rng.shuffle(mask_indices)
      first_in_segment = np.pad(mask_indices, [[1, 0]])
      segment_id = np.cumsum(first_in_segment)
      # Segment ids are sorted, so unique's counts are the lengths in order.
      _, segment_length = np.unique(segment_id, return_counts=True)
      return segment_length

    noise_span_lengths = random_segmentation(num_noise_tokens, num_noise_spans)
    nonnoise_span_lengths = random_segmentation(num_nonnoise_tokens, num_noise_spans)

    interleaved_span_lengths = np.reshape(
        np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1), [num_noise_spans * 2])
    span_starts = np.cumsum(interleaved_span_lengths)[:-1]
    span_start_indicator = np.zeros((length,), dtype=np.int8)
    span_start_indicator[span_starts] = True
    span_num = np.cumsum(span_start_indicator)
    is_noise = np.equal(span_num % 2, 1)
    return is_noise[:orig_length]


class HFBatches:
  """The data side of HF's training loop as an endless iterator of collated batches.

  Cycles over the documents in blocks of 1000 (one `datasets.map` batch each): group_texts,
  a random permutation of the block's chunks, then batches of batch_size through the collator
  (chunks left over at a block's end wait for the next block). `group_seconds` sums the CPU
  time spent in group_texts, which HF runs offline, so callers can also report the
  collator alone. Example: HFBatches(docs, collator, 64) -> next() = {"input_ids": (64, 512),
  "labels": (64, 114), "decoder_input_ids": (64, 114)} for inputs_length 512.
  """

  def __init__(self, documents: Sequence[np.ndarray], collator: FlaxDataCollatorForT5MLM,
               batch_size: int, expanded_inputs_length: int, seed: int = 0):
    if not len(documents):
      raise ValueError("HFBatches needs at least one document")
    self.documents, self.collator, self.batch_size = documents, collator, batch_size
    self.expanded_inputs_length = expanded_inputs_length
    self.rng = np.random.RandomState(seed)
    self.group_seconds = 0.0
    self._next_document = 0
    self._chunks: list[np.ndarray] = []

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def _group_next_block(self) -> None:
    start = time.process_time()
    block = [self.documents[(self._next_document + i) % len(self.documents)]
             for i in range(GROUP_TEXTS_BATCH)]
    self._next_document = (self._next_document + GROUP_TEXTS_BATCH) % len(self.documents)
    chunks = group_texts(block, self.expanded_inputs_length)
    self.group_seconds += time.process_time() - start
    self._chunks.extend(chunks[int(i)] for i in self.rng.permutation(len(chunks)))

  def __next__(self) -> dict[str, np.ndarray]:
    while len(self._chunks) < self.batch_size:
      self._group_next_block()
    samples = [{"input_ids": chunk} for chunk in self._chunks[:self.batch_size]]
    del self._chunks[:self.batch_size]
    return self.collator(samples)
