"""The feature converter of finetuning-head tasks: one example per row, padded, labels beside.

A head task's examples (t5lite.data.converters.head_features makes them) carry `inputs` (token ids
with the vocabulary's specials), optionally `token_type_ids`, and the labels of their head
(t5lite.models.heads). Rows are never packed: a classifier reads its row's first (encoder)
or last real (decoder) token, so one example is one row. task_feature_lengths {"inputs": L}:

  encoder, L=6, {"inputs": [2, 7, 8, 3], "token_type_ids": [0, 0, 0, 0], "label": 1}
  -> encoder_input_tokens   = [2, 7, 8, 3, 0, 0]   encoder_segment_ids = [1, 1, 1, 1, 0, 0]
     encoder_positions      = [0, 1, 2, 3, 0, 0]   encoder_token_type_ids = [0, 0, 0, 0, 0, 0]
     labels                 = 1
  token_classification: token_labels (L,), -100 on padding and on unlabelled pieces
  question_answering:   start_positions, end_positions (scalars)
  multiple_choice:      inputs (C, L_c) -> encoder_* (C, L), labels
  decoder (GPT-2 / GPT-1): decoder_input_tokens / _segment_ids / _positions, labels, and with
                        an auxiliary LM loss decoder_target_tokens (the next token) and
                        decoder_loss_weights.
Labels are int32 for classification, float32 for regression (a scalar) and multi-label
(num_labels 0/1 values). A label outside the head's classes is a ConfigError naming the
example (its `idx`, `id` or `example_id`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import grain
import numpy as np

from t5lite.errors import ConfigError

IGNORE = -100  # HF's ignore index: a token without a label


def example_name(example: Mapping[str, Any]) -> str:
  for key in ("idx", "id", "example_id"):
    if key in example:
      value = example[key]
      return repr(value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value)
  return "(no id)"


def _padded(values, length: int, fill: int = 0) -> np.ndarray:
  values = np.asarray(values, np.int32)[..., :length]
  pad = [(0, 0)] * (values.ndim - 1) + [(0, length - values.shape[-1])]
  return np.pad(values, pad, constant_values=fill)


@dataclasses.dataclass(frozen=True)
class HeadFeatureConverter:
  """Rows for a finetuning head (see the module docstring)."""
  head: str
  num_labels: int
  problem_type: str
  decoder: bool = False
  lm_loss: bool = False
  """Decoder: also emit next-token targets for an auxiliary LM loss (GPT-1)."""
  pack: bool = False
  """Accepted for the FeatureConverter interface; head rows are never packed."""

  def model_feature_lengths(self, task_feature_lengths: Mapping[str, int]) -> dict[str, int]:
    length = self._length(task_feature_lengths)
    prefix = "decoder" if self.decoder else "encoder"
    keys = [f"{prefix}_input_tokens", f"{prefix}_segment_ids", f"{prefix}_positions"]
    if not self.decoder:
      keys.append("encoder_token_type_ids")
    if self.head == "token_classification":
      keys.append("token_labels")
    if self.lm_loss:
      keys += ["decoder_target_tokens", "decoder_loss_weights"]
    return {k: length for k in keys}

  def _length(self, task_feature_lengths: Mapping[str, int]) -> int:
    length = task_feature_lengths.get("inputs")
    if not isinstance(length, int) or length < 1:
      raise ConfigError(f"HeadFeatureConverter: task_feature_lengths needs a positive 'inputs' "
                        f"length (got {dict(task_feature_lengths)})")
    return length

  def __call__(self, ds: grain.IterDataset, task_feature_lengths: Mapping[str, int]
               ) -> grain.IterDataset:
    length = self._length(task_feature_lengths)
    if isinstance(ds, grain.MapDataset):
      ds = ds.to_iter_dataset()
    return ds.map(_RowMaker(self, length))

  def row(self, example: Mapping[str, Any], length: int) -> dict[str, np.ndarray]:
    """One example -> one row of model features."""
    if "inputs" not in example:
      raise ConfigError(f"head task example {example_name(example)} has no 'inputs' (keys: "
                        f"{sorted(example)})")
    tokens = np.asarray(example["inputs"])
    real = _padded(np.ones(tokens.shape, np.int32), length)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), real.shape) * real
    prefix = "decoder" if self.decoder else "encoder"
    row = {f"{prefix}_input_tokens": _padded(tokens, length),
           f"{prefix}_segment_ids": real, f"{prefix}_positions": positions}
    if not self.decoder:
      types = example.get("token_type_ids", np.zeros(tokens.shape, np.int32))
      row["encoder_token_type_ids"] = _padded(types, length)
    if self.lm_loss:  # predict token t + 1 at position t
      targets = np.zeros(length, np.int32)
      targets[:-1] = row["decoder_input_tokens"][1:]
      row["decoder_target_tokens"] = targets
      row["decoder_loss_weights"] = np.concatenate([real[1:], [0]]).astype(np.int32)
    row.update(self._labels(example, length))
    return row

  def _labels(self, example, length) -> dict[str, np.ndarray]:
    name = example_name(example)
    if self.head == "token_classification":
      labels = _padded(example["token_labels"], length, IGNORE)
      bad = (labels != IGNORE) & ((labels < 0) | (labels >= self.num_labels))
      if bad.any():
        raise ConfigError(f"example {name}: token label {int(labels[bad][0])} is outside the "
                          f"head's {self.num_labels} classes")
      return {"token_labels": labels}
    if self.head == "question_answering":
      start, end = int(example["start_position"]), int(example["end_position"])
      if not (0 <= start < length and 0 <= end < length):
        raise ConfigError(f"example {name}: answer span ({start}, {end}) is outside its "
                          f"{length}-token window")
      return {"start_positions": np.int32(start), "end_positions": np.int32(end)}
    label = np.asarray(example["label"])
    if self.problem_type == "regression":
      return {"labels": label.astype(np.float32).reshape(())}
    if self.problem_type == "multi_label_classification":
      if label.shape != (self.num_labels,):
        raise ConfigError(f"example {name}: a multi-label label must have {self.num_labels} "
                          f"0/1 values, got shape {label.shape}")
      return {"labels": label.astype(np.float32)}
    classes = self.num_labels if self.head != "multiple_choice" else np.asarray(
        example["inputs"]).shape[0]
    if label.ndim or not 0 <= int(label) < classes:
      raise ConfigError(f"example {name}: label {label.tolist()!r} is outside the head's "
                        f"{classes} classes (0..{classes - 1}); fix the data or num_labels")
    return {"labels": np.int32(label)}


@dataclasses.dataclass(frozen=True)
class _RowMaker:
  """Picklable map function (grain workers)."""
  converter: HeadFeatureConverter
  length: int

  def __call__(self, example):
    return self.converter.row(example, self.length)
