"""Partitioning on 8 fake CPU devices: meshes, rules, sharded init, optimizer-state and batch
shardings, and sharded forward passes that match the single-device one."""
from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import t5lite
from helpers import assert_trees_equal, jitted_apply, tiny
from t5lite.models import ModelConfig
from t5lite.models import abstract_params, init_params, make_model, param_logical_axes
from t5lite.runtime.partitioning import (MeshConfig, activate, batch_sharding, global_batch,
                                         logical_axis_rules, make_mesh, param_shardings,
                                         state_shardings)
from t5lite.train.optimizers import OptimizerConfig, make_optimizer
from t5lite.train.schedules import ScheduleConfig

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


def init_sharded(config, mesh, rules, rng: int = 0):
  """Params created in their shards: init_params under jit with out_shardings."""
  init = jax.jit(functools.partial(init_params, config),
                 out_shardings=param_shardings(config, mesh, rules))
  return init(jax.random.key(rng))


def placed(config, mesh, rules, rng: int = 0):
  """init_params' values put in their shards: the same arrays as init_sharded's
  (test_init_sharded_gives_init_params_values) without compiling an init per mesh."""
  return jax.device_put(jax.device_get(init_params(config, rng)),
                        param_shardings(config, mesh, rules))


# --- meshes

@pytest.mark.parametrize("sizes", MESHES)
def test_make_mesh_has_the_sizes_and_auto_axes(sizes):
  mesh = mesh_of(sizes)  # sizes: (data, fsdp, tensor); the expert axis 1
  assert tuple(mesh.shape.values()) == (sizes[0], sizes[1], 1, sizes[2])
  assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
  assert mesh.axis_types == (AxisType.Auto,) * 4
  assert mesh.devices.size == 8


@pytest.mark.parametrize("config, sizes", [
    (MeshConfig(), (8, 1, 1, 1)),  # (data, fsdp, expert, tensor)
    (MeshConfig(data=2, fsdp=-1), (2, 4, 1, 1)),
    (MeshConfig(data=1, fsdp=-1), (1, 8, 1, 1)),
    (MeshConfig(data=-1, fsdp=2, tensor=2), (2, 2, 1, 2)),
    (MeshConfig(data=-1, expert=4), (2, 1, 4, 1)),
])
def test_minus_one_takes_the_remaining_devices(config, sizes):
  assert config.resolve() == sizes
  assert tuple(make_mesh(config).shape.values()) == sizes


def test_bad_sizes_give_a_clear_error():
  message = "mesh (2, 2, 1, 1) needs 4 devices, this host has 8"
  with pytest.raises(ValueError, match=re.escape(message)):
    make_mesh(MeshConfig(2, 2, 1))
  with pytest.raises(ValueError,
                     match=re.escape("mesh (2, 4, 1, 1) needs 8 devices, were given 4")):
    make_mesh(MeshConfig(2, 4, 1), devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=re.escape("mesh (3, -1, 1, 1) cannot fill")):
    MeshConfig(3, -1, 1).resolve()
  with pytest.raises(ValueError, match="more than one -1"):
    MeshConfig(-1, -1, 1)
  with pytest.raises(ValueError, match="'fsdp' has size 0"):
    MeshConfig(8, 0, 1)


def test_make_mesh_on_a_subset_of_devices():
  mesh = make_mesh(MeshConfig(data=-1, tensor=2), devices=jax.devices()[:4])
  assert tuple(mesh.shape.values()) == (2, 1, 1, 2)


# --- rules and parameter shardings

def test_fsdp_rules_keep_activation_embed_whole():
  """batch claims 'fsdp' first, so activations' embed stays unsharded while params' embed
  (no batch axis) goes on 'fsdp' (the T5X 2-D parameter sharding scheme)."""
  rules = logical_axis_rules(fsdp=True)
  activation = nn.logical_to_mesh_axes(("batch", "length", "embed"), rules)
  assert activation == P(("data", "fsdp", "expert"), None, None)
  assert nn.logical_to_mesh_axes(("embed", "heads", "kv"), rules) == P("fsdp", "tensor", None)
  plain = nn.logical_to_mesh_axes(("embed", "heads", "kv"), logical_axis_rules())
  assert plain == P(None, "tensor", None)


@pytest.mark.parametrize("sizes", [(2, 2, 2), (2, 1, 4)])
def test_params_are_sharded_as_the_rules_say(sizes):
  mesh = mesh_of(sizes)
  params = placed(CONFIG, mesh, logical_axis_rules(), rng=0)
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
  assert_trees_equal(params, expected)


def test_uneven_parameter_split_names_the_parameter():
  with pytest.raises(ValueError, match=r"query/kernel dim 1 \(heads, size 3\) over 'tensor'"):
    param_shardings(tiny(num_heads=3), mesh_of((2, 2, 2)), logical_axis_rules())


# --- optimizer state

def _sharded_optimizer(config, opt: OptimizerConfig, sizes=(2, 2, 2)):
  """(optimizer, abstract params, param shardings, state shardings) on an FSDP + tensor mesh."""
  mesh, rules = mesh_of(sizes), logical_axis_rules(fsdp=True)
  tx = make_optimizer(opt, param_logical_axes(config))
  params = abstract_params(config)
  state = jax.eval_shape(tx.init, params)
  return (tx, params, param_shardings(config, mesh, rules),
          state_shardings(state, tx.state_axes(params), mesh, rules))


@pytest.mark.parametrize("scan", [False, True])
def test_adafactor_state_is_sharded_as_declared_and_updates(scan):
  config = CONFIG.replace(scan_layers=scan)
  opt = OptimizerConfig(schedule=ScheduleConfig("constant", 0.01, 0), min_dim_size_to_factor=8,
                        momentum=0.9, global_norm_clip=1.0)
  tx, params, p_shardings, s_shardings = _sharded_optimizer(config, opt)
  core = s_shardings[1]
  layer = "encoder/layers" if scan else "encoder/layers_0"
  lead = (None,) if scan else ()  # the 'layers' axis of a stack stays whole
  query, wo = f"{layer}/attention/query/kernel", f"{layer}/mlp/wo/kernel"
  norm = f"{layer}/pre_mlp_layer_norm/scale"
  # query (embed, heads, kv) factors into embed rows and (heads, kv) columns.
  assert spec(core.v_row, query) == P(*lead, "fsdp")
  assert spec(core.v_col, query) == P(*lead, "tensor", None)
  # wo (mlp, embed), rank 2: T5X's heuristic takes the first dim as the rows.
  assert spec(core.v_row, wo) == P(*lead, "tensor")
  assert spec(core.v_col, wo) == P(*lead, "fsdp")
  assert spec(core.v, query) == P() and spec(core.v_row, norm) == P()  # placeholders
  assert spec(core.v, norm) == P(*lead, "fsdp")  # a full second moment: the param's layout
  assert spec(core.m, query) == spec(p_shardings, query)
  assert core.count.spec == P()

  # The state is born in these shardings and a jitted update keeps it there.
  ones = jax.jit(lambda: jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params),
                 out_shardings=p_shardings)()
  state = jax.jit(tx.init, out_shardings=s_shardings)(ones)
  update = jax.jit(tx.update, out_shardings=(p_shardings, s_shardings))
  updates, state = update(jax.tree.map(lambda x: 0.1 * x, ones), state, ones)
  assert spec(state[1].v_col, query) == P(*lead, "tensor", None)
  assert spec(updates, query) == spec(p_shardings, query)
  assert int(state[1].count) == 1
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


def test_square_kernel_statistics_keep_their_sharding():
  """A 32 x 32 wi / wo: the shapes cannot tell which dim was reduced, the declaration can."""
  config = CONFIG.replace(d_ff=32)
  _, _, _, s_shardings = _sharded_optimizer(config, OptimizerConfig(min_dim_size_to_factor=8))
  core = s_shardings[1]
  wi, wo = "decoder/layers_1/mlp/wi_0/kernel", "decoder/layers_1/mlp/wo/kernel"  # (embed, mlp)
  assert spec(core.v_row, wi) == P("fsdp") and spec(core.v_col, wi) == P("tensor")
  assert spec(core.v_row, wo) == P("tensor") and spec(core.v_col, wo) == P("fsdp")  # (mlp, embed)


def test_adamw_moments_are_sharded_like_the_params():
  _, _, p_shardings, s_shardings = _sharded_optimizer(CONFIG, OptimizerConfig("adamw"))
  adam = s_shardings[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...)
  assert adam.count.spec == P()
  param_specs = [s.spec for s in jax.tree.leaves(p_shardings)]
  assert [s.spec for s in jax.tree.leaves(adam.mu)] == param_specs
  assert [s.spec for s in jax.tree.leaves(adam.nu)] == param_specs


def test_state_shardings_drop_splits_that_do_not_divide_and_check_the_declaration():
  mesh, rules = mesh_of((2, 2, 2)), logical_axis_rules(fsdp=True)
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  state = {"count": sds(), "v": sds(3, 32), "w": sds(4, 1)}
  axes = {"count": P(), "v": P("heads", "embed"), "w": P("heads", "embed")}
  out = state_shardings(state, axes, mesh, rules)
  assert out["count"].spec == P() and out["w"].spec == P("tensor", None)
  assert out["v"].spec == P(None, "fsdp")  # 3 rows do not split over tensor=2
  with pytest.raises(ValueError, match="not shaped like the optimizer state"):
    state_shardings(state, {"count": P(), "v": P()}, mesh, rules)
  with pytest.raises(ValueError, match=r"optimizer state v of shape \(3, 32\)"):
    state_shardings(state, {**axes, "v": P("heads", "embed", "kv")}, mesh, rules)


# --- batches

def test_global_batch_shapes_and_sharding():
  mesh = mesh_of((2, 2, 2))
  host = {"encoder_input_tokens": np.arange(32).reshape(4, 8), "weights": np.ones(4, np.float32)}
  batch = global_batch(host, mesh)
  assert batch["encoder_input_tokens"].shape == (4, 8)
  assert batch["encoder_input_tokens"].sharding == batch_sharding(mesh)
  assert batch["weights"].sharding.spec == P(("data", "fsdp", "expert"))
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
  params = placed(CONFIG, mesh, rules, rng=0)
  host = _host_batch()
  expected = jitted_apply(CONFIG)(jax.device_get(params), host)
  model = make_model(CONFIG)
  with activate(mesh, rules):
    logits = jax.jit(lambda p, b: model.apply({"params": p}, **b))(params, global_batch(host, mesh))
  assert logits.addressable_shards[0].data.shape[0] == 8 // (sizes[0] * sizes[1])  # batch split
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5, rtol=1e-5)


def test_activations_are_constrained_to_the_mesh():
  """Under activate(), heads go on 'tensor', batch on ('data', 'fsdp', 'expert'), and the residual
  stream's embed axis stays whole even with FSDP rules."""
  mesh, rules = mesh_of((2, 2, 2)), logical_axis_rules(fsdp=True)
  params = init_sharded(CONFIG, mesh, rules, rng=0)
  model = make_model(CONFIG)
  tokens = jnp.ones((4, 8), jnp.int32)
  with activate(mesh, rules):
    text = jax.jit(lambda p, e, d: model.apply({"params": p}, e, d)).lower(
        params, tokens, tokens).as_text()
  constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
  heads = [c for c in constraints if '[{"data", "fsdp", "expert"}, {}, {"tensor"}, {}]' in c]
  embed = [c for c in constraints
           if re.search(r'\[\{"data", "fsdp", "expert"\}, \{\}, \{\}\]> : tensor<4x8x32', c)]
  assert len(heads) >= 4 * 6  # q, k, v, out in 2 encoder + 2x2 decoder attentions
  assert len(embed) >= 2 + 4  # both embeddings and every layer's output
  assert not any(re.search(r'\{"fsdp"\}\]> : tensor<4x8x32', c) for c in constraints)


def test_grouped_query_attention_shards_with_more_tensor_devices_than_kv_heads():
  """2 key/value heads on a tensor axis of 4: query heads shard, key/value heads replicate
  (their own logical axis), and the sharded logits equal the one-device ones."""
  config = ModelConfig(architecture="decoder_only", vocab_size=128, d_model=32, d_ff=64,
                       num_heads=4, num_key_value_heads=2, d_kv=8, num_decoder_layers=2,
                       position_encoding="rope", mlp_activation="swiglu", scale_attention=True)
  mesh, rules = mesh_of((2, 1, 4)), logical_axis_rules()
  params = init_sharded(config, mesh, rules)
  assert spec(params, "decoder/layers_0/attention/query/kernel") == P(None, "tensor", None)
  assert spec(params, "decoder/layers_0/attention/key/kernel") == P(None, None, None)
  tokens = np.random.RandomState(0).randint(1, 128, (2, 9))
  with activate(mesh, rules):
    sharded = t5lite.logits(config, params, tokens)
  np.testing.assert_allclose(sharded, t5lite.logits(config, jax.device_get(params), tokens),
                             rtol=1e-5, atol=1e-5)


def test_abstract_params_and_load_hf_work_under_an_active_mesh(tmp_path):
  """The trainer reads an HF INITIAL_CHECKPOINT_PATH inside its mesh and rules: shapes are
  unboxed without a sharding constraint (nn.unbox would put one on each shape and fail)."""
  config = tiny()
  t5lite.save_hf(config, init_params(config), str(tmp_path))
  mesh, rules = mesh_of((2, 1, 4)), logical_axis_rules()
  with activate(mesh, rules):
    shapes = abstract_params(config)
    loaded_config, params = t5lite.load_hf(str(tmp_path))
  assert jax.tree.map(lambda x: x.shape, shapes) == jax.tree.map(lambda x: x.shape, params)
