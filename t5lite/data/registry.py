"""Tasks, mixtures and their registries (seqio's vocabulary, without TensorFlow).

A Task is a source (per split) + preprocessors + output features + postprocessing +
metrics. A Mixture samples its tasks by rate. Registering validates names (no path
separators, no '..') and rejects duplicates; an unknown name lists the closest ones.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any, Callable, Mapping, Sequence

from t5lite.data.vocab.vocabularies import Vocabulary
from t5lite.errors import ConfigError, ConfigKeyError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]*$")


@dataclasses.dataclass(frozen=True)
class Feature:
  """One output feature of a task (e.g. 'inputs' or 'targets')."""
  vocabulary: Vocabulary
  add_eos: bool = True
  """append_eos / append_eos_after_trim add EOS (the vocabulary's eos_id) to this feature."""
  required: bool = True
  """Examples must carry it after preprocessing (the converter fails loudly otherwise)."""


class CachePoint:
  """Marks where `t5lite cache` stops: preprocessors before it run once, offline."""

  def __repr__(self):
    return "CACHE_POINT"

  def __reduce__(self):  # unpickles as the module's one instance, so `is CACHE_POINT` holds
    return "CACHE_POINT"


CACHE_POINT = CachePoint()

SourceFactory = Callable[[str], Any]  # split -> random-access data source


@dataclasses.dataclass(frozen=True)
class Task:
  """A named text-to-text task.

  source: {split: data source or zero-argument factory}, or a function split -> source.
  preprocessors: functions applied in order (see t5lite.data.preprocessors); CACHE_POINT
    may appear once, after the deterministic ones.
  postprocess_fn: decoded text (and the example) -> value compared by metric_fns.
  metric_fns: functions (targets, predictions) -> {name: value}.
  shuffle_buffer_size: None shuffles each split fully (a seeded index permutation);
    an int shuffles within windows of that many examples.
  head: None for a token-prediction task (text-to-text, LM, MLM). A finetuning head's name
    ('sequence_classification', 'token_classification', 'question_answering',
    'multiple_choice') for a task whose examples carry that head's labels (see
    t5lite.families.heads): the model must have ModelConfig.head equal to it. Its metric fns
    then get postprocess_fn(None, example=ex, is_target=True) as targets and
    postprocess_fn(head_output, example=ex, is_target=False) as predictions, where
    head_output is the example's float32 head logits (numpy, padding cut off).
  num_labels: the head's number of classes (labels, tags; 1 for regression).
  """
  name: str
  source: Mapping[str, Any] | SourceFactory
  output_features: Mapping[str, Feature]
  preprocessors: Sequence[Callable | CachePoint] = ()
  postprocess_fn: Callable | None = None
  metric_fns: Sequence[Callable] = ()
  shuffle_buffer_size: int | None = None
  head: str | None = None
  num_labels: int | None = None

  def __post_init__(self):
    validate_name(self.name, "task")
    if self.head is not None and not (isinstance(self.num_labels, int) and self.num_labels >= 1):
      raise ConfigError(f"task {self.name!r}: a {self.head!r} task needs num_labels >= 1 "
                        f"(got {self.num_labels!r})")
    if sum(p is CACHE_POINT for p in self.preprocessors) > 1:
      raise ConfigError(f"task {self.name!r}: CACHE_POINT may appear at most once")
    if not self.output_features:
      raise ConfigError(f"task {self.name!r} needs output_features")

  @property
  def splits(self) -> tuple[str, ...] | None:
    """Known split names, or None when the source is a function of the split."""
    return tuple(self.source) if isinstance(self.source, Mapping) else None

  def get_source(self, split: str):
    """The random-access data source of a split (built on first use)."""
    if isinstance(self.source, Mapping):
      if split not in self.source:
        raise ConfigError(f"task {self.name!r} has no split {split!r}; splits: "
                          f"{sorted(self.source)}")
      source = self.source[split]
      return source() if callable(source) and not hasattr(source, "__getitem__") else source
    return self.source(split)

  @property
  def cache_index(self) -> int | None:
    """Position of CACHE_POINT in preprocessors, or None."""
    for i, p in enumerate(self.preprocessors):
      if p is CACHE_POINT:
        return i
    return None

  @property
  def vocabularies(self) -> dict[str, Vocabulary]:
    return {k: f.vocabulary for k, f in self.output_features.items()}


RateFn = Callable[[Task], float]


@dataclasses.dataclass(frozen=True)
class Mixture:
  """Tasks sampled in proportion to rates: numbers, or a function of the task
  (e.g. `rate_num_examples`). Mixtures may contain mixtures (flattened)."""
  name: str
  tasks: Sequence[tuple[str, float | RateFn] | str]
  default_rate: float | RateFn | None = None

  def __post_init__(self):
    validate_name(self.name, "mixture")
    if not self.tasks:
      raise ConfigError(f"mixture {self.name!r} has no tasks")

  def task_rates(self, split: str = "train") -> list[tuple[Task, float]]:
    """(task, rate) pairs with sub-mixtures flattened, rates normalized within each."""
    out: list[tuple[Task, float]] = []
    for entry in self.tasks:
      name, rate = entry if isinstance(entry, tuple) else (entry, self.default_rate)
      if rate is None:
        raise ConfigError(f"mixture {self.name!r}: {name!r} has no rate and no default_rate")
      if name in MixtureRegistry._registry:
        sub = MixtureRegistry.get(name).task_rates(split)
        total = sum(r for _, r in sub)
        weight = rate if not callable(rate) else sum(rate(t) for t, _ in sub)
        out.extend((t, weight * r / total) for t, r in sub)
      else:
        task = TaskRegistry.get(name)
        out.append((task, rate(task) if callable(rate) else float(rate)))
    if any(r < 0 for _, r in out) or not sum(r for _, r in out) > 0:
      raise ConfigError(f"mixture {self.name!r}: rates must be >= 0 with a positive sum")
    return out


def rate_num_examples(task: Task, split: str = "train", maximum: int | None = None,
                      scale: float = 1.0, temperature: float = 1.0) -> float:
  """A task's rate from its number of examples, as seqio's `mixing_rate_num_examples`:
  n * scale, clipped at `maximum`, then raised to 1 / temperature. With temperature 1 this is
  T5's examples-proportional mixing (the paper's artificial dataset size limit K is
  `maximum`); with temperature T > 1 it is T5's temperature-scaled mixing, which moves the
  rates toward equal (T5 used K = 2**21 and T = 2, 4 or 8). Pass the options with
  functools.partial: `(name, functools.partial(rate_num_examples, maximum=2**21,
  temperature=2.0))`. n is the task's source examples in `split` (what seqio falls back to
  for a task that is not cached); a streamed source gives it from its files' metadata
  (Parquet, Arrow) or its `num_examples=` argument."""
  if not temperature > 0:
    raise ConfigError(f"rate_num_examples of task {task.name!r}: temperature {temperature!r} "
                      "must be > 0 (1.0: proportional to the example counts)")
  rate = len(task.get_source(split)) * scale
  if maximum:
    rate = min(rate, maximum)
  return rate ** (1.0 / temperature) if temperature != 1.0 else rate


def validate_name(name: str, kind: str) -> None:
  if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
    raise ConfigError(f"invalid {kind} name {name!r}: use letters, digits and _ . : - "
                      "(no path separators, no '..')")


class _Registry:
  _registry: dict[str, Any]
  _kind = "task"

  @classmethod
  def add(cls, item):
    if item.name in TaskRegistry._registry or item.name in MixtureRegistry._registry:
      raise ConfigError(f"{item.name!r} is already registered; names of tasks and mixtures "
                        "are unique (remove it first to redefine it)")
    cls._registry[item.name] = item
    return item

  @classmethod
  def remove(cls, name: str) -> None:
    cls._registry.pop(name, None)

  @classmethod
  def names(cls) -> list[str]:
    return sorted(cls._registry)

  @classmethod
  def get(cls, name: str):
    if name not in cls._registry:
      near = difflib.get_close_matches(name, list(cls._registry), n=5, cutoff=0.4)
      hint = f"; closest: {', '.join(near)}" if near else ""
      raise ConfigKeyError(f"unknown {cls._kind} {name!r}{hint} "
                           f"({len(cls._registry)} registered; `t5lite tasks list` shows them)")
    return cls._registry[name]


class TaskRegistry(_Registry):
  _registry: dict[str, Task] = {}
  _kind = "task"


class MixtureRegistry(_Registry):
  _registry: dict[str, Mixture] = {}
  _kind = "mixture"


def get_mixture_or_task(name: str) -> Task | Mixture:
  """A registered task or mixture; the error lists near names of both kinds."""
  if name in MixtureRegistry._registry:
    return MixtureRegistry._registry[name]
  if name in TaskRegistry._registry:
    return TaskRegistry._registry[name]
  everything = list(TaskRegistry._registry) + list(MixtureRegistry._registry)
  near = difflib.get_close_matches(name, everything, n=5, cutoff=0.4)
  hint = f"; closest: {', '.join(near)}" if near else ""
  raise ConfigKeyError(f"unknown task or mixture {name!r}{hint}")


def tasks_of(names: str | Sequence[str]) -> list[Task]:
  """The tasks of task and mixture names, in order, each once (mixtures flattened).

  Example: tasks_of(["glue_v002", "squad"]) -> [cola, sst2, ..., squad].
  """
  names = [names] if isinstance(names, str) else list(names)
  tasks: list[Task] = []
  for name in names:
    item = get_mixture_or_task(name)
    for task in [t for t, _ in item.task_rates()] if isinstance(item, Mixture) else [item]:
      if task not in tasks:
        tasks.append(task)
  return tasks


def add_task(name: str, source, output_features, preprocessors=(), **kwargs) -> Task:
  """Creates and registers a Task."""
  return TaskRegistry.add(Task(name, source, output_features, tuple(preprocessors), **kwargs))


def add_mixture(name: str, tasks, default_rate=None) -> Mixture:
  """Creates and registers a Mixture."""
  return MixtureRegistry.add(Mixture(name, tuple(tasks), default_rate))
