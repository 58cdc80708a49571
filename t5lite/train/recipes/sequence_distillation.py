"""Sequence-level knowledge distillation (Kim and Rush, 2016) as a task wrapper.

Sequence-level KD trains a student on a teacher's *outputs* instead of the references: the
teacher decodes every input of a task once (beam search) and the student learns those
sequences with the ordinary cross entropy. Kim and Rush found it beats word-level (logit)
distillation for translation and lets greedy students approach beam-search teachers. Here the
teacher's outputs become a registered Task, so any student trains on them with the normal
trainer, pipeline and gin files (logit distillation: t5lite.families.distillation).

    from t5lite.train.recipes.sequence_distillation import add_sequence_distillation_task
    add_sequence_distillation_task(          # in a tasks module; the student's gin then has
        "wmt_ende_distilled",                # MIXTURE_OR_TASK_NAME = "wmt_ende_distilled"
        source_task="wmt_t2t_ende_v003", teacher="/runs/t5_large_ende",
        task_feature_lengths={"inputs": 256, "targets": 256}, num_beams=4, alpha=0.6)

add_sequence_distillation_task(name, source_task, teacher, *, task_feature_lengths,
    splits=("train", "validation"), method="beam", num_beams=4, alpha=0.6,
    max_decode_length=None, batch_size=32, cache_dir=None, log=print) -> Task
  teacher: a t5lite MODEL_DIR (or a step folder of one) or an HF model directory; an
    encoder-decoder, or a decoder-only model (then `inputs` is its prompt).
  source_task: a registered task with `inputs` and `targets`. Its splits are read as the
    evaluator reads them (rows.task_row_dataset: preprocessed, in order, unshuffled,
    unpacked); inputs are cut to task_feature_lengths['inputs'] as the feature converter cuts.
  method: 'beam' (num_beams; alpha: T5X's length penalty) or 'greedy'. max_decode_length:
    teacher tokens at most (None: the targets length). batch_size: speed only.

An example of the new task is the source example with `inputs` = the cut input ids and
`targets` = the teacher's tokens before its first EOS; the task's one preprocessor appends EOS
when the targets feature has add_eos (after a cut to the targets length - 1, as
append_eos_after_trim), so targets end with exactly one EOS, as the source's do. Output
features, postprocess_fn and metric_fns are the source task's.

Cache. Registering decodes the splits not cached yet, there and then (import the tasks module
once before a multi-host job, or every host decodes). A split goes to
CACHE/<source_task>.<key>/<split>.array_record (msgpack records, as t5lite.data.cache writes),
then its manifest <split>.json, last and atomically: a split without one is decoded again.
CACHE is cache_dir, else t5lite.data.cache.cache_root()/_sequence_distillation
($T5LITE_CACHE_DIR or ~/.cache/t5lite/tasks; "_..." is no task name: `t5lite cache` never
writes there). <key> hashes what determines the content, which the manifest holds in clear:
the source task's name, the two lengths, the decoding settings and the teacher's fingerprint
(its ModelConfig JSON and the sha256 of its params' bytes). Another teacher or setting is
another key: a new entry, never a stale one.

Deviations and limits:
  * Evaluated as a task of its own, the wrapper's targets (and targets_pretokenized) are the
    teacher's outputs: its metrics measure agreement with the teacher. Evaluate the student on
    the source task against the references. Other fields of the source examples pass through
    (SQuAD's `answers`, which its postprocess_fn reads as references, stay the real ones);
    fields msgpack cannot store (tuples, objects) are dropped and listed in the manifest.
  * The teacher is loaded at every registration to fingerprint its params, cache hit or not.
  * The source task is known by its name: after changing its data or preprocessors, delete
    its entries (or pass another cache_dir).
  * T5 rounds 32100 ids up to vocab_size 32128, so the teacher's vocab_size must be at least
    the task vocabulary's size (not equal to it), and a vocabulary saved with the teacher
    must be the task's.
  * Kim and Rush's seq-KD only (the top beam), not seq-inter or the word-level mix.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Callable, Mapping, Sequence

import numpy as np
from array_record.python import array_record_module
from flax import serialization

from t5lite.data import cache
from t5lite.util import atomic
from t5lite.data import preprocessors as pp
from t5lite.util.checks import check_feature_lengths, require_int
from t5lite.data.registry import MixtureRegistry, Task, TaskRegistry, add_task, validate_name
from t5lite.data.rows import PipelineConfig, task_row_dataset
from t5lite.data.vocab.vocabularies import load_vocabulary
from t5lite.errors import ConfigError, ConfigFileNotFoundError, ConfigKeyError
from t5lite.train.recipes import teacher as teacher_lib

FORMAT = 1  # in every key: records that come to mean something else never read old entries
FOLDER = "_sequence_distillation"
METHODS = ("beam", "greedy")


def add_sequence_distillation_task(
    name: str, source_task: str, teacher: str | os.PathLike, *,
    task_feature_lengths: Mapping[str, int], splits: Sequence[str] = ("train", "validation"),
    method: str = "beam", num_beams: int = 4, alpha: float = 0.6,
    max_decode_length: int | None = None, batch_size: int = 32, cache_dir: str | None = None,
    log: Callable[[str], None] | None = print) -> Task:
  """Registers `name`: `source_task` with the teacher's decoded outputs as targets (see the
  module docstring); decodes the splits not cached yet. Returns the Task."""
  splits = (splits,) if isinstance(splits, str) else tuple(splits)
  source = _source(name, source_task, splits)
  lengths = check_feature_lengths(task_feature_lengths, "task_feature_lengths")
  if not all(lengths.get(k) for k in ("inputs", "targets")):
    raise ConfigError(f"task_feature_lengths needs 'inputs' and 'targets' lengths, got "
                      f"{dict(task_feature_lengths)}")
  if method not in METHODS:
    raise ConfigError(f"method={method!r}: sequence distillation decodes with one of {METHODS}")
  require_int(num_beams, "num_beams", minimum=1)
  require_int(batch_size, "batch_size", minimum=1)
  max_length = require_int(max_decode_length, "max_decode_length", minimum=1,
                           optional=True) or lengths["targets"]
  # As generate canonicalizes them (one beam is greedy search): equal outputs, one key.
  settings = ({"method": "beam", "num_beams": int(num_beams), "alpha": float(alpha)}
              if method == "beam" and num_beams > 1 else {"method": "greedy"})
  config, load, saved_vocabulary, where = _teacher(teacher)
  _check_teacher(config, saved_vocabulary, where, source)  # before any weight is read
  config, params = load()
  family = _check_teacher(config, saved_vocabulary, where, source)
  # Through JSON, so that the key equals what a manifest reads back (tuples become lists).
  key = json.loads(json.dumps({
      "format": FORMAT, "source_task": source_task,
      "task_feature_lengths": {k: lengths[k] for k in ("inputs", "targets")},
      "decoding": {**settings, "max_decode_length": max_length},
      "teacher": {"config": json.loads(config.to_json()), "params_sha256": params_digest(params)},
  }))
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
  entry = os.path.join(cache_dir or os.path.join(cache.cache_root(), FOLDER),
                       f"{source_task}.{digest}")
  log = log or (lambda _: None)
  sources = {}
  for split in splits:
    manifest = _finished(entry, split, key)
    if manifest is None:
      log(f"sequence distillation: decoding {source_task!r} split {split!r} with {where} "
          f"({settings}) into {entry}")
      manifest = _decode_split(source, split, key, family, params, entry, batch_size, where)
      log(f"sequence distillation: {manifest['examples']} examples, {manifest['truncated']} "
          f"cut at max_decode_length={max_length}")
    else:
      log(f"sequence distillation: split {split!r} is cached in {entry}")
    sources[split] = cache.CachedSource([os.path.join(entry, split + ".array_record")],
                                        [{"source_examples": manifest["examples"]}])
  return add_task(name, sources, source.output_features, [append_eos_to_targets],
                  postprocess_fn=source.postprocess_fn, metric_fns=source.metric_fns,
                  shuffle_buffer_size=source.shuffle_buffer_size)


def append_eos_to_targets(ex: dict, output_features, sequence_length) -> dict:
  """The wrapper's preprocessor: append_eos_after_trim on `targets` alone (the cached inputs
  are the source's final ids, EOS included where the source appends one)."""
  return pp.append_eos_after_trim(ex, {"targets": output_features["targets"]}, sequence_length)


def strip_eos(tokens, eos_id: int) -> np.ndarray:
  """A decoded row's tokens before its first EOS (all of them without one: cut at
  max_decode_length). Example: [5, 6, 1, 0, 0], eos 1 -> [5, 6]."""
  tokens = np.asarray(tokens, np.int32)
  ends = np.flatnonzero(tokens == eos_id)
  return tokens[:ends[0]] if len(ends) else tokens


params_digest = teacher_lib.fingerprint


# --- checks: all before the teacher's weights are read ---------------------------------------

def _source(name: str, source_task: str, splits: tuple[str, ...]) -> Task:
  """The source task, checked, once `name` is known to be free (add_task would only find a
  clash after the whole decode)."""
  validate_name(name, "task")
  if name in TaskRegistry.names() or name in MixtureRegistry.names():
    raise ConfigError(f"{name!r} is already registered; names of tasks and mixtures are unique "
                      "(remove it first to redefine it)")
  try:
    source = TaskRegistry.get(source_task)
  except ConfigKeyError as e:
    raise ConfigKeyError(f"sequence distillation {name!r}: source {e}; import the module that "
                         "registers it first") from None
  if source.head:
    raise ConfigError(f"source task {source_task!r} is a {source.head!r} head task: its "
                      "examples carry labels, not target sequences a teacher could decode")
  missing = [k for k in ("inputs", "targets") if k not in source.output_features]
  if missing:
    raise ConfigError(f"source task {source_task!r} has no {' or '.join(missing)} feature: "
                      "the teacher decodes `inputs` into new `targets` (a causal LM task has "
                      "no inputs; use a text-to-text or prefix LM task)")
  if not splits or any(source.splits is not None and s not in source.splits for s in splits):
    raise ConfigError(f"splits {list(splits)}: source task {source_task!r} has the splits "
                      f"{list(source.splits or ())}")
  return source


def _teacher(teacher: str | os.PathLike):
  """(config, load: () -> (config, params), its saved vocabulary or None, absolute path) of an
  HF directory or a t5lite MODEL_DIR: the config first, to be checked before the weights."""
  from t5lite.interop.hf import checkpoints as hf  # pylint: disable=import-outside-toplevel
  from t5lite.interop import limits
  from t5lite.runtime import model_dir  # pylint: disable=import-outside-toplevel
  where = teacher_lib.locate(teacher)
  path, home = where.path, where.home
  if where.hf:
    config = hf.config_from_hf(limits.read_json(os.path.join(path, "config.json")))
    load = lambda: hf.load_hf(path)  # noqa: E731
  else:
    config = model_dir.load_model_config(home)
    load = lambda: model_dir.load_params(path)[:2]  # noqa: E731
  try:
    vocabulary = load_vocabulary(home)
  except ConfigFileNotFoundError:  # an HF directory without a tokenizer: nothing to compare
    vocabulary = None
  return config, load, vocabulary, path


def _check_teacher(config, saved_vocabulary, where: str, source: Task):
  """The teacher's family, once it is known to decode the source's inputs into its ids."""
  from t5lite.families import family_of  # pylint: disable=import-outside-toplevel
  family = family_of(config)
  if (not family.decodes or config.head
      or not (config.has_encoder and config.has_decoder or family.continues_prompts)):
    what = f"a {family.name!r} model" + (f" with the {config.head!r} head" if config.head else "")
    raise ConfigError(f"teacher {where} is {what}: it has no decoder to generate targets from "
                      "inputs; sequence distillation needs an encoder-decoder (T5) or a "
                      "decoder-only teacher")
  for feature in ("inputs", "targets"):
    vocabulary = source.output_features[feature].vocabulary
    if config.vocab_size < vocabulary.vocab_size:
      raise ConfigError(
          f"teacher {where} has vocab_size {config.vocab_size}, but the {feature} vocabulary "
          f"of task {source.name!r} ({vocabulary!r}) has {vocabulary.vocab_size} ids: use a "
          "teacher trained with the task's vocabulary, or a source task with the teacher's")
    if saved_vocabulary is not None and not vocabulary == saved_vocabulary:  # the task's first
      raise ConfigError(
          f"teacher {where} was trained with another vocabulary ({saved_vocabulary!r}) than "
          f"the {feature} of task {source.name!r} ({vocabulary!r}): its ids mean other text; "
          "use a teacher trained with the task's vocabulary, or a source task with the "
          "teacher's")
  eos = source.output_features["targets"].vocabulary.eos_id
  if eos is not None and eos != config.eos_id:
    raise ConfigError(f"teacher {where} stops decoding at ModelConfig.eos_id={config.eos_id}, "
                      f"but task {source.name!r}'s EOS is id {eos}: set the teacher's eos_id")
  return family


# --- the cache --------------------------------------------------------------------------------

def _finished(entry: str, split: str, key: dict) -> dict | None:
  """The manifest of a complete cached split made with `key`, else None."""
  try:
    with open(os.path.join(entry, split + ".json"), encoding="utf-8") as f:
      manifest = json.load(f)
  except (FileNotFoundError, ValueError):
    return None
  same = all(manifest.get(k) == v for k, v in key.items()) and manifest.get("split") == split
  return manifest if same and os.path.isfile(os.path.join(entry, split + ".array_record")) else None


def _record(ex, inputs: np.ndarray, targets: np.ndarray, vocabulary, dropped: set) -> bytes:
  """msgpack of the source example with the cut inputs and the teacher's targets (its text as
  targets_pretokenized); fields msgpack cannot store are dropped and added to `dropped`."""
  out = {k: v for k, v in ex.items() if k not in ("inputs", "targets", "targets_pretokenized")}
  out.update(inputs=inputs, targets=targets,
             targets_pretokenized=vocabulary.decode(targets.tolist()))
  for k in list(out):
    try:
      serialization.msgpack_serialize({k: out[k]})
    except (TypeError, ValueError):
      dropped.add(k)
      del out[k]
  return serialization.msgpack_serialize(out)


def _decode_split(source: Task, split: str, key: dict, family, params, entry: str,
                  batch_size: int, where: str) -> dict:
  """Decodes one split into the entry (records, then manifest); returns the manifest."""
  lengths, decoding = key["task_feature_lengths"], dict(key["decoding"])
  max_length = decoding.pop("max_decode_length")
  # The evaluator's reading of a split (TaskEvaluator): every example once, in order.
  examples = iter(task_row_dataset(source, 0, PipelineConfig(
      global_batch_size=1, task_feature_lengths=lengths, split=split, shuffle=False,
      num_epochs=1)))
  vocabulary = source.output_features["targets"].vocabulary
  os.makedirs(entry, exist_ok=True)
  atomic.remove_stale(entry)
  count = truncated = 0
  dropped: set[str] = set()
  # A temporary name of this process alone: a concurrent writer never shares it.
  with atomic.writing(os.path.join(entry, split + ".array_record")) as tmp:
    writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
    while chunk := list(itertools.islice(examples, batch_size)):
      inputs = [np.asarray(ex["inputs"], np.int32)[:lengths["inputs"]] for ex in chunk]
      # Always batch_size rows of the full length: one compiled program for the whole split.
      batch = np.zeros((batch_size, lengths["inputs"]), np.int32)
      for i, row in enumerate(inputs):
        batch[i, :len(row)] = row
      decoded = family.generate(params, batch, max_decode_length=max_length, **decoding)
      for ex, row, out in zip(chunk, inputs, np.asarray(decoded)):
        targets = strip_eos(out, family.config.eos_id)
        truncated += len(targets) == len(out)
        writer.write(_record(ex, row, targets, vocabulary, dropped))
        count += 1
    writer.close()
  manifest = {**key, "split": split, "examples": count, "truncated": truncated,
              "dropped_fields": sorted(dropped), "teacher_path": where}
  atomic.write_file(os.path.join(entry, split + ".json"), json.dumps(manifest, indent=1))
  return manifest
