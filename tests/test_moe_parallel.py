"""Expert parallelism on 8 fake CPU devices: a Switch model trained on a (data 2, expert 4)
mesh follows the one-device trajectory, its experts live split over the expert axis, and its
checkpoint restores onto other expert-axis sizes bitwise; a mesh whose expert axis does not
divide the experts is refused by name."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import train_tasks  # noqa: F401 (registers train_test_sc)
from helpers import assert_trees_equal, checkpoint_params, quiet, tiny, train_config
from t5lite.errors import ConfigError
from t5lite.models.moe.config import MoeConfig
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime.partitioning import (MeshConfig, logical_axis_rules, make_mesh,
                                         param_shardings)
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.train.trainer import Trainer, train

# Every layer sparse, 8 experts, capacity factor 1.0: tokens are dropped for real. One layer a
# stack: every program here is compiled from a cold cache, and a second sparse layer only
# repeats the first.
MODEL = tiny(vocab_size=384, num_encoder_layers=1, num_decoder_layers=1,
             moe=MoeConfig(num_experts=8, capacity_factor=1.0, encoder_sparse_step=1,
                           decoder_sparse_step=1))


def config(model_dir, **changes):
  return train_config(model_dir, mixture_or_task_name="train_test_sc", log_period=1,
                      checkpoint=CheckpointConfig(period=3), **changes)


@pytest.mark.e2e
@pytest.mark.slow
def test_expert_parallel_training_equals_one_device_and_restores_on_other_expert_axes(
    tmp_path):
  one = train(MODEL, config(tmp_path / "one"), log=quiet,
              mesh=make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))
  sharded = train(MODEL, config(tmp_path / "ep", mesh=MeshConfig(data=2, expert=4)), log=quiet)
  np.testing.assert_allclose([sharded.losses[s] for s in (1, 2, 3)],
                             [one.losses[s] for s in (1, 2, 3)], rtol=2e-5)
  _, saved, _ = checkpoint_params(tmp_path / "ep")
  for sizes in (dict(data=4, expert=2), dict(data=1, expert=8)):
    other = Trainer(MODEL, config(tmp_path / "ep", mesh=MeshConfig(**sizes)))
    checkpointer = ckpt_lib.Checkpointer(tmp_path / "ep", read_only=True)
    state, _, step = checkpointer.restore_latest(other.abstract_state)
    checkpointer.close()
    assert step == 3
    assert_trees_equal(jax.device_get(state.params), saved)
    wi = state.params["encoder"]["layers_0"]["mlp"]["wi_0"]  # (expert, embed, mlp)
    assert wi.sharding.spec == P("expert", None, "tensor")  # tensor: 1 device here
    assert wi.addressable_shards[0].data.shape[0] == 8 // sizes["expert"]


def test_the_dispatch_is_split_over_the_expert_axis():
  """The sharded step's program keeps the experts' kernels and their tokens on the expert
  axis: each device computes 8 / 4 experts; GSPMD moves the tokens with an all-to-all."""
  from t5lite.families import family_of
  mesh, rules = make_mesh(MeshConfig(data=2, expert=4)), logical_axis_rules()
  family = family_of(MODEL)
  shardings = param_shardings(MODEL, mesh, rules)
  wo = shardings["decoder"]["layers_0"]["mlp"]["wo"]
  assert wo.spec == P("expert", "tensor", None)  # (expert, mlp, embed); tensor: 1 device
  params = jax.jit(family.init_params, out_shardings=shardings)(jax.random.key(0))
  batch = {"encoder_input_tokens": np.ones((8, 16), np.int32),
           "decoder_input_tokens": np.ones((8, 4), np.int32),
           "decoder_target_tokens": np.ones((8, 4), np.int32)}
  from t5lite.runtime.partitioning import activate, global_batch
  with activate(mesh, rules):
    hlo = jax.jit(lambda p, b: family.loss_fn(p, b, None)[0]).lower(
        params, global_batch(batch, mesh)).compile().as_text()
  assert "all-to-all" in hlo


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
  mesh = make_mesh(MeshConfig(data=-1, expert=8))
  with pytest.raises(ConfigError, match=r"num_experts=4 does not divide over the mesh's expert "
                                        r"axis of 8 devices \(MeshConfig.expert=8\)"):
    param_shardings(MODEL.replace(moe=MoeConfig(num_experts=4)), mesh, logical_axis_rules())
