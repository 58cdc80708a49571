"""Evaluation inside a training run: eval loss and token accuracy on each task's eval split,
and inference evals with the tasks' own metrics (t5lite.train.actions.Evaluate runs them).

All of it reads `trainer` (t5lite.train.trainer.Trainer) for the model, mesh and run config.
"""
from __future__ import annotations

import itertools
import json
from typing import Any, Iterator

import jax
import numpy as np

from t5lite.data.registry import tasks_of
from t5lite.eval.evaluator import TaskEvaluator
from t5lite.runtime import partitioning as part
from t5lite.runtime.processes import all_flags
from t5lite.util import atomic, paths

Tree = Any


def eval_tasks(name: str, split: str) -> list:
  """The run's tasks that have `split` (or take any split)."""
  return [t for t in tasks_of(name) if not t.splits or split in t.splits]


def evaluate(trainer, params: Tree) -> dict[str, float]:
  """Mean token loss and accuracy on each task's eval split, eval/<task>/{loss,
  token_accuracy}, and the family's other metrics over the split (eval/<task>/<metric>)."""
  config = trainer.config
  out = {}
  for task in eval_tasks(config.mixture_or_task_name, config.eval_split):
    try:
      batches = trainer.dataset(task.name, trainer.pipeline_config(
          config.eval_split, shuffle=False, num_epochs=1))
    except ValueError as e:  # e.g. a split smaller than the batch
      print(f"t5lite: eval of {task.name!r} skipped: {e}", flush=True)
      continue
    totals = {}
    count = 0
    for count, host_batch in enumerate(same_count_of_batches(batches, config.eval_steps), 1):
      sums = jax.device_get(trainer.eval_fn(params, part.global_batch(host_batch, trainer.mesh)))
      totals = {k: totals.get(k, 0.0) + float(v) for k, v in sums.items()}
    if not count:  # no figure rather than a loss of 0
      if jax.process_index() == 0:
        print(f"t5lite: eval of {task.name!r} skipped: no {config.eval_split} rows on some "
              "process (a smaller batch size gives every process some)", flush=True)
      continue
    weight = max(totals["weight_sum"], 1e-8)
    out[f"eval/{task.name}/loss"] = totals["loss"] / weight
    out[f"eval/{task.name}/token_accuracy"] = totals["correct"] / weight
    # The family's own figures over the whole split (ELECTRA's discriminator accuracy,
    # BERT's next-sentence accuracy, ...), from the same summed batches.
    extra = trainer.family.metrics(totals, max(totals.get("normalizer", weight), 1e-8))
    out.update({f"eval/{task.name}/{k}": float(v) for k, v in extra.items()
                if k not in ("z_loss", "weight_sum", "accuracy", "loss")})
  return out


def same_count_of_batches(batches, steps: int) -> Iterator[dict[str, np.ndarray]]:
  """Up to `steps` host batches of a finite split, as many on every process: the processes'
  rows end at different batches, and one that stopped calling the (collective) eval step
  would leave the others waiting. A process whose rows have ended feeds all-zero rows (loss
  weight 0), shaped like its first batch, until every process's have (one tiny all-gather
  per batch). When some process has no batch at all, it has nothing to shape them by: then
  every process yields nothing (they all see the same flags), and the task is skipped."""
  if jax.process_count() == 1:
    yield from itertools.islice(batches, steps)
    return
  blank = None
  for i in range(steps):
    batch = next(batches, None)
    flags = all_flags(batch is not None)
    if not any(flags):
      return
    if i == 0 and not all(flags):
      return
    if blank is None:
      blank = {k: np.zeros_like(v) for k, v in batch.items()}
    yield batch if batch is not None else blank


INFER_EVAL_DIR = "inference_eval"


def infer_evaluate(trainer, params: Tree, step: int,
                   evaluators: dict[str, TaskEvaluator | None]) -> dict[str, float]:
  """Each eval task's own metrics on decoded predictions: eval/<task>/<metric>. Predictions
  go to MODEL_DIR/inference_eval/<task>-<step>.jsonl. `evaluators` caches the examples."""
  config = trainer.config
  out = {}
  for task in eval_tasks(config.mixture_or_task_name, config.eval_split):
    if not task.metric_fns:
      continue
    if task.name not in evaluators:
      try:
        evaluators[task.name] = TaskEvaluator(
            task, split=config.eval_split, feature_lengths=config.task_feature_lengths,
            max_examples=config.infer_eval_examples, seed=config.seed,
            use_cached=config.use_cached_tasks, cache_dir=config.cache_dir)
      except ValueError as e:
        print(f"t5lite: inference eval of {task.name!r} skipped: {e}", flush=True)
        evaluators[task.name] = None
    evaluator = evaluators[task.name]
    if evaluator is None:
      continue
    result = evaluator.evaluate(trainer.model_config, params, config.decode)
    out.update({f"eval/{task.name}/{k}": v for k, v in result.metrics.items()})
    if trainer.is_primary:
      directory = paths.join(config.model_dir, INFER_EVAL_DIR)
      paths.makedirs(directory)
      atomic.write_file(paths.join(directory, f"{task.name}-{step}.jsonl"), "".join(
          json.dumps(record, ensure_ascii=False) + "\n" for record in result.predictions))
  return out
