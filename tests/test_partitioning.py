"""Partitioning on 8 fake CPU devices: meshes, rules, sharded init, optimizer-state and batch
shardings, and sharded forward passes that match the single-device one."""
from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from conftest import jitted_apply, tiny
from t5lite.models import abstract_params, init_params, make_model
from t5lite.train.partitioning import (MeshConfig, activate, batch_sharding, global_batch,
                                       init_sharded, logical_axis_rules, make_mesh,
                                       param_shardings, state_shardings)

# Every sharded dimension divides: 4 heads, mlp 64, vocab 128, d_model 32 over up to 8 devices.
CONFIG = tiny(num_heads=4, d_ff=64, vocab_size=128)
MESHES = [(8, 1, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2)]


def mesh_of(sizes) -> jax.sharding.Mesh:
  return make_mesh(MeshConfig(*sizes))


def spec(tree, path: str) -> P:
  """The sharding spec of the leaf at 'a/b/c' in a tree of arrays or shardings."""
  for key in path.split("/"):
    tree = tree[key]
  return getattr(tree, "sharding", tree).spec


# --- meshes

@pytest.mark.parametrize("sizes", MESHES)
def test_make_mesh_has_the_sizes_and_auto_axes(sizes):
  mesh = mesh_of(sizes)
  assert tuple(mesh.shape.values()) == sizes
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert mesh.axis_types == (AxisType.Auto,) * 3
  assert mesh.devices.size == 8


@pytest.mark.parametrize("config, sizes", [
    (MeshConfig(), (8, 1, 1)),
    (MeshConfig(data=2, fsdp=-1), (2, 4, 1)),
    (MeshConfig(data=1, fsdp=-1), (1, 8, 1)),
    (MeshConfig(data=-1, fsdp=2, tensor=2), (2, 2, 2)),
])
def test_minus_one_takes_the_remaining_devices(config, sizes):
  assert config.resolve() == sizes
  assert tuple(make_mesh(config).shape.values()) == sizes


def test_bad_sizes_give_a_clear_error():
  message = "mesh (2, 2, 1) needs 4 devices, this host has 8"
  with pytest.raises(ValueError, match=re.escape(message)):
    make_mesh(MeshConfig(2, 2, 1))
  with pytest.raises(ValueError, match=re.escape("mesh (2, 4, 1) needs 8 devices, were given 4")):
    make_mesh(MeshConfig(2, 4, 1), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=re.escape("mesh (3, -1, 1) cannot fill")):
    MeshConfig(3, -1, 1).resolve()
  with pytest.raises(ValueError, match="more than one -1"):
    MeshConfig(-1, -1, 1)
  with pytest.raises(ValueError, match="'fsdp' has size 0"):
    MeshConfig(8, 0, 1)


def test_make_mesh_on_a_subset_of_devices():
  mesh = make_mesh(MeshConfig(data=-1, tensor=2), devices=jax.devices()[:4])
  assert tuple(mesh.shape.values()) == (2, 1, 2)


# --- rules and parameter shardings

def test_fsdp_rules_keep_activation_embed_whole():
  """batch claims 'fsdp' first, so activations' embed stays unsharded while params' embed
  (no batch axis) goes on 'fsdp' (the T5X 2-D parameter sharding scheme)."""
  rules = logical_axis_rules(fsdp=True)
  activation = nn.logical_to_mesh_axes(("batch", "length", "embed"), rules)
  assert activation == P(("data", "fsdp"), None, None)
  assert nn.logical_to_mesh_axes(("embed", "heads", "kv"), rules) == P("fsdp", "tensor", None)
  plain = nn.logical_to_mesh_axes(("embed", "heads", "kv"), logical_axis_rules())
  assert plain == P(None, "tensor", None)


@pytest.mark.parametrize("sizes", [(2, 2, 2), (2, 1, 4)])
def test_params_are_sharded_as_the_rules_say(sizes):
  mesh = mesh_of(sizes)
  params = init_sharded(CONFIG, mesh, logical_axis_rules(), rng=0)
  assert spec(params, "encoder/layers_0/attention/query/kernel") == P(None, "tensor", None)
  assert spec(params, "decoder/layers_1/self_attention/out/kernel") == P("tensor", None, None)
  assert spec(params, "token_embedder/embedding") == P("tensor", None)  # vocab -> tensor
  assert spec(params, "encoder/layers_0/mlp/wi_0/kernel") == P(None, "tensor")
  assert spec(params, "encoder/relpos_bias/rel_embedding") == P(None, "tensor")
  assert spec(params, "decoder/decoder_norm/scale") == P(None)
  query = params["encoder"]["layers_0"]["attention"]["query"]["kernel"]
  assert query.addressable_shards[0].data.shape == (32, 4 // sizes[2], 8)


def test_fsdp_puts_the_params_embed_axis_on_fsdp():
  mesh = mesh_of((2, 2, 2))
  params = init_sharded(CONFIG, mesh, logical_axis_rules(fsdp=True), rng=0)
  assert spec(params, "encoder/layers_0/attention/query/kernel") == P("fsdp", "tensor", None)
  assert spec(params, "token_embedder/embedding") == P("tensor", "fsdp")
  assert spec(params, "encoder/layers_0/mlp/wo/kernel") == P("tensor", "fsdp")
  assert spec(params, "encoder/encoder_norm/scale") == P("fsdp")
  embedding = params["token_embedder"]["embedding"]
  assert embedding.addressable_shards[0].data.shape == (64, 16)  # (128 / 2, 32 / 2)


def test_scanned_params_leave_layers_whole():
  config = CONFIG.replace(scan_layers=True)
  shardings = param_shardings(config, mesh_of((2, 2, 2)), logical_axis_rules(fsdp=True))
  assert spec(shardings, "encoder/layers/attention/query/kernel") == P(None, "fsdp", "tensor", None)
  assert spec(shardings, "decoder/layers/mlp/wo/kernel") == P(None, "tensor", "fsdp")


def test_init_sharded_gives_init_params_values():
  params = init_sharded(CONFIG, mesh_of((2, 2, 2)), logical_axis_rules(fsdp=True), rng=3)
  expected = init_params(CONFIG, 3)
  jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(params), expected)


def test_uneven_parameter_split_names_the_parameter():
  with pytest.raises(ValueError, match=r"query/kernel dim 1 \(heads, size 3\) over 'tensor'"):
    param_shardings(tiny(num_heads=3), mesh_of((2, 2, 2)), logical_axis_rules())


# --- optimizer state

def test_state_shardings_follow_the_params():
  mesh = mesh_of((2, 2, 2))
  shardings = param_shardings(CONFIG, mesh, logical_axis_rules(fsdp=True))
  shapes = abstract_params(CONFIG)
  sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  state = {
      "count": jax.ShapeDtypeStruct((), jnp.int32),
      "mu": shapes,  # Adam-like: one leaf shaped like each param
      # Adafactor-like: query kernel (embed 32, heads 4, kv 8) factored over embed and kv.
      "v_row": {"encoder": {"layers_0": {"attention": {"query": {"kernel": sds((32, 4))}}}}},
      "v_col": {"encoder": {"layers_0": {"attention": {"query": {"kernel": sds((4, 8))}}}}},
      "v": {"encoder": {"encoder_norm": {"scale": sds((1,))}}},  # placeholder of a factored param
      "other": sds((7, 3)),
  }
  query = "encoder/layers_0/attention/query/kernel"
  out = state_shardings(state, shardings, shapes)
  assert out["count"].spec == P()
  assert spec(out["mu"], query) == P("fsdp", "tensor", None)
  assert spec(out["mu"], "token_embedder/embedding") == P("tensor", "fsdp")
  assert spec(out["v_row"], query) == P("fsdp", "tensor")
  assert spec(out["v_col"], query) == P("tensor", None)
  assert spec(out["v"], "encoder/encoder_norm/scale") == P(None)  # 'fsdp' does not divide 1
  assert out["other"].spec == P()
  # Without param shapes a factored leaf keeps only what every reducible dimension agrees on.
  assert spec(state_shardings(state, shardings)["v_row"], query) == P(None, None)


def test_state_shardings_on_optax_adafactor():
  import optax  # a core dependency
  mesh = mesh_of((2, 2, 2))
  shardings = param_shardings(CONFIG, mesh, logical_axis_rules(fsdp=True))
  shapes = abstract_params(CONFIG)
  state = jax.eval_shape(optax.adafactor(1e-2, min_dim_size_to_factor=8).init, shapes)
  out = state_shardings(state, shardings, shapes)
  # Every sharding divides its leaf, so the whole state can be jitted with these out_shardings.
  for leaf, sharding in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(out)):
    assert sharding.shard_shape(leaf.shape) is not None
  wo = out[0].v_row["encoder"]["layers_0"]["mlp"]["wo"]["kernel"]  # (mlp 64, embed 32) -> (32,)
  assert wo.spec == P("fsdp")


# --- batches

def test_global_batch_shapes_and_sharding():
  mesh = mesh_of((2, 2, 2))
  host = {"encoder_input_tokens": np.arange(32).reshape(4, 8), "weights": np.ones(4, np.float32)}
  batch = global_batch(host, mesh)
  assert batch["encoder_input_tokens"].shape == (4, 8)
  assert batch["encoder_input_tokens"].sharding == batch_sharding(mesh)
  assert batch["weights"].sharding.spec == P(("data", "fsdp"))
  assert batch["encoder_input_tokens"].addressable_shards[0].data.shape == (1, 8)
  np.testing.assert_array_equal(np.asarray(batch["encoder_input_tokens"]),
                                host["encoder_input_tokens"])


def test_global_batch_errors():
  mesh = mesh_of((2, 4, 1))
  with pytest.raises(ValueError, match=r"'inputs' has 6 local rows, which do not divide over the "
                                       r"8 batch shards"):
    global_batch({"inputs": np.zeros((6, 4), np.int32)}, mesh)
  with pytest.raises(ValueError, match="scalar"):
    global_batch({"step": np.int32(3)}, mesh)
  # Tensor-parallel replicas share their rows: (2, 2, 2) has only 4 batch shards.
  batch = global_batch({"inputs": np.zeros((4, 4), np.int32)}, mesh_of((2, 2, 2)))
  assert batch["inputs"].shape == (4, 4)


# --- sharded forward pass

def _host_batch(rows: int = 8) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  encoder = rng.integers(1, CONFIG.vocab_size, (rows, 12)).astype(np.int32)
  encoder[:, 9:] = 0  # padding, masked by the default encoder segment ids
  decoder = rng.integers(1, CONFIG.vocab_size, (rows, 6)).astype(np.int32)
  decoder[:, 0] = 0
  return {"encoder_input_tokens": encoder, "decoder_input_tokens": decoder}


@pytest.mark.parametrize("sizes, fsdp", [((8, 1, 1), False), ((2, 4, 1), True),
                                         ((1, 8, 1), True), ((2, 2, 2), True)])
def test_sharded_forward_matches_single_device(sizes, fsdp):
  mesh, rules = mesh_of(sizes), logical_axis_rules(fsdp)
  params = init_sharded(CONFIG, mesh, rules, rng=0)
  host = _host_batch()
  expected = jitted_apply(CONFIG)(jax.device_get(params), host)
  model = make_model(CONFIG)
  with activate(mesh, rules):
    logits = jax.jit(lambda p, b: model.apply({"params": p}, **b))(params, global_batch(host, mesh))
  assert logits.addressable_shards[0].data.shape[0] == 8 // (sizes[0] * sizes[1])  # batch split
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5, rtol=1e-5)


def test_activations_are_constrained_to_the_mesh():
  """Under activate(), heads go on 'tensor', batch on ('data', 'fsdp'), and the residual
  stream's embed axis stays whole even with FSDP rules."""
  mesh, rules = mesh_of((2, 2, 2)), logical_axis_rules(fsdp=True)
  params = init_sharded(CONFIG, mesh, rules, rng=0)
  model = make_model(CONFIG)
  tokens = jnp.ones((4, 8), jnp.int32)
  with activate(mesh, rules):
    text = jax.jit(lambda p, e, d: model.apply({"params": p}, e, d)).lower(
        params, tokens, tokens).as_text()
  constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
  heads = [c for c in constraints if '[{"data", "fsdp"}, {}, {"tensor"}, {}]' in c]
  embed = [c for c in constraints
           if re.search(r'\[\{"data", "fsdp"\}, \{\}, \{\}\]> : tensor<4x8x32', c)]
  assert len(heads) >= 4 * 6  # q, k, v, out in 2 encoder + 2x2 decoder attentions
  assert len(embed) >= 2 + 4  # both embeddings and every layer's output
  assert not any(re.search(r'\{"fsdp"\}\]> : tensor<4x8x32', c) for c in constraints)
