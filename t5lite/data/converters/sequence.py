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

Packed (pack=True): several trimmed examples per row, never split across rows, best fit
over `num_packing_bins` rows at a time (packing.py: grain's best-fit packing, faster, exactly
checkpointable); see EncDecFeatureConverter.

Examples whose features are all empty (after trimming) are skipped in both modes: they hold
no token to train on. An example with one empty feature (e.g. empty targets) is kept.
Decoder inputs are 0 on padding (T5X's unpacked rows repeat the last target there; that
position has no loss and, being segment 0, no real token attends to it: no difference).
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Iterable, Mapping

import grain
import numpy as np

from t5lite.data.converters import packing
from t5lite.util.checks import check_feature_lengths, is_integer
from t5lite.errors import ConfigError, ConfigKeyError

Example = Mapping[str, Any]


def autoregressive_inputs(targets: np.ndarray, segment_ids: np.ndarray,
                          bos_id: int = 0) -> np.ndarray:
  """Targets shifted right by one, with BOS (bos_id, T5's 0) at each segment start, 0 on
  padding.

  targets     = [3, 9, 1, 4, 1, 0]
  segment_ids = [1, 1, 1, 2, 2, 0]
  ->            [0, 3, 9, 0, 4, 0]   (never the previous segment's last token)
  Rows of a 2-D batch are shifted independently (along the last axis).
  """
  targets, segment_ids = np.asarray(targets), np.asarray(segment_ids)
  out = np.zeros(targets.shape, np.int32)
  previous = np.zeros_like(segment_ids)
  previous[..., 1:] = segment_ids[..., :-1]
  shifted = np.zeros_like(out)
  shifted[..., 1:] = targets[..., :-1]
  same = (segment_ids == previous) & (segment_ids > 0)
  out = np.where(same, shifted, np.where(segment_ids > 0, bos_id, 0)).astype(np.int32)
  return out


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


@dataclasses.dataclass(frozen=True)
class FeatureConverter(abc.ABC):
  """Base: check, trim, skip empty, pack or pad, then rename to model features.

  num_packing_bins: rows filled at once. The packer (packing.py, grain's best fit) puts each
  example in the fullest row it fits and emits all the rows as soon as an example fits none,
  so more bins pack tighter (random lengths: ~64% non-pad with 1 bin, ~80% with 16, ~88%
  with 64) at the cost of bins x length buffers, rows coming in bursts, and examples further
  apart in the stream (across an epoch boundary when the source repeats) sharing a row.
  An example longer than the room left in every open row opens a new row without a search
  (span corruption inputs of the full inputs length), so packing costs little where it
  gains nothing.
  seed: shuffles the rows within each group of bins (else the first ones are the fullest).
  Rows are checkpointable: get_state() / set_state() resume with identical rows.
  """
  pack: bool = True
  _: dataclasses.KW_ONLY
  num_packing_bins: int = 16
  seed: int = 0

  def __post_init__(self):
    if self.num_packing_bins < 1:
      raise ConfigError(f"{self._name}: num_packing_bins must be >= 1, got {self.num_packing_bins}")

  @property
  def _name(self) -> str:
    return type(self).__name__

  @abc.abstractmethod
  def _required(self) -> tuple[str, ...]:
    """The task_feature_lengths keys (and example features) this converter reads."""

  def _slots(self, lengths: Mapping[str, int]) -> packing.Slots:
    """The packer's slots: ((internal features, sharing segment ids), row length), ..."""
    return tuple(((k,), n) for k, n in lengths.items())

  def _prepare(self, example: Example, lengths: Mapping[str, int]) -> tuple[np.ndarray, ...]:
    """A task example -> its trimmed internal features (1-D integers), in slot order."""
    return tuple([self._feature(example, k, n) for k, n in lengths.items()])

  @abc.abstractmethod
  def _to_model(self, rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Packed or padded internal rows (rows, length) -> model features, also 2-D."""

  @abc.abstractmethod
  def _model_lengths(self, lengths: Mapping[str, int]) -> dict[str, int]:
    """Each output key's length for these task feature lengths."""

  def _lengths(self, task_feature_lengths: Mapping[str, int]) -> dict[str, int]:
    lengths = {}
    for key in self._required():
      if key not in task_feature_lengths:
        raise ConfigError(f"{self._name}: task_feature_lengths has no {key!r} "
                          f"(got {dict(task_feature_lengths)})")
      length = task_feature_lengths[key]
      if not is_integer(length) or length <= 0:
        raise ConfigError(f"{self._name}: task_feature_lengths[{key!r}] must be a positive "
                          f"integer, got {length!r}")
      lengths[key] = check_feature_lengths({key: length}, "task_feature_lengths")[key]
    return lengths

  def _feature(self, example: Example, key: str, length: int) -> np.ndarray:
    """example[key] checked (present, 1-D, integral values), cut to `length`; the packer
    casts it to int32 as it writes it into a row."""
    try:
      value = example[key]
    except KeyError:
      raise ConfigKeyError(f"{self._name}: example has no {key!r} feature "
                           f"(keys: {sorted(example)})") from None
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu":
      return value[:length]  # the usual case, checked cheaply
    value = np.asarray(value)
    # Float 0/1 weights are accepted; fractional values would be silently changed by int32.
    if value.ndim != 1 or value.dtype.kind not in "biuf" or np.any(value != np.round(value)):
      raise ConfigError(f"{self._name}: feature {key!r} must be a 1-D array of integers, "
                        f"got shape {value.shape} dtype {value.dtype}")
    return value[:length].astype(np.int32)

  def model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict[str, int]:
    """The length of every output feature."""
    return self._model_lengths(self._lengths(task_feature_lengths))

  def __call__(self, ds: grain.IterDataset, task_feature_lengths: Mapping[str, int]
               ) -> grain.IterDataset:
    lengths = self._lengths(task_feature_lengths)
    slots = self._slots(lengths)
    if isinstance(ds, grain.MapDataset):
      ds = ds.to_iter_dataset()
    # Bound methods and partials, not lambdas: the pipeline stays picklable for grain workers.
    prepare = functools.partial(self._prepare, lengths=lengths)
    if self.pack:
      # Checkpointable: see packing.py for its state.
      return packing.PackIterDataset(ds, slots=slots, prepare=prepare, finalize=self._to_model,
                                     num_packing_bins=self.num_packing_bins, seed=self.seed)
    return packing.PadIterDataset(ds, slots=slots, prepare=prepare, finalize=self._to_model)


ENCODER_KEYS = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions")
DECODER_KEYS = ("decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights",
                "decoder_segment_ids", "decoder_positions")


def _decoder_features(row: Mapping[str, np.ndarray], bos_id: int = 0) -> dict[str, np.ndarray]:
  """Also on 2-D batches of rows, as every _to_model."""
  tokens, segment_ids = row["targets"], row["targets_segment_ids"]
  return {"decoder_target_tokens": tokens,
          "decoder_input_tokens": autoregressive_inputs(tokens, segment_ids, bos_id),
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
  bos_id: int = 0
  """The decoder start token at each segment start (ModelConfig.bos_id; T5's 0)."""

  def _required(self):
    return ("inputs", "targets")

  def _to_model(self, row):
    return {**_encoder_features(row), **_decoder_features(row, self.bos_id)}

  def _model_lengths(self, lengths):
    return {**{k: lengths["inputs"] for k in ENCODER_KEYS},
            **{k: lengths["targets"] for k in DECODER_KEYS}}


@dataclasses.dataclass(frozen=True)
class DecoderOnlyFeatureConverter(FeatureConverter):
  """Decoder-only: a causal LM on `targets`, or (prefix_lm) a prefix LM on inputs + targets.

  LM: task_feature_lengths {"targets": T}. Packed, T=6, one bin:
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

  A causal LM given {"inputs": I, "targets": T} (a text-to-text task) reads its examples as
  the prefix LM does, inputs then targets, loss only on the targets, and attends causally
  over both (no decoder_causal_attention): seqio's DecoderFeatureConverter picks its
  PrefixLMFeatureConverter for a task with inputs the same way, and decoding prompts the
  model with the inputs, so training must show them too.
  """
  prefix_lm: bool = False
  bos_id: int = 0
  """The token at each segment start of decoder_input_tokens (ModelConfig.bos_id)."""

  def _required(self):
    return ("inputs", "targets") if self.prefix_lm else ("targets",)

  def _lengths(self, task_feature_lengths):
    if self.prefix_lm or "inputs" not in task_feature_lengths:
      return super()._lengths(task_feature_lengths)
    # A causal LM on a text-to-text task: both features, checked as a prefix LM's.
    return dataclasses.replace(self, prefix_lm=True)._lengths(task_feature_lengths)

  def _slots(self, lengths):
    if "inputs" not in lengths:
      return super()._slots(lengths)
    # Three aligned features in one slot, so they share segment ids and positions.
    return ((("targets", "causal", "loss"), lengths["inputs"] + lengths["targets"]),)

  def _prepare(self, example, lengths):
    if "inputs" not in lengths:
      return super()._prepare(example, lengths)
    if not self.prefix_lm and "inputs" not in example:
      raise ConfigError(f"{self._name}: task_feature_lengths has 'inputs', which makes the "
                        "causal LM read inputs then targets, but this task's examples have "
                        "only 'targets': give a language-modelling task {'targets': N} alone")
    inputs = self._feature(example, "inputs", lengths["inputs"])
    targets = self._feature(example, "targets", lengths["targets"])
    position = np.arange(len(inputs) + len(targets))
    return (np.concatenate([inputs, targets]), position < len(inputs) + 1,
            position >= len(inputs))

  def _to_model(self, row):
    out = _decoder_features(row, self.bos_id)
    if "loss" in row:  # inputs then targets
      out["decoder_loss_weights"] = row["loss"]
    if self.prefix_lm:
      out["decoder_causal_attention"] = row["causal"]
    return out

  def _model_lengths(self, lengths):
    total = sum(lengths.values())  # T, or I + T: inputs then targets
    out = {k: total for k in DECODER_KEYS}
    if self.prefix_lm:
      out["decoder_causal_attention"] = total
    return out


_MLM_FEATURES = ("inputs", "targets", "weights")
# Optional per-example features (sentence pairs, span masking), laid in the same slot so
# that they stay aligned with the tokens; stored + 1, so that 0 means "absent" or padding.
_MLM_EXTRAS = ("token_type_ids", "span_left", "span_right", "span_offset", "sentence_label")


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

  Examples may also carry (sentence_pairs.py, masking.py), each passed on when present:
    token_type_ids (per token)  -> encoder_token_type_ids (per packed segment, 0 on padding)
    span_left, span_right       -> mlm_span_left, mlm_span_right: positions within the ROW
                                   (the example's start added when packed), 0 outside spans
    span_offset                 -> mlm_span_offset (1-based place in the span, 0 outside)
    sentence_label (a scalar)   -> sentence_labels, one per row (shape () per row, (B,) a
                                   batch): unpacked only, as the pooler reads the row's
                                   first token; packing them is a ConfigError.
  Packed, I=10, one bin: an example of 4 tokens, then one of 5 whose span is its tokens 1..2
  (span_left 0, span_right 3, span_offset [0, 1, 2, 0, 0]) ->
       mlm_span_left   = [0, 0, 0, 0, 0, 4, 4, 0, 0, 0]
       mlm_span_right  = [0, 0, 0, 0, 0, 7, 7, 0, 0, 0]
       mlm_span_offset = [0, 0, 0, 0, 0, 1, 2, 0, 0, 0]
  The optional keys appear in a row when its examples carry them, so the tasks of one
  mixture should all carry them or none.
  """
  def _required(self):
    return ("inputs",)

  def _slots(self, lengths):
    # Aligned: one segment ids feature.
    return ((_MLM_FEATURES + _MLM_EXTRAS, lengths["inputs"]),)

  def _prepare(self, example, lengths):
    length = lengths["inputs"]
    out = [self._feature(example, k, length) for k in _MLM_FEATURES]
    sizes = {k: len(example[k]) for k in _MLM_FEATURES}  # before trimming
    size = len(out[0])
    for key in _MLM_EXTRAS[:-1]:
      if key not in example:
        out.append(_zeros(size))
        continue
      sizes[key] = len(example[key])
      value = self._feature(example, key, length) + 1
      if key == "span_right" and len(value) < sizes["inputs"]:  # cut: keep it in the example
        value = np.minimum(value, size)
      out.append(value)
    if len(set(sizes.values())) != 1:
      raise ValueError(f"{self._name}: {', '.join(sizes)} must have one length, got {sizes}")
    if "sentence_label" not in example:
      return (*out, _zeros(size))
    if self.pack:
      raise ConfigError(f"{self._name}: examples with a sentence_label (sentence-pair tasks) "
                        "need pack=False: the pooler reads each row's first token, so a row "
                        "must hold one example (set TrainConfig.pack = False)")
    label = np.asarray(example["sentence_label"])
    if label.ndim or label.dtype.kind not in "iu" or label < 0:
      raise ConfigError(f"{self._name}: sentence_label must be a non-negative integer scalar, "
                        f"got {label!r}")
    return (*out, np.full(size, int(label) + 1, np.int32))

  def _to_model(self, row):
    out = {**_encoder_features(row), "mlm_target_tokens": row["targets"],
           "mlm_loss_weights": row["weights"]}
    if row["token_type_ids"].any():
      out["encoder_token_type_ids"] = np.maximum(row["token_type_ids"] - 1, 0)
    if row["span_offset"].any():
      offset = np.maximum(row["span_offset"] - 1, 0)
      # Each token's example starts at (row index - position in its example).
      start = np.arange(offset.shape[-1], dtype=np.int32) - row["inputs_positions"]
      for key in ("span_left", "span_right"):
        out[f"mlm_{key}"] = np.where(offset > 0, row[key] - 1 + start, 0).astype(np.int32)
      out["mlm_span_offset"] = offset
    if row["sentence_label"].any():
      out["sentence_labels"] = np.maximum(row["sentence_label"][..., 0] - 1, 0)
    return out

  def _model_lengths(self, lengths):
    """The keys every row has; the optional ones (class docstring) depend on the examples."""
    return {k: lengths["inputs"] for k in (*ENCODER_KEYS, "mlm_target_tokens", "mlm_loss_weights")}


def _zeros(size: int) -> np.ndarray:
  """int32 zeros for an absent optional feature: a broadcast view, nothing allocated."""
  return np.broadcast_to(np.int32(0), (size,))
