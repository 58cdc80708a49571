"""Feature converters: task examples (`inputs`, `targets`) -> fixed-length model rows (T5X names).

A converter maps a grain IterDataset of task examples (dicts of int 1-D arrays, EOS already
appended; other keys are dropped) to an IterDataset of single rows, not batches. Every row
carries `*_segment_ids` (1-based per example, 0 = padding) and `*_positions` (restarting at
0 per example), packed or not, so the model masks padding and segments the same way.

Unpacked (pack=False): one example per row, each feature cut to its length (the end goes,
EOS included, as in T5X) and padded with 0. EncDec, lengths {"inputs": 6, "targets": 4}:

  {"inputs": [7, 8, 5, 1], "targets": [3, 9, 9, 9, 1]}
  -> encoder_input_tokens = [7, 8, 5, 1, 0, 0]  encoder_segment_ids = [1, 1, 1, 1, 0, 0]
     encoder_positions    = [0, 1, 2, 3, 0, 0]  decoder_target_tokens = [3, 9, 9, 9]  (EOS cut)
     decoder_input_tokens = [0, 3, 9, 9]        decoder_loss_weights  = [1, 1, 1, 1]
     decoder_segment_ids  = [1, 1, 1, 1]        decoder_positions     = [0, 1, 2, 3]

Packed (pack=True): several trimmed examples per row, never split across rows, by grain's
best-fit packer over `num_packing_bins` rows at a time; see EncDecFeatureConverter.

Examples whose features are all empty (after trimming) are skipped in both modes: they hold
no token to train on. An example with one empty feature (e.g. empty targets) is kept.
Decoder inputs are 0 on padding (T5X's unpacked rows repeat the last target there; that
position has no loss and, being segment 0, no real token attends to it: no difference).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterable, Mapping

import grain
import numpy as np

Example = Mapping[str, Any]


def autoregressive_inputs(targets: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
  """Targets shifted right by one, with BOS 0 at each segment start and on padding.

  targets     = [3, 9, 1, 4, 1, 0]
  segment_ids = [1, 1, 1, 2, 2, 0]
  ->            [0, 3, 9, 0, 4, 0]   (never the previous segment's last token)
  """
  shifted = np.concatenate([np.zeros_like(targets[:1]), targets[:-1]])
  previous = np.concatenate([np.zeros_like(segment_ids[:1]), segment_ids[:-1]])
  return np.where((segment_ids == previous) & (segment_ids > 0), shifted, 0).astype(np.int32)


def packing_efficiency(rows: Iterable[Mapping[str, np.ndarray]]) -> float:
  """Non-pad positions / all positions, over every `*_segment_ids` feature of the rows.

  [{"encoder_segment_ids": [1, 1, 2, 0], "decoder_segment_ids": [1, 2, 0, 0]}] -> 5/8 = 0.625
  """
  real = total = 0
  for row in rows:
    for key, value in row.items():
      if key.endswith("_segment_ids"):
        value = np.asarray(value)
        real += int(np.count_nonzero(value))
        total += value.size
  return real / total if total else 0.0


def _pad_like_packed(example: Example, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
  """One example per row, with the same keys grain's packers emit (`<f>_segment_ids`, ...).

  {"targets": [3, 9, 1]}, {"targets": 5} -> targets [3, 9, 1, 0, 0],
  targets_segment_ids [1, 1, 1, 0, 0], targets_positions [0, 1, 2, 0, 0]
  """
  row = {}
  for key, length in lengths.items():
    value = example[key]
    n = len(value)
    row[key] = np.pad(value, (0, length - n))
    row[f"{key}_segment_ids"] = (np.arange(length) < n).astype(np.int32)
    row[f"{key}_positions"] = np.where(np.arange(length) < n, np.arange(length), 0).astype(np.int32)
  return row


def _not_all_empty(example: Example) -> bool:
  return any(len(v) for v in example.values())


@dataclasses.dataclass(frozen=True)
class FeatureConverter:
  """Base: check, trim, skip empty, pack or pad, then rename to model features.

  num_packing_bins: rows filled at once. Grain's packer puts each example in the fullest row
  it fits and emits all the rows as soon as an example fits none, so more bins pack tighter
  (random lengths: ~64% non-pad with 1 bin, ~80% with 16, ~88% with 64) at the cost of
  bins x length buffers, rows coming in bursts, and examples further apart in the stream
  (across an epoch boundary when the source repeats) sharing a row.
  seed: shuffles the rows within each group of bins (else the first ones are the fullest).
  """
  pack: bool = True
  _: dataclasses.KW_ONLY
  num_packing_bins: int = 16
  seed: int = 0

  def __post_init__(self):
    if self.num_packing_bins < 1:
      raise ValueError(f"{self._name}: num_packing_bins must be >= 1, got {self.num_packing_bins}")

  @property
  def _name(self) -> str:
    return type(self).__name__

  def _required(self) -> tuple[str, ...]:
    """The task_feature_lengths keys (and example features) this converter reads."""
    raise NotImplementedError

  def _packed_lengths(self, lengths: Mapping[str, int]) -> dict[str, int]:
    """Internal features packed together (so sharing segment ids) -> their lengths."""
    return dict(lengths)

  def _prepare(self, example: Example, lengths: Mapping[str, int]) -> dict[str, np.ndarray]:
    """A task example -> its trimmed internal features (int32, 1-D)."""
    return {k: self._feature(example, k, n) for k, n in lengths.items()}

  def _to_model(self, row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A packed or padded internal row -> model features."""
    raise NotImplementedError

  def _model_lengths(self, lengths: Mapping[str, int]) -> dict[str, int]:
    raise NotImplementedError

  def _lengths(self, task_feature_lengths: Mapping[str, int]) -> dict[str, int]:
    lengths = {}
    for key in self._required():
      if key not in task_feature_lengths:
        raise ValueError(f"{self._name}: task_feature_lengths has no {key!r} "
                         f"(got {dict(task_feature_lengths)})")
      length = task_feature_lengths[key]
      if isinstance(length, bool) or int(length) != length or length <= 0:
        raise ValueError(f"{self._name}: task_feature_lengths[{key!r}] must be a positive "
                         f"integer, got {length!r}")
      lengths[key] = int(length)
    return lengths

  def _feature(self, example: Example, key: str, length: int) -> np.ndarray:
    """example[key] checked (present, 1-D, integral values), as int32, cut to `length`."""
    if key not in example:
      raise KeyError(f"{self._name}: example has no {key!r} feature (keys: {sorted(example)})")
    value = np.asarray(example[key])
    # Float 0/1 weights are accepted; fractional values would be silently changed by int32.
    if value.ndim != 1 or value.dtype.kind not in "biuf" or np.any(value != np.round(value)):
      raise ValueError(f"{self._name}: feature {key!r} must be a 1-D array of integers, "
                       f"got shape {value.shape} dtype {value.dtype}")
    return value[:length].astype(np.int32)

  def model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict[str, int]:
    """The length of every output feature."""
    return self._model_lengths(self._lengths(task_feature_lengths))

  def __call__(self, ds: grain.IterDataset, task_feature_lengths: Mapping[str, int]
               ) -> grain.IterDataset:
    lengths = self._lengths(task_feature_lengths)
    packed_lengths = self._packed_lengths(lengths)
    if isinstance(ds, grain.MapDataset):
      ds = ds.to_iter_dataset()
    # Bound methods and partials, not lambdas: the pipeline stays picklable for grain workers.
    ds = ds.map(functools.partial(self._prepare, lengths=lengths)).filter(_not_all_empty)
    if self.pack:
      # Checkpointable: its state is the parent's state before the current group of bins
      # plus the row index within it; restoring re-packs that group the same way.
      ds = grain.experimental.BestFitPackIterDataset(
          ds, length_struct=packed_lengths, num_packing_bins=self.num_packing_bins,
          seed=self.seed, shuffle_bins=True)
    else:
      ds = ds.map(functools.partial(_pad_like_packed, lengths=packed_lengths))
    return ds.map(self._to_model)


ENCODER_KEYS = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions")
DECODER_KEYS = ("decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights",
                "decoder_segment_ids", "decoder_positions")


def _decoder_features(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  tokens, segment_ids = row["targets"], row["targets_segment_ids"]
  return {"decoder_target_tokens": tokens,
          "decoder_input_tokens": autoregressive_inputs(tokens, segment_ids),
          "decoder_loss_weights": (segment_ids > 0).astype(np.int32),
          "decoder_segment_ids": segment_ids, "decoder_positions": row["targets_positions"]}


def _encoder_features(row: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {"encoder_input_tokens": row["inputs"], "encoder_segment_ids": row["inputs_segment_ids"],
          "encoder_positions": row["inputs_positions"]}


@dataclasses.dataclass(frozen=True)
class EncDecFeatureConverter(FeatureConverter):
  """Encoder-decoder (T5). task_feature_lengths {"inputs": I, "targets": T}.

  Packed, lengths {"inputs": 10, "targets": 7}, num_packing_bins=1:
    [{"inputs": [7, 8, 5, 1], "targets": [3, 9, 1]},
     {"inputs": [8, 4, 9, 3, 1], "targets": [4, 1]}]
    -> encoder_input_tokens  = [7, 8, 5, 1, 8, 4, 9, 3, 1, 0]
       encoder_segment_ids   = [1, 1, 1, 1, 2, 2, 2, 2, 2, 0]
       encoder_positions     = [0, 1, 2, 3, 0, 1, 2, 3, 4, 0]
       decoder_target_tokens = [3, 9, 1, 4, 1, 0, 0]
       decoder_input_tokens  = [0, 3, 9, 0, 4, 0, 0]
       decoder_loss_weights  = [1, 1, 1, 1, 1, 0, 0]
       decoder_segment_ids   = [1, 1, 1, 2, 2, 0, 0]
       decoder_positions     = [0, 1, 2, 0, 1, 0, 0]
  An example's encoder and decoder segments share one id, which masks cross-attention.
  """
  def _required(self):
    return ("inputs", "targets")

  def _to_model(self, row):
    return {**_encoder_features(row), **_decoder_features(row)}

  def _model_lengths(self, lengths):
    return {**{k: lengths["inputs"] for k in ENCODER_KEYS},
            **{k: lengths["targets"] for k in DECODER_KEYS}}


@dataclasses.dataclass(frozen=True)
class DecoderOnlyFeatureConverter(FeatureConverter):
  """Decoder-only: a causal LM on `targets`, or (prefix_lm) a prefix LM on inputs + targets.

  LM: task_feature_lengths {"targets": T}; `inputs` is ignored. Packed, T=6, one bin:
    [{"targets": [3, 9, 1]}, {"targets": [4, 1]}]
    -> decoder_target_tokens = [3, 9, 1, 4, 1, 0]
       decoder_input_tokens  = [0, 3, 9, 0, 4, 0]
       decoder_loss_weights  = [1, 1, 1, 1, 1, 0]
       decoder_segment_ids   = [1, 1, 1, 2, 2, 0]
       decoder_positions     = [0, 1, 2, 0, 1, 0]

  Prefix LM: inputs cut to I and targets to T (as seqio trims each feature before its
  converter), then concatenated; rows have length I + T; loss only on the targets part.
  `decoder_causal_attention` follows T5X's PrefixLMFeatureConverter (`position < inputs
  width + 1`): 1 on the inputs AND on the first target position, whose decoder input is the
  last input token, so every prefix token is seen bidirectionally. Unpacked, {"inputs": 4,
  "targets": 3}, [{"inputs": [9, 4, 6, 1], "targets": [3, 9, 1]}] ->
       decoder_target_tokens    = [9, 4, 6, 1, 3, 9, 1]
       decoder_input_tokens     = [0, 9, 4, 6, 1, 3, 9]
       decoder_loss_weights     = [0, 0, 0, 0, 1, 1, 1]
       decoder_causal_attention = [1, 1, 1, 1, 1, 0, 0]
  Packed, {"inputs": 8, "targets": 7}, one bin, [{"inputs": [7, 8, 5, 1], "targets": [3, 9, 1]},
  {"inputs": [8, 4, 9, 3, 1], "targets": [4, 1]}] -> one row of 15:
       decoder_target_tokens    = [7, 8, 5, 1, 3, 9, 1, 8, 4, 9, 3, 1, 4, 1, 0]
       decoder_input_tokens     = [0, 7, 8, 5, 1, 3, 9, 0, 8, 4, 9, 3, 1, 4, 0]
       decoder_loss_weights     = [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0]
       decoder_causal_attention = [1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]
       decoder_segment_ids      = [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0]
       decoder_positions        = [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0]
  """
  prefix_lm: bool = False

  def _required(self):
    return ("inputs", "targets") if self.prefix_lm else ("targets",)

  def _packed_lengths(self, lengths):
    if not self.prefix_lm:
      return dict(lengths)
    total = lengths["inputs"] + lengths["targets"]
    # Three aligned features, packed together so they share segment ids and positions.
    return {"targets": total, "causal": total, "loss": total}

  def _prepare(self, example, lengths):
    if not self.prefix_lm:
      return super()._prepare(example, lengths)
    inputs = self._feature(example, "inputs", lengths["inputs"])
    targets = self._feature(example, "targets", lengths["targets"])
    position = np.arange(len(inputs) + len(targets))
    return {"targets": np.concatenate([inputs, targets]),
            "causal": (position < len(inputs) + 1).astype(np.int32),
            "loss": (position >= len(inputs)).astype(np.int32)}

  def _to_model(self, row):
    out = _decoder_features(row)
    if self.prefix_lm:
      out["decoder_loss_weights"] = row["loss"]
      out["decoder_causal_attention"] = row["causal"]
    return out

  def _model_lengths(self, lengths):
    total = sum(lengths.values())  # T, or I + T for a prefix LM
    out = {k: total for k in DECODER_KEYS}
    if self.prefix_lm:
      out["decoder_causal_attention"] = total
    return out


_MLM_FEATURES = ("inputs", "targets", "weights")


@dataclasses.dataclass(frozen=True)
class EncoderOnlyFeatureConverter(FeatureConverter):
  """Encoder-only MLM: `inputs` (corrupted), `targets` (original) and `weights`, all of one
  length. task_feature_lengths {"inputs": I} (I also bounds targets and weights).

  Packed, I=7, one bin:
    [{"inputs": [5, 2, 7, 1], "targets": [5, 6, 7, 1], "weights": [0, 1, 0, 0]},
     {"inputs": [2, 1], "targets": [8, 1], "weights": [1, 0]}]
    -> encoder_input_tokens = [5, 2, 7, 1, 2, 1, 0]
       encoder_segment_ids  = [1, 1, 1, 1, 2, 2, 0]
       encoder_positions    = [0, 1, 2, 3, 0, 1, 0]
       mlm_target_tokens    = [5, 6, 7, 1, 8, 1, 0]
       mlm_loss_weights     = [0, 1, 0, 0, 1, 0, 0]
  """
  def _required(self):
    return ("inputs",)

  def _packed_lengths(self, lengths):
    return {k: lengths["inputs"] for k in _MLM_FEATURES}

  def _prepare(self, example, lengths):
    out = {k: self._feature(example, k, lengths["inputs"]) for k in _MLM_FEATURES}
    sizes = {k: len(example[k]) for k in out}  # before trimming
    if len(set(sizes.values())) != 1:
      raise ValueError(f"{self._name}: inputs, targets and weights must have one "
                       f"length, got {sizes}")
    return out

  def _to_model(self, row):
    return {**_encoder_features(row), "mlm_target_tokens": row["targets"],
            "mlm_loss_weights": row["weights"]}

  def _model_lengths(self, lengths):
    return {k: lengths["inputs"] for k in (*ENCODER_KEYS, "mlm_target_tokens", "mlm_loss_weights")}
