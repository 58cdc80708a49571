"""Evaluation of finetuning-head tasks (Task.head): the head's logits instead of decoding.

The examples are the task's unpacked validation examples (TaskEvaluator reads them). Each
batch goes through the family's head converter and the model's head (no dropout); each
example's logits, padding cut off, go through the task's postprocess_fn:

  targets     = [postprocess_fn(None, example=ex, is_target=True)]
  predictions = [postprocess_fn(logits, example=ex, is_target=False)]

logits per head: sequence classification (num_labels,) (regression (1,)), token
classification (L, num_labels), question answering (L, 2) (start, end), multiple choice
(C,). Without a postprocess_fn: targets are the examples' `label` and predictions the argmax
(the number, for regression), which the metric fns compare.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from t5lite.families import family_of
from t5lite.families import heads as head_lib
from t5lite.models.config import ModelConfig

Tree = Any


def _default(output, example: Mapping[str, Any], is_target: bool):
  if is_target:
    label = np.asarray(example["label"])
    return label.item() if label.ndim == 0 else label.tolist()
  output = np.asarray(output)
  return float(output[0]) if output.shape == (1,) else int(np.argmax(output))


def postprocess(task, output, example: Mapping[str, Any], is_target: bool):
  if task.postprocess_fn is None:
    return _default(output, example, is_target)
  return task.postprocess_fn(output, example=example, is_target=is_target)


def targets(task, examples: Sequence[Mapping[str, Any]]) -> list:
  return [postprocess(task, None, ex, True) for ex in examples]


@functools.lru_cache(maxsize=8)
def _logits_fn(config: ModelConfig):
  family = family_of(config)
  return jax.jit(lambda params, batch: head_lib.head_logits(family, params, batch))


def _cut(logits: np.ndarray, example: Mapping[str, Any], head: str) -> np.ndarray:
  """One example's logits without the padding positions."""
  if head in ("token_classification", "question_answering"):
    return logits[:np.asarray(example["inputs"]).shape[-1]]
  return logits


def head_outputs(task, config: ModelConfig, params: Tree, examples, length: int,
                 batch_size: int) -> list[np.ndarray]:
  """Each example's head logits (float32 numpy, padding cut)."""
  converter = head_lib.converter(config)
  logits_fn = _logits_fn(config)
  outputs = []
  for start in range(0, len(examples), batch_size):
    chunk = list(examples[start:start + batch_size])
    rows = [converter.row(ex, length) for ex in chunk]
    rows += [jax.tree.map(np.zeros_like, rows[0])] * (batch_size - len(rows))  # fixed shape
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    logits = np.asarray(jax.device_get(logits_fn(params, batch)), np.float32)
    outputs.extend(_cut(logits[i], ex, task.head) for i, ex in enumerate(chunk))
  return outputs


def _slim(prediction):
  """A prediction as a JSONL record shows it: a QA window's logits, offsets and context
  (what its metric combines across windows) are left out."""
  if isinstance(prediction, dict):
    return {k: v for k, v in prediction.items()
            if not isinstance(v, np.ndarray) and k != "context"}
  return prediction


def evaluate(task, examples, targets_: list, config: ModelConfig, params: Tree, length: int,
             batch_size: int) -> tuple[dict[str, float], list[dict]]:
  """(metrics, records) of a head task."""
  outputs = head_outputs(task, config, params, examples, length, batch_size)
  predictions = [postprocess(task, out, ex, False) for out, ex in zip(outputs, examples)]
  metrics: dict[str, float] = {}
  for fn in task.metric_fns:
    metrics.update({k: float(v) for k, v in fn(targets_, predictions).items()})
  records = [{"target": t, "prediction": _slim(p)} for t, p in zip(targets_, predictions)]
  return metrics, records
