"""Looking at tasks: list them, show a few examples at each stage, measure lengths and packing.

Backs `t5lite tasks list | show NAME -n 3 | stats NAME`.
"""
from __future__ import annotations

import itertools
from typing import Callable, Mapping

import grain
import numpy as np

from t5lite.data.converters import sequence as conv
from t5lite.data.registry import MixtureRegistry, Task, TaskRegistry, get_mixture_or_task
from t5lite.data.rows import PipelineConfig, task_row_dataset
from t5lite.errors import ConfigError


def list_tasks() -> str:
  """One line per registered task and mixture."""
  lines = [f"{len(TaskRegistry.names())} tasks:"]
  for name in TaskRegistry.names():
    task = TaskRegistry.get(name)
    splits = ", ".join(task.splits) if task.splits else "any split"
    lines.append(f"  {name}  [{splits}]  features: {', '.join(task.output_features)}")
  lines.append(f"{len(MixtureRegistry.names())} mixtures:")
  for name in MixtureRegistry.names():
    members = [t if isinstance(t, str) else t[0] for t in MixtureRegistry.get(name).tasks]
    lines.append(f"  {name}  = {', '.join(members)}")
  return "\n".join(lines)


def preprocessed_examples(task: Task, split: str, lengths: Mapping[str, int], n: int,
                          seed: int = 0) -> list[dict]:
  """The first n fully preprocessed examples, in source order (no shuffling)."""
  config = PipelineConfig(global_batch_size=1, task_feature_lengths=lengths, split=split,
                          seed=seed, shuffle=False, num_epochs=1)
  return list(itertools.islice(iter(task_row_dataset(task, 0, config)), n))


def _short(value, limit: int = 300) -> str:
  text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
  return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def show_task(name: str, split: str, lengths: Mapping[str, int], n: int = 3) -> str:
  """Raw, preprocessed and decoded examples of a task, with token lengths."""
  task = _as_task(name)
  source = task.get_source(split)
  if getattr(source, "streaming", False):
    size = f"streamed from {source.num_shards} shards"
    raw = itertools.islice((ex for shard in range(source.num_shards)
                            for ex in source.examples(shard)), n)
  else:
    size = f"{len(source)} source examples"
    raw = (source[i] for i in range(min(n, len(source))))
  out = [f"task {task.name}, split {split}: {size}, source {source!r}"]
  for i, example in enumerate(raw):
    out.append(f"--- raw example {i}")
    out.extend(f"  {k}: {_short(v)}" for k, v in example.items())
  for i, ex in enumerate(preprocessed_examples(task, split, lengths, n)):
    out.append(f"--- preprocessed example {i}")
    for key, value in ex.items():
      out.append(f"  {key}: {_short(value)}")
      feature = task.output_features.get(key)
      if feature is not None and isinstance(value, np.ndarray):
        out.append(f"  {key} ({len(value)} tokens) decoded: "
                   f"{_short(feature.vocabulary.decode(value.tolist()))}")
  return "\n".join(out)


def task_stats(name: str, split: str, lengths: Mapping[str, int],
               converter: Callable[[bool], conv.FeatureConverter], max_examples: int = 1000
               ) -> dict:
  """Token counts per feature over up to max_examples preprocessed examples, and the
  non-pad fraction of those examples converted by converter(pack) unpacked and packed
  (a model family's converter, e.g. family_of(config).converter)."""
  task = _as_task(name)
  examples = preprocessed_examples(task, split, lengths, max_examples)
  stats: dict = {"task": task.name, "split": split, "examples": len(examples)}
  for feature in task.output_features:
    sizes = np.array([len(ex[feature]) for ex in examples if feature in ex])
    if len(sizes):
      stats[feature] = {"tokens": int(sizes.sum()), "mean": round(float(sizes.mean()), 2),
                        "max": int(sizes.max()), "over_length": int((sizes > lengths.get(
                            feature, np.inf)).sum())}
  for pack in (False, True):
    key = "packing_efficiency" if pack else "padding_efficiency"
    try:
      rows = converter(pack)(grain.MapDataset.source(examples).to_iter_dataset(), lengths)
      stats[key] = round(conv.packing_efficiency(rows), 4)
    except ConfigError as e:  # e.g. sentence-pair rows, which are never packed
      if not pack:
        raise
      stats[key], stats["not_packable"] = None, str(e)
  return stats


def _as_task(name: str) -> Task:
  item = get_mixture_or_task(name)
  if not isinstance(item, Task):
    raise ConfigError(f"{name!r} is a mixture; show or measure one of its tasks: "
                      f"{[t if isinstance(t, str) else t[0] for t in item.tasks]}")
  return item
