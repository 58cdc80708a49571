"""Task evaluation as seqio does it: decode (or score), postprocess, compute the metrics.

    evaluator = TaskEvaluator(task, split="validation", feature_lengths={"inputs": 512,
                              "targets": 128}, max_examples=None)
    result = evaluator.evaluate(model_config, params, DecodeConfig())
    result.metrics        # {"rouge1": 41.2, ...}: every metric fn of the task, merged
    result.predictions    # [{"inputs": ..., "target": ..., "prediction": ...}, ...]

A task's metric_fns are told apart by their parameter names, as in seqio: `(targets,
predictions)` are predict metrics (the model decodes each input; the decoded text goes through
postprocess_fn), `(targets, scores)` are score metrics (the model scores each target: the sum
of its tokens' log-likelihoods). Targets are the examples' `targets_pretokenized` text (or the
decoded target tokens) through postprocess_fn(text, example=ex, is_target=True).

The examples are the task's preprocessed split in order, unshuffled and unpacked, read once
and kept, so every evaluation of a run sees the same examples. Batches are padded to a fixed
size and length: one compiled decode serves the whole split.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from t5lite.data.registry import Task
from t5lite.data.rows import PipelineConfig, task_row_dataset
from t5lite.errors import ConfigError
from t5lite.models.config import ModelConfig

Tree = Any
DECODE_METHODS = ("greedy", "beam", "sample")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """How predictions are decoded (t5lite.generate's settings)."""

  method: str = "greedy"
  """'greedy', 'beam' or 'sample'."""
  num_beams: int = 4
  """Beam search width."""
  alpha: float = 0.6
  """Beam search length penalty ((5 + len) / 6) ** alpha (T5X's brevity penalty)."""
  temperature: float = 1.0
  """Sampling temperature (0 = greedy)."""
  top_k: int = 0
  """Sample among the k most likely tokens (0 = all)."""
  top_p: float = 1.0
  """Sample among the smallest set of tokens whose probability reaches p (1 = all)."""
  seed: int = 0
  """Sampling seed: the same seed gives the same outputs."""
  max_decode_length: int | None = None
  """Output tokens at most (None: the targets feature length)."""
  batch_size: int = 32
  """Examples decoded together."""

  def __post_init__(self):
    if self.method not in DECODE_METHODS:
      raise ConfigError(f"DecodeConfig.method={self.method!r} is not one of {DECODE_METHODS}")
    if self.batch_size < 1:
      raise ConfigError(f"DecodeConfig.batch_size must be >= 1, got {self.batch_size}")

  def generate_kwargs(self) -> dict:
    return dict(method=self.method, num_beams=self.num_beams, alpha=self.alpha,
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                seed=self.seed)


@dataclasses.dataclass
class EvalResult:
  metrics: dict[str, float]
  predictions: list[dict]
  """Per example: inputs and target text, the prediction (raw and postprocessed), score."""


def metric_kind(fn: Callable) -> str:
  """'predict' for fn(targets, predictions), 'score' for fn(targets, scores) (seqio's rule)."""
  params = inspect.signature(fn).parameters
  if "predictions" in params:
    return "predict"
  if "scores" in params:
    return "score"
  raise ConfigError(f"metric fn {getattr(fn, '__name__', fn)!r} takes neither `predictions` nor "
                    "`scores`: name its second parameter one of them (seqio's convention)")


def pad_rows(rows: Sequence[np.ndarray], length: int, num_rows: int) -> np.ndarray:
  """Right-pads (and cuts) token rows to `length` with 0, and adds all-0 rows up to num_rows.

  Example: [[5, 1], [7, 8, 1]], length 4, num_rows 3 -> [[5 1 0 0], [7 8 1 0], [0 0 0 0]].
  """
  out = np.zeros((num_rows, length), np.int32)
  for i, row in enumerate(rows):
    row = np.asarray(row, np.int32)[:length]
    out[i, :len(row)] = row
  return out


def feature_text(example: Mapping, name: str, vocab=None) -> str:
  """An example's `name` feature as text: its `<name>_pretokenized` copy (what `tokenize`
  keeps), else its tokens decoded with `vocab`."""
  text = example.get(f"{name}_pretokenized")
  if text is not None:
    return text.decode("utf-8") if isinstance(text, bytes) else str(text)
  if vocab is None:
    raise ConfigError(f"example has no {name}_pretokenized text (keep `tokenize`'s copy)")
  return vocab.decode(np.asarray(example[name]).tolist())


def postprocess(task: Task, text: str, example: Mapping, is_target: bool):
  if task.postprocess_fn is None:
    return text
  return task.postprocess_fn(text, example=example, is_target=is_target)


class TaskEvaluator:
  """One task's evaluation examples, and the evaluation of params on them."""

  def __init__(self, task: Task, *, split: str, feature_lengths: Mapping[str, int],
               max_examples: int | None = None, seed: int = 0, use_cached: bool = False,
               cache_dir: str | None = None):
    self.task, self.split = task, split
    self.feature_lengths = dict(feature_lengths)
    config = PipelineConfig(global_batch_size=1, task_feature_lengths=self.feature_lengths,
                            split=split, seed=seed, shuffle=False, num_epochs=1,
                            use_cached=use_cached, cache_dir=cache_dir)
    stream = task_row_dataset(task, 0, config)
    self.examples = list(itertools.islice(stream, max_examples))
    if not self.examples:
      raise ConfigError(f"task {task.name!r} split {split!r} has no examples after preprocessing")
    self.kinds = {getattr(fn, "__name__", repr(fn)): metric_kind(fn) for fn in task.metric_fns}
    if task.head:  # a finetuning head's labels (t5lite.eval.head_eval)
      from t5lite.eval import head_eval
      self.targets = head_eval.targets(task, self.examples)
      return
    vocab = task.output_features["targets"].vocabulary
    self.targets = [postprocess(task, feature_text(ex, "targets", vocab), ex, True)
                    for ex in self.examples]

  def _batches(self, batch_size: int, progress: Callable[[int], Any] | None = None):
    for start in range(0, len(self.examples), batch_size):
      chunk = self.examples[start:start + batch_size]
      yield start, chunk
      if progress is not None:
        progress(len(chunk))

  def _passes(self) -> set[str]:
    """'predict' and / or 'score': what evaluate runs over the examples ('head' for a head)."""
    if self.task.head:
      return {"head"}
    kinds = set(self.kinds.values())
    return (kinds & {"predict", "score"}) | ({"predict"} if not kinds else set())

  def work(self) -> int:
    """Examples that evaluate goes through, each pass counted (a progress bar's total)."""
    return len(self.examples) * len(self._passes())

  def predict(self, model_config: ModelConfig, params: Tree, decode: DecodeConfig,
              generate_fn: Callable | None = None,
              progress: Callable[[int], Any] | None = None) -> list[np.ndarray]:
    """Decoded token ids per example (EOS and padding still in); progress(n) after each
    batch of n examples."""
    from t5lite.models.decoding.search import to_host
    if generate_fn is None:
      from t5lite.models.decoding.search import generate as generate_fn
    max_length = decode.max_decode_length or self.feature_lengths["targets"]
    inputs_length = self.feature_lengths["inputs"]
    outputs = []
    for _, chunk in self._batches(decode.batch_size, progress):
      inputs = pad_rows([ex["inputs"] for ex in chunk], inputs_length, decode.batch_size)
      tokens = to_host(generate_fn(model_config, params, inputs, max_decode_length=max_length,
                                   **decode.generate_kwargs()))
      outputs.extend(tokens[:len(chunk)])
    return outputs

  def score(self, model_config: ModelConfig, params: Tree, batch_size: int,
            score_fn: Callable | None = None,
            progress: Callable[[int], Any] | None = None) -> list[float]:
    """Each example's target log-likelihood under the model."""
    from t5lite.models.decoding.search import to_host
    if score_fn is None:
      from t5lite.models.decoding.search import score as score_fn
    scores = []
    for _, chunk in self._batches(batch_size, progress):
      inputs = pad_rows([ex["inputs"] for ex in chunk], self.feature_lengths["inputs"],
                         batch_size)
      targets = pad_rows([ex["targets"] for ex in chunk], self.feature_lengths["targets"],
                          batch_size)
      scores.extend(float(s) for s in to_host(score_fn(model_config, params, inputs,
                                                       targets))[:len(chunk)])
    return scores

  def evaluate(self, model_config: ModelConfig, params: Tree,
               decode: DecodeConfig = DecodeConfig(), *, generate_fn: Callable | None = None,
               score_fn: Callable | None = None,
               progress: Callable[[int], Any] | None = None) -> EvalResult:
    """Every metric fn of the task on these examples; decodes / scores only when needed
    (a head task: the head's logits, t5lite.eval.head_eval). progress(n): n more examples
    of work() done."""
    passes = self._passes()
    if self.task.head:
      from t5lite.eval import head_eval
      metrics, records = head_eval.evaluate(
          self.task, self.examples, self.targets, model_config, params,
          self.feature_lengths["inputs"], decode.batch_size)
      if progress is not None:
        progress(len(self.examples))
      return EvalResult(metrics=metrics, predictions=[jsonable(r) for r in records])
    vocab = self.task.output_features["targets"].vocabulary
    inputs_vocab = self.task.output_features["inputs"].vocabulary
    records = [{"inputs": feature_text(ex, "inputs", inputs_vocab), "target": t}
               for ex, t in zip(self.examples, self.targets)]
    predictions = scores = None
    if "predict" in passes:
      tokens = self.predict(model_config, params, decode, generate_fn, progress)
      texts = [vocab.decode(t.tolist()) for t in tokens]
      predictions = [postprocess(self.task, text, ex, False)
                     for text, ex in zip(texts, self.examples)]
      for record, text, prediction in zip(records, texts, predictions):
        record.update(prediction_text=text, prediction=prediction)
    if "score" in passes:
      scores = self.score(model_config, params, decode.batch_size, score_fn, progress)
      for record, value in zip(records, scores):
        record["score"] = value
    metrics: dict[str, float] = {}
    for fn in self.task.metric_fns:
      given = predictions if metric_kind(fn) == "predict" else scores
      metrics.update({k: float(v) for k, v in fn(self.targets, given).items()})
    return EvalResult(metrics=metrics, predictions=[jsonable(r) for r in records])


def jsonable(value):
  """numpy scalars and arrays -> Python numbers and lists, recursively (for JSONL)."""
  if isinstance(value, dict):
    return {k: jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [jsonable(v) for v in value]
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, np.generic):
    return value.item()
  return value
