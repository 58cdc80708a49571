"""The training loop in-process: exact resume, meshes, restore elsewhere, init from checkpoints.

Subprocess behaviour (SIGKILL, SIGTERM, the CLI and its gin run files) is in test_train_cli.py.
"""
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

import train_tasks  # noqa: F401 (registers train_test_sc, train_test_copy)
from helpers import (assert_trees_equal, checkpoint_params, logged_losses, quiet, tiny,
                     train_config)
from t5lite.cli import gin_config
from t5lite.interop.hf.checkpoints import save_hf
from t5lite.models import init_params
from t5lite.runtime import checkpoint_reader
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.runtime.partitioning import MeshConfig, make_mesh
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train import initial_params as initial_params_lib
from t5lite.train.trainer import TrainConfig, Trainer, train

# Dropout on: its rng must survive a restart. One layer a stack: still every kind of layer
# (self-attention, cross-attention, MLP) to shard and restore, at half the compiling.
MODEL = tiny(vocab_size=384, dropout_rate=0.1, num_encoder_layers=1, num_decoder_layers=1)
LENGTHS = {"inputs": 64, "targets": 16}


def config(model_dir, **changes) -> TrainConfig:
  base = dict(train_steps=6, mixture_or_task_name="train_test_sc", task_feature_lengths=LENGTHS,
              log_period=1, checkpoint=CheckpointConfig(period=3, async_save=True),
              optimizer=OptimizerConfig(schedule=ScheduleConfig(warmup_steps=10, value=0.3)))
  return train_config(model_dir, **{**base, **changes})


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
  """(MODEL_DIR, result) of config()'s run stopped at step 3 (its checkpoint there), on the
  default mesh (data parallel over all 8 devices). Every train() call costs seconds of tracing,
  loading the compiled step and a first checkpoint save, so the tests that start from such a
  run share this one: they read it, or copy it before training on."""
  model_dir = tmp_path_factory.mktemp("three_steps") / "run"
  return model_dir, train(MODEL, config(model_dir, train_steps=3), log=quiet)


def copy_run(three_steps, target):
  shutil.copytree(three_steps[0], target)
  return target


@pytest.mark.e2e
@pytest.mark.slow
def test_stop_and_resume_equals_one_run_bitwise(tmp_path, three_steps):
  one = train(MODEL, config(tmp_path / "one"), log=quiet)
  half = three_steps[1]  # the same config stopped at step 3
  copy_run(three_steps, tmp_path / "two")
  # Raising TRAIN_STEPS and rerunning into the same MODEL_DIR continues the finished run.
  rest = train(MODEL, config(tmp_path / "two"), log=quiet)
  assert sorted(half.losses) == [1, 2, 3]
  assert sorted(one.losses) == list(range(1, 7))
  assert {**half.losses, **rest.losses} == one.losses  # bitwise: float equality
  assert logged_losses(tmp_path / "two") == logged_losses(tmp_path / "one") == one.losses
  assert one.losses[6] < one.losses[1]
  _, params_one, step_one = checkpoint_params(tmp_path / "one")
  _, params_two, step_two = checkpoint_params(tmp_path / "two")
  assert step_one == step_two == 6
  assert_trees_equal(params_one, params_two)
  # A finished run rerun as it was does nothing.
  messages = []
  again = train(MODEL, config(tmp_path / "two"), log=messages.append)
  assert again.step == 6 and not again.losses and "nothing to do" in messages[-1]


def test_model_dir_is_self_describing(tmp_path):
  train(MODEL, config(tmp_path, train_steps=2, eval_period=2, eval_steps=2), log=quiet)
  from t5lite.data.vocab.vocabularies import load_vocabulary
  from t5lite.runtime.model_dir import load_model_config
  assert load_model_config(tmp_path) == MODEL
  assert load_vocabulary(tmp_path) == train_tasks.VOCAB
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  train_records = [r for r in records if "loss" in r]
  assert [r["step"] for r in train_records] == [1, 2]
  assert {"learning_rate", "accuracy", "grad_norm", "tokens_per_s"} <= set(train_records[0])
  evals = [r for r in records if "eval/train_test_sc/loss" in r]
  assert len(evals) == 1 and evals[0]["step"] == 2
  assert 0 < evals[0]["eval/train_test_sc/loss"] < 10
  assert os.listdir(tmp_path / "tensorboard")
  # Another model config cannot continue this run.
  with pytest.raises(ValueError, match=r"another model config \(d_model: 32 -> 64\)"):
    train(MODEL.replace(d_model=64), config(tmp_path, train_steps=3), log=quiet)


# Data parallel; all three axes at once (batch over data x fsdp, tensor split); FSDP below.
# (2, 4, 1) and (1, 8, 1) without FSDP rules add nothing these do not cover, and cost ~22 s
# of the CI budget.
MESHES = [(8, 1, 1), (2, 2, 2)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """3 steps on a single device: the trajectory every mesh must reproduce."""
  return train(MODEL.replace(dropout_rate=0.0), config(tmp_path_factory.mktemp("one"),
                                                       train_steps=3),
               mesh=make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), log=quiet)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("sizes,fsdp", [(s, False) for s in MESHES] + [((1, 8, 1), True)])
def test_meshes_give_the_one_device_trajectory(tmp_path, one_device, sizes, fsdp):
  model, reference = MODEL.replace(dropout_rate=0.0), one_device
  data, fsdp_size, tensor = sizes
  sharded_config = config(tmp_path / "mesh", train_steps=3, fsdp=fsdp,
                          mesh=MeshConfig(data=data, fsdp=fsdp_size, tensor=tensor))
  sharded = train(model, sharded_config, log=quiet)
  np.testing.assert_allclose([sharded.losses[s] for s in (1, 2, 3)],
                             [reference.losses[s] for s in (1, 2, 3)], rtol=2e-5)
  params, _ = checkpoint_reader.restore_params(tmp_path / "mesh", Trainer(model, sharded_config)
                                      .abstract_params)
  kernel = params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]  # (embed, mlp)
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp" if fsdp else None, "tensor")
  assert kernel.addressable_shards[0].data.shape == (32 // (fsdp_size if fsdp else 1),
                                                     64 // tensor)


@pytest.mark.e2e
@pytest.mark.slow
def test_restore_onto_another_mesh_keeps_params_and_data(tmp_path, three_steps):
  # Saved from the data-parallel mesh (8, 1, 1).
  model_dir = copy_run(three_steps, tmp_path / "run")
  _, saved, _ = checkpoint_params(model_dir)
  other = Trainer(MODEL, config(model_dir, mesh=MeshConfig(data=2, fsdp=2, tensor=2), fsdp=True))
  checkpointer = ckpt_lib.Checkpointer(model_dir, read_only=True)
  state, data_state, step = checkpointer.restore_latest(other.abstract_state)
  checkpointer.close()
  assert step == 3 and int(state.step) == 3 and len(data_state["rows"]) == 8
  assert_trees_equal(jax.device_get(state.params), saved)
  wo = state.params["decoder"]["layers_0"]["mlp"]["wo"]["kernel"]  # (mlp, embed)
  assert wo.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  # ... and training goes on there.
  result = train(MODEL, config(model_dir, train_steps=4, mesh=MeshConfig(2, 2, 2), fsdp=True),
                 log=quiet)
  assert list(result.losses) == [4]


@pytest.mark.e2e
@pytest.mark.slow
def test_finetune_from_checkpoint_takes_params_only_and_continues_the_count(tmp_path,
                                                                          three_steps):
  pre = three_steps[0]  # only read: INITIAL_CHECKPOINT_PATH
  _, pretrained, _ = checkpoint_params(pre)
  finetune = config(tmp_path / "ft", train_steps=5, mixture_or_task_name="train_test_copy",
                    initial_checkpoint_path=str(pre),
                    optimizer=OptimizerConfig(name="adamw"))
  trainer = Trainer(MODEL, finetune)
  params, step = trainer.initial_params(finetune.initial_checkpoint_path)
  assert step == 3
  assert_trees_equal(jax.device_get(params), pretrained)
  state = trainer.state_from_params(params, step)
  mu = state.opt_state[1][0].mu  # (clip, adamw=(scale_by_adam, ...)): fresh moments
  assert all(not np.any(np.asarray(x)) for x in jax.tree_util.tree_leaves(mu))
  messages = []
  result = train(MODEL, finetune, log=messages.append)
  assert sorted(result.losses) == [4, 5]
  assert any("2 steps to go" in m for m in messages)
  with pytest.raises(ValueError, match="TRAIN_STEPS to 3 \\+ the number of finetuning steps"):
    train(MODEL, config(tmp_path / "ft2", train_steps=3, initial_checkpoint_path=str(pre)),
          log=quiet)


@pytest.mark.e2e
@pytest.mark.slow
def test_mismatched_checkpoint_names_the_parameters(tmp_path, three_steps):
  bigger = MODEL.replace(vocab_size=512)
  with pytest.raises(ValueError, match=r"token_embedder.*checkpoint \(384, 32\), model "
                     r"\(512, 32\)"):
    # TRAIN_STEPS past the checkpoint's step 3: the shapes are what refuses the run.
    train(bigger, config(tmp_path / "ft", train_steps=5,
                         initial_checkpoint_path=str(three_steps[0])), log=quiet)


def test_init_from_an_hf_checkpoint(tmp_path):
  model = MODEL.replace(dropout_rate=0.0)
  params = jax.device_get(init_params(model, 7))
  save_hf(model, params, str(tmp_path / "hf"))
  trainer = Trainer(model, config(tmp_path / "run", initial_checkpoint_path=str(tmp_path / "hf")))
  loaded, step = trainer.initial_params(str(tmp_path / "hf"))
  assert step == 0
  assert_trees_equal(jax.device_get(loaded), params)
  with pytest.raises(ValueError, match="vocab_size: checkpoint 384, model 512"):
    Trainer(model.replace(vocab_size=512), config(tmp_path)).initial_params(
        str(tmp_path / "hf"))


def test_an_hf_encoder_loads_whatever_the_unused_decoder_depth(tmp_path):
  """An encoder-only model's decoder depth is unused: not compared with the HF config's (an
  HF encoder has none, and reads back as the default)."""
  gin_config.parse(["gin/models/bert/tiny.gin"])
  model = gin_config.model_config().replace(num_encoder_layers=1, num_decoder_layers=3)
  params = jax.device_get(init_params(model, 3))
  save_hf(model, params, str(tmp_path / "hf"))
  loaded, vocab_size = initial_params_lib.hf_params(str(tmp_path / "hf"), model, None)
  assert vocab_size == model.vocab_size
  assert_trees_equal(loaded, params)
  with pytest.raises(ValueError, match="num_encoder_layers: checkpoint 1, model 2"):
    initial_params_lib.hf_params(str(tmp_path / "hf"), model.replace(num_encoder_layers=2), None)


def test_vocabulary_larger_than_the_model_is_refused(tmp_path):
  with pytest.raises(ValueError, match="set ModelConfig.vocab_size >= 359"):
    train(MODEL.replace(vocab_size=256), config(tmp_path), log=quiet)


@pytest.mark.e2e
@pytest.mark.slow
def test_checkpoint_keep_policy_and_corrupt_fallback(tmp_path):
  train(MODEL, config(tmp_path, train_steps=8, log_period=4,
                      checkpoint=CheckpointConfig(period=1, keep=2, keep_period=4)), log=quiet)
  checkpointer = ckpt_lib.Checkpointer(tmp_path, read_only=True)
  assert checkpointer.all_steps() == [4, 7, 8]  # the newest 2, and every 4th
  trainer = Trainer(MODEL, config(tmp_path))
  # Corrupt step 8: every file of its state item truncated to nothing.
  for root, _, files in os.walk(tmp_path / "checkpoints" / "8" / "state"):
    for name in files:
      open(os.path.join(root, name), "w").close()
  state, _, step = checkpointer.restore_latest(trainer.abstract_state)
  assert step == 7 and int(state.step) == 7
  strict = ckpt_lib.Checkpointer(tmp_path, dataclasses.replace(CheckpointConfig(),
                                                               on_corrupt="stop"), read_only=True)
  with pytest.raises(ckpt_lib.CorruptCheckpointError, match="checkpoint step 8: state/.* has 0 "
                     "bytes"):
    strict.restore_latest(trainer.abstract_state)
  assert strict.all_steps() == [4, 7, 8]  # nothing deleted
