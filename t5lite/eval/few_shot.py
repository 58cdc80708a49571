"""Few-shot prompting (in-context learning) for decoder-only models: no gradient step.

Each evaluation example gets a prompt of k solved examples drawn from the task's train split
(random, seeded per example, never the example itself), then its own input:

    summarize: The first text. => First summary.
    summarize: The second text. => Second summary.
    summarize: The text to solve. =>

The model continues the prompt; the continuation up to the first separator (a newline, where
the next demonstration would start) is the prediction, which goes through the task's
postprocess_fn and metric_fns as in any evaluation.

    result = few_shot_evaluate(model_config, params, task, k=3, prompt_length=512)
    result.metrics   # the task's metrics, e.g. {"accuracy": 61.0}
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import numpy as np

from t5lite.data.registry import Task
from t5lite.data.rows import PipelineConfig, task_row_dataset
from t5lite.errors import ConfigError
from t5lite.families import family_of
from t5lite.eval.evaluator import (DecodeConfig, EvalResult, feature_text, jsonable, metric_kind,
                                   pad_rows, postprocess)

Tree = Any


@dataclasses.dataclass(frozen=True)
class FewShotConfig:
  k: int = 3
  """Solved examples per prompt."""
  template: str = "{inputs} => {targets}"
  """How one example reads; the query is the template cut just before '{targets}'."""
  separator: str = "\n"
  """Between examples; a prediction ends at its first occurrence."""
  seed: int = 0
  """Which train examples each prompt shows."""


def _examples(task: Task, split: str, limit: int | None) -> list[dict]:
  """Preprocessed examples of a split, in order (they must keep their *_pretokenized text)."""
  config = PipelineConfig(global_batch_size=1, task_feature_lengths={}, split=split,
                          shuffle=False, num_epochs=1)
  examples = list(itertools.islice(task_row_dataset(task, 0, config), limit))
  if examples and not {"inputs_pretokenized", "targets_pretokenized"} <= set(examples[0]):
    raise ConfigError(f"task {task.name!r}: few-shot prompts need the text of inputs and targets "
                      "(the `tokenize` preprocessor keeps it as *_pretokenized)")
  return examples


def build_prompts(task: Task, config: FewShotConfig = FewShotConfig(), *,
                  split: str = "validation", train_split: str = "train",
                  max_examples: int | None = None, max_train_examples: int | None = 1000
                  ) -> tuple[list[str], list[dict]]:
  """(prompts, evaluation examples): one k-shot prompt per example of `split`."""
  shots = _examples(task, train_split, max_train_examples)
  queries = _examples(task, split, max_examples)
  if len(shots) < config.k:
    raise ConfigError(f"task {task.name!r} split {train_split!r} has {len(shots)} examples, "
                      f"fewer than k={config.k}")
  head, _, _ = config.template.partition("{targets}")
  prompts = []
  for index, example in enumerate(queries):
    rng = np.random.default_rng([config.seed, index])
    chosen = rng.choice(len(shots), size=config.k, replace=False)
    demos = [config.template.format(inputs=feature_text(shots[i], "inputs"),
                                    targets=feature_text(shots[i], "targets")) for i in chosen]
    query = head.format(inputs=feature_text(example, "inputs")).rstrip()
    prompts.append(config.separator.join(demos + [query]))
  return prompts, queries


def few_shot_evaluate(model_config, params: Tree, task: Task, config: FewShotConfig =
                      FewShotConfig(), *, prompt_length: int = 512,
                      decode: DecodeConfig = DecodeConfig(max_decode_length=32),
                      split: str = "validation", max_examples: int | None = None,
                      generate_fn: Callable | None = None) -> EvalResult:
  """The task's predict metrics on k-shot prompts, decoded by a decoder-only model.

  A prompt longer than prompt_length keeps its end (the query and the nearest examples).
  """
  family = family_of(model_config)
  if not family.continues_prompts:
    raise ConfigError(f"few-shot prompting needs a model that continues a prompt (a decoder-only "
                      f"language model); a {family.name!r} model does not")
  if generate_fn is None:
    from t5lite.models.decoding.search import generate as generate_fn
  vocab = task.output_features["targets"].vocabulary
  prompts, examples = build_prompts(task, config, split=split, max_examples=max_examples)
  rows = [vocab.encode(p)[-prompt_length:] for p in prompts]
  texts = []
  for start in range(0, len(rows), decode.batch_size):
    batch = pad_rows(rows[start:start + decode.batch_size], prompt_length, decode.batch_size)
    tokens = np.asarray(generate_fn(model_config, params, batch,
                                    max_decode_length=decode.max_decode_length or 32,
                                    **decode.generate_kwargs()))
    texts.extend(vocab.decode(t.tolist()) for t in tokens[:len(rows) - start])
  answers = [t.split(config.separator)[0].strip() for t in texts]
  predictions = [postprocess(task, a, ex, False) for a, ex in zip(answers, examples)]
  targets = [postprocess(task, feature_text(ex, "targets"), ex, True) for ex in examples]
  metrics: dict[str, float] = {}
  for fn in task.metric_fns:
    if metric_kind(fn) == "predict":  # score metrics need no prompt: use TaskEvaluator
      metrics.update({k: float(v) for k, v in fn(targets, predictions).items()})
  records = [jsonable({"prompt": p, "target": t, "prediction_text": a, "prediction": pr})
             for p, t, a, pr in zip(prompts, targets, answers, predictions)]
  return EvalResult(metrics=metrics, predictions=records)
