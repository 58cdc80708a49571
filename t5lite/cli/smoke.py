"""`t5lite smoke`: a few real training steps of a gin-configured model on embedded text.

A quick check of any model file, without a task or a run config: it builds the model from
gin and trains it with t5lite's trainer (the very code path of `t5lite train`: family,
converter, sharded state, jitted step, checkpoint) into a temporary MODEL_DIR, on real English
text that every Python install ships (standard library docstrings and reference topics) as
UTF-8 bytes (ByT5 layout: pad 0, eos 1, unk 2, byte b -> b + 3, then 100 extra ids), with the
model family's own pretraining objective (span corruption for T5, next-token prediction for a
decoder, MLM for an encoder: Family.pretraining_preprocessors). It fails unless the loss falls.
"""
from __future__ import annotations

import tempfile
from typing import Callable

from t5lite.data import preprocessors as pp
from t5lite.data.registry import Feature, TaskRegistry, add_task
from t5lite.data.sources.readers import FunctionSource
from t5lite.data.sources.stdlib_corpus import stdlib_documents
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError
from t5lite.families import family_of
from t5lite.models.config import ModelConfig
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.trainer import TrainConfig, train

VOCABULARY = ByteVocabulary(extra_ids=100)  # 359 ids: the sentinels span corruption needs


def smoke_task(config: ModelConfig) -> str:
  """Registers (once) the embedded-text task with this config's family objective; its name."""
  family = family_of(config)
  name = f"t5lite_smoke_{family.name}" + ("_prefix" if config.prefix_lm else "")
  if name not in TaskRegistry.names():
    features = {"inputs": Feature(VOCABULARY), "targets": Feature(VOCABULARY)}
    add_task(name, {"train": FunctionSource(stdlib_documents)}, features,
             [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize,
              *family.pretraining_preprocessors(VOCABULARY)])
  return name


def run(config: ModelConfig, *, steps: int = 30, batch_size: int = 8, length: int = 64,
        learning_rate: float = 3e-3, seed: int = 0,
        log: Callable[[str], None] = print) -> list[float]:
  """Takes `steps` AdamW steps with the trainer; returns the loss of every step."""
  if config.vocab_size < VOCABULARY.vocab_size:
    raise ConfigError(f"smoke feeds bytes and 100 sentinels: ModelConfig.vocab_size must be >= "
                      f"{VOCABULARY.vocab_size}, got {config.vocab_size}")
  task = smoke_task(config)
  log(f"smoke: {family_of(config).name} model, batch {batch_size} x {length}, {steps} steps "
      f"on the embedded text (task {task})")
  with tempfile.TemporaryDirectory(prefix="t5lite_smoke_") as model_dir:
    result = train(config, TrainConfig(
        model_dir=model_dir, train_steps=steps, batch_size=batch_size,
        mixture_or_task_name=task, task_feature_lengths={"inputs": length, "targets": length},
        seed=seed, log_period=1, eval_period=0,
        optimizer=OptimizerConfig(name="adamw", schedule=ScheduleConfig(
            name="constant", value=learning_rate, warmup_steps=0)),
        checkpoint=CheckpointConfig(period=steps, keep=1, async_save=False)), log=log)
  return [result.losses[step] for step in sorted(result.losses)]
