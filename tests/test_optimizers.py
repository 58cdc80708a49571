"""Optimizers and schedules: scanned == unrolled Adafactor, T5X factoring, declared state axes,
schedules, AdamW."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from helpers import tiny
from t5lite.models import abstract_params, make_model, param_logical_axes
from t5lite.models.params import scan_params, unscan_params
from t5lite.train import schedules
from t5lite.train.adafactor import adafactor, factored_dims
from t5lite.train.optimizers import (OptimizerConfig, declared, learning_rate_at, make_optimizer,
                                     trainable_only)
from t5lite.train.schedules import ScheduleConfig, make_schedule

STEPS = 3
CONSTANT_LR = ScheduleConfig("constant", 0.01, warmup_steps=0)


@functools.lru_cache(maxsize=None)
def _model_and_grads():
  """A tiny T5 v1.1 (vocab 128, width 32, 2 + 2 layers, gated-gelu), its params and grads."""
  config = tiny(mlp_activation="gated-gelu")
  # Random values of the right shapes instead of init_params: abstract_params only traces, while
  # compiling the model's init would cost this file seconds; layers also differ more this way.
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.5, x.shape), jnp.float32),
                        abstract_params(config))
  inputs = {"encoder_input_tokens": jnp.asarray(rng.integers(1, 128, (2, 7)), jnp.int32),
            "decoder_input_tokens": jnp.asarray(rng.integers(1, 128, (2, 5)), jnp.int32)}
  model = make_model(config)
  loss = lambda p: jnp.sum(model.apply({"params": p}, **inputs) ** 2)  # noqa: E731
  grads = jax.jit(jax.grad(loss))(params)
  return config, params, grads


def _run(tx, params, grads):
  """STEPS updates, grads scaled per step so the second-moment EMAs see different values."""
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(STEPS):
    g = jax.tree.map(lambda x: x * (1.0 + 0.5 * step), grads)
    updates, state = update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _assert_close(actual, desired, err_msg=""):
  """Equal within 1e-6 relative to the array's scale: float32 reductions batched by vmap or over
  (H, K) instead of H*K may round differently, so near-zero entries are judged by the scale."""
  desired = np.asarray(desired)
  np.testing.assert_allclose(actual, desired, rtol=1e-6, atol=1e-6 * np.abs(desired).max(),
                             err_msg=err_msg)


def _max_rel_diff(a, b) -> float:
  """Largest |a - b| / |b| over leaves (leaf norms, so tiny entries do not dominate)."""
  diffs = jax.tree.map(lambda x, y: float(np.linalg.norm(np.asarray(x) - np.asarray(y))
                                          / np.linalg.norm(np.asarray(y))), a, b)
  return max(jax.tree.leaves(diffs))


def test_scanned_adafactor_equals_unrolled_layer_by_layer():
  config, params, grads = _model_and_grads()
  scanned = config.replace(scan_layers=True)
  # Kernels factored (all tiny dims are >= 8), norm scales and relpos tables (32, 4) not, and
  # momentum on: every path of the per-layer Adafactor runs, stacked and unstacked.
  opt = OptimizerConfig(schedule=CONSTANT_LR, min_dim_size_to_factor=8, momentum=0.9)

  unrolled_out, _ = _run(make_optimizer(opt, param_logical_axes(config)), params, grads)
  stacked, stacked_grads = scan_params(params, scanned), scan_params(grads, scanned)
  scanned_out, scanned_state = _run(make_optimizer(opt, param_logical_axes(scanned)), stacked,
                                    stacked_grads)
  scanned_out = unscan_params(scanned_out)

  flat = jax.tree_util.tree_leaves_with_path(unrolled_out)
  scan_flat = dict(jax.tree_util.tree_leaves_with_path(scanned_out))
  assert len(flat) == len(scan_flat)
  for path, value in flat:
    _assert_close(scan_flat[path], value, err_msg=str(path))
  # The 3 updates themselves (new - old params) agree too, up to float32 rounding of the params.
  def moved(out):
    return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), out, params)
  assert _max_rel_diff(moved(scanned_out), moved(unrolled_out)) < 1e-4

  # The proof that per-layer handling is needed: plain optax.adafactor on the stacks factors
  # the wrong dims, clips and scales over all layers at once and moves the params elsewhere.
  plain = optax.adafactor(0.01, min_dim_size_to_factor=opt.min_dim_size_to_factor,
                          momentum=opt.momentum)
  plain_out, _ = _run(plain, stacked, stacked_grads)
  assert _max_rel_diff(moved(unscan_params(plain_out)), moved(unrolled_out)) > 0.1

  # Statistics are per layer: a stacked (2, 32, 4, 8) query kernel keeps (2, 32) rows and
  # (2, 4, 8) columns, a stacked (2, 32) norm scale a full (2, 32) second moment.
  core = scanned_state[1]
  layers = lambda tree: tree["encoder"]["layers"]  # noqa: E731
  query = lambda tree: layers(tree)["attention"]["query"]["kernel"]  # noqa: E731
  assert query(core.v_row).shape == (2, 32) and query(core.v_col).shape == (2, 4, 8)
  assert query(core.v).shape == (2, 1) and query(core.m).shape == (2, 32, 4, 8)
  norm = lambda tree: layers(tree)["pre_mlp_layer_norm"]["scale"]  # noqa: E731
  assert norm(core.v).shape == (2, 32) and norm(core.v_row).shape == (2, 1)


def test_axes_of_another_layout_are_refused():
  config, params, _ = _model_and_grads()
  scanned_axes = param_logical_axes(config.replace(scan_layers=True))
  with pytest.raises(ValueError, match="scan_layers"):
    make_optimizer(OptimizerConfig(), scanned_axes).init(params)


def test_factoring_rules_follow_t5x():
  # Attention kernels: embed is the row side, (heads, kv) the column side -> the (D, H*K) matrix.
  assert factored_dims(("embed", "heads", "kv"), (512, 6, 64)) == ((0,), (1, 2))
  assert factored_dims(("heads", "kv", "embed"), (6, 64, 512)) == ((2,), (0, 1))
  # optax would see (512, 6, 64) as "second largest dim 64 < 128" and not factor at all.
  assert factored_dims(("embed", "mlp"), (512, 1024)) == ((0,), (1,))
  assert factored_dims(("embed", "mlp"), (512, 64)) is None          # 64 < min_dim_size_to_factor
  assert factored_dims(("embed", "heads", "kv"), (32, 4, 8), 8) == ((0,), (1, 2))
  assert factored_dims(("embed", "heads", "kv"), (32, 4, 8), 64) is None   # the 32 x 32 view
  assert factored_dims(("embed",), (512,)) is None
  assert factored_dims((None, None, None), (256, 256, 256)) is None  # unnamed rank 3: full v


def test_3d_kernel_update_equals_t5x_2d_layout():
  """(D, H, K) with logical names gets the update of T5X's (D, H*K) kernel, reshaped."""
  rng = np.random.default_rng(1)
  param = jnp.asarray(rng.normal(size=(32, 4, 8)), jnp.float32)
  grads = [jnp.asarray(rng.normal(size=(32, 4, 8)), jnp.float32) for _ in range(STEPS)]
  tx3 = adafactor(0.01, {"w": P("embed", "heads", "kv")}, min_dim_size_to_factor=8)
  tx2 = adafactor(0.01, {"w": P("embed", "joined_kv")}, min_dim_size_to_factor=8)
  p3, s3 = {"w": param}, tx3.init({"w": param})
  p2, s2 = {"w": param.reshape(32, 32)}, tx2.init({"w": param.reshape(32, 32)})
  for g in grads:
    u3, s3 = tx3.update({"w": g}, s3, p3)
    u2, s2 = tx2.update({"w": g.reshape(32, 32)}, s2, p2)
    p3, p2 = optax.apply_updates(p3, u3), optax.apply_updates(p2, u2)
  _assert_close(p3["w"].reshape(32, 32), p2["w"])
  _assert_close(s3.v_row["w"], s2.v_row["w"])
  _assert_close(s3.v_col["w"].reshape(32), s2.v_col["w"])


def test_adafactor_equals_optax_on_matrices_and_vectors():
  """Where optax.adafactor is right (unstacked, rank <= 2), the two agree: same T5X math."""
  rng = np.random.default_rng(2)
  params = {"w": jnp.asarray(rng.normal(size=(16, 24)), jnp.float32),
            "big": jnp.asarray(rng.normal(size=(24, 4)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(24,)), jnp.float32)}
  grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
  ours, _ = _run(adafactor(0.01, None, min_dim_size_to_factor=8), params, grads)
  ref, _ = _run(optax.adafactor(0.01, min_dim_size_to_factor=8), params, grads)
  assert _max_rel_diff(ours, ref) < 1e-6


def test_adafactor_update_clipping_is_per_layer():
  """Without parameter scaling an update's RMS is at most lr * clipping_threshold, per layer."""
  rng = np.random.default_rng(3)
  stacked = {"k": jnp.asarray(rng.normal(size=(3, 16, 16)), jnp.float32)}
  # Layer 0 gets a spiky gradient: its factored y has RMS > 1 and must be clipped on its own.
  g = rng.normal(size=(3, 16, 16)) * np.array([1.0, 1e-3, 1e3])[:, None, None]
  g[0, 0, 0] = 1e3
  tx = adafactor(0.1, {"k": P("layers", "embed", "mlp")}, min_dim_size_to_factor=8,
                 multiply_by_parameter_scale=False)
  update, _ = tx.update({"k": jnp.asarray(g, jnp.float32)}, tx.init(stacked), stacked)
  rms = np.sqrt(np.mean(np.square(update["k"]), axis=(1, 2)))
  np.testing.assert_array_less(rms, 0.1 * (1 + 1e-5))
  np.testing.assert_allclose(rms[0], 0.1, rtol=1e-5)  # clipped exactly to the threshold
  assert rms[1] > 0.05 and rms[2] > 0.05  # not shrunk by layer 0's clipping


# --- declared state axes

VARIANTS = {
    "adafactor": OptimizerConfig(min_dim_size_to_factor=8),
    "adafactor_unfactored": OptimizerConfig(factored=False),
    "adafactor_nothing_large_enough": OptimizerConfig(),  # every tiny dim < 128
    "adafactor_momentum_clip": OptimizerConfig(min_dim_size_to_factor=8, momentum=0.9,
                                               global_norm_clip=1.0),
    "adamw": OptimizerConfig("adamw"),
    "adamw_clip_no_decay": OptimizerConfig("adamw", global_norm_clip=1.0, weight_decay=0.0),
}


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _assert_declares_its_state(tx, params, param_axes):
  """tx.state_axes(params) is shaped exactly like tx.init(params), and every named dim of every
  state leaf has the size that name has in the params (so no axis is misplaced)."""
  state = jax.eval_shape(tx.init, params)
  axes = tx.state_axes(params)
  assert jax.tree.structure(axes, is_leaf=_is_spec) == jax.tree.structure(state)
  sizes = {}
  for shape, spec in zip(jax.tree.leaves(params), jax.tree.leaves(param_axes, is_leaf=_is_spec)):
    for size, name in zip(shape.shape, spec):
      assert sizes.setdefault(name, size) == size
  for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(axes, is_leaf=_is_spec)):
    assert _is_spec(spec) and len(spec) <= leaf.ndim, (leaf.shape, spec)
    for size, name in zip(leaf.shape, spec):
      assert name is None or sizes[name] == size, (leaf.shape, spec)
  return axes


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_declared_state_axes_are_shaped_like_the_state(variant, scan):
  config = tiny(scan_layers=scan)
  params, param_axes = abstract_params(config), param_logical_axes(config)
  tx = make_optimizer(VARIANTS[variant], param_axes)
  axes = _assert_declares_its_state(tx, params, param_axes)
  core = axes[1] if variant.startswith("adafactor") else axes[1][0]  # adamw: scale_by_adam
  assert core.count == P()
  # Frozen params (a family's trainable_mask): multi_transform's state, declared as well.
  mask = jax.tree_util.tree_map_with_path(lambda path, _: "encoder" not in str(path), params)
  _assert_declares_its_state(trainable_only(tx, mask), params, param_axes)


def test_factored_statistics_declare_what_they_keep():
  """Square kernels included: the optimizer knows which dim it reduced, the shape does not."""
  axes = {"wi": P("embed", "mlp"), "wo": P("mlp", "embed"), "stack": P("layers", "embed", "mlp"),
          "out": P("heads", "kv", "embed"), "scale": P("embed")}
  params = {"wi": jnp.zeros((16, 16)), "wo": jnp.zeros((16, 16)), "stack": jnp.zeros((2, 16, 16)),
            "out": jnp.zeros((4, 4, 16)), "scale": jnp.zeros((16,))}
  tx = adafactor(0.01, axes, min_dim_size_to_factor=8, momentum=0.9)
  state = _assert_declares_its_state(tx, params, axes)
  assert state.v_row == {"wi": P("embed"), "wo": P("mlp"), "stack": P("layers", "embed"),
                         "out": P("embed"), "scale": P()}
  assert state.v_col == {"wi": P("mlp"), "wo": P("embed"), "stack": P("layers", "mlp"),
                         "out": P("heads", "kv"), "scale": P()}
  assert state.v == {"wi": P(), "wo": P(), "stack": P(), "out": P(), "scale": P("embed")}
  assert state.m == axes
  unfactored = adafactor(0.01, axes, factored=False).state_axes(params)
  assert unfactored.v == axes and unfactored.v_row == dict.fromkeys(axes, P())
  assert unfactored.m == dict.fromkeys(axes, P())  # no momentum: (1,) placeholders


def test_optax_wrappers_declare_their_state():
  """declared() covers optax's own states: injected hyperparameters, masks, counts."""
  axes = {"w": P("embed", "mlp"), "b": P("mlp")}
  params = {"w": jnp.zeros((4, 8)), "b": jnp.zeros((8,))}
  injected = declared(optax.inject_hyperparams(optax.adamw)(learning_rate=0.1), axes)
  state = _assert_declares_its_state(injected, params, axes)
  assert state.hyperparams["learning_rate"] == P() and state.inner_state[0].mu == axes
  masked = declared(optax.masked(optax.scale_by_adam(), {"w": True, "b": False}), axes)
  state = _assert_declares_its_state(masked, params, axes)
  assert state.inner_state.nu["w"] == P("embed", "mlp")
  assert isinstance(state.inner_state.nu["b"], optax.MaskedNode)


def test_rsqrt_schedule_matches_t5x():
  sched = schedules.rsqrt(1.0, 10000)
  for step in (0, 1, 5000, 10000):
    assert float(sched(step)) == pytest.approx(0.01)
  assert float(sched(40000)) == pytest.approx(0.005)
  assert float(sched(1_000_000)) == pytest.approx(0.001)
  assert float(jax.jit(sched)(jnp.int32(40000))) == pytest.approx(0.005)
  assert float(schedules.rsqrt(2.0, 100)(400)) == pytest.approx(0.1)
  assert learning_rate_at(OptimizerConfig(), 0) == pytest.approx(0.01)  # T5 v1.1 default


def test_linear_cosine_constant_schedules():
  lin = schedules.linear(1.0, warmup_steps=10, decay_steps=100, end=0.1)
  cos = schedules.cosine(1.0, warmup_steps=10, decay_steps=100, end=0.1)
  for sched in (lin, cos):
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(0.5)
    assert float(sched(10)) == pytest.approx(1.0)
    assert float(sched(60)) == pytest.approx(0.55)  # halfway: both are at the midpoint
    assert float(sched(110)) == pytest.approx(0.1)
    assert float(sched(10**6)) == pytest.approx(0.1)
  assert float(lin(35)) == pytest.approx(1.0 - 0.9 * 0.25)
  assert float(cos(35)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 0.25)))
  assert float(schedules.cosine(1.0, 0, 10)(0)) == pytest.approx(1.0)  # no warmup
  assert float(schedules.constant(2.0)(0)) == 2.0
  warm = schedules.constant(2.0, warmup_steps=4)
  assert [float(warm(s)) for s in (0, 2, 4, 100)] == pytest.approx([0.0, 1.0, 2.0, 2.0])
  assert learning_rate_at(ScheduleConfig("cosine", 1.0, 10, 100, 0.1), 60) == pytest.approx(0.55)


def test_schedules_do_not_depend_on_total_steps():
  # No field can tie a schedule to the run's length ...
  fields = {f.name for f in dataclasses.fields(ScheduleConfig)}
  assert fields == {"name", "value", "warmup_steps", "decay_steps", "end_value"}
  # ... so continuing a run past its old end leaves every past step's learning rate unchanged.
  for config in (ScheduleConfig(), ScheduleConfig("linear", 1e-3, 100, 1000),
                 ScheduleConfig("cosine", 1e-3, 100, 1000, 1e-5),
                 ScheduleConfig("constant", 1.0, 5)):
    sched = make_schedule(config)
    short, longer = np.arange(0, 2000, 7), np.arange(0, 8000, 7)
    np.testing.assert_array_equal(sched(short), sched(longer)[:len(short)])
  with pytest.raises(ValueError, match="not one of"):
    ScheduleConfig("bogus")
  with pytest.raises(ValueError, match="decay_steps"):
    make_schedule(ScheduleConfig("linear", 1.0, 10, 0))


def test_a_schedule_that_ends_before_the_run_warns_once_and_bad_values_are_named():
  linear = ScheduleConfig("linear", 1e-3, warmup_steps=100, decay_steps=300)
  warning = schedules.early_end(linear, 1200)
  assert warning == ("t5lite: warning: the linear learning-rate schedule reaches its end value "
                     "0 at step 400, before TRAIN_STEPS=1200: the last 800 steps train at 0 (to "
                     "decay until TRAIN_STEPS, set ScheduleConfig.decay_steps=1100)")
  assert float(make_schedule(linear)(401)) == 0.0  # what the warning says
  assert schedules.early_end(linear, 400) is None  # ends with the run
  assert schedules.early_end(ScheduleConfig(), 10**6) is None  # rsqrt never ends
  assert schedules.early_end(ScheduleConfig("cosine", 1e-3, 10, 90, 1e-5), 101) is not None
  with pytest.raises(ValueError, match=r"ScheduleConfig.value must be a number, got 'fast'"):
    ScheduleConfig(value="fast")
  with pytest.raises(ValueError, match=r"ScheduleConfig.decay_steps"):
    ScheduleConfig("linear", 1.0, 10, 10.5)


def test_adamw_step_reduces_quadratic_and_decays_only_matrices():
  target = {"w": jnp.full((4, 4), 2.0), "scale": jnp.full((4,), -1.0),
            "stack": jnp.full((2, 4), 3.0)}
  params = jax.tree.map(jnp.zeros_like, target)
  axes = {"w": P("embed", "mlp"), "scale": P("embed"), "stack": P("layers", "embed")}
  loss = lambda p: sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)  # noqa: E731
  opt = OptimizerConfig("adamw", schedule=ScheduleConfig("constant", 0.1, 0), weight_decay=0.5)
  tx = make_optimizer(opt, axes)
  state = tx.init(params)
  updates, state = tx.update(jax.grad(loss)(params), state, params)
  assert float(loss(optax.apply_updates(params, updates))) < float(loss(params))

  # With zero gradients only weight decay moves params: the matrix, not the vectors (a scanned
  # (layers, embed) norm scale is a vector per layer).
  ones = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(ones), ones)
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * np.ones((4, 4)), rtol=1e-6)
  assert not np.any(updates["scale"]) and not np.any(updates["stack"])


def test_global_norm_clip_bounds_what_the_optimizer_sees():
  params = {"a": jnp.zeros((3, 4)), "b": jnp.zeros((5,))}
  axes = {"a": P("embed", "mlp"), "b": P("embed")}
  grads = {"a": jnp.full((3, 4), 10.0), "b": jnp.full((5,), -10.0)}  # global norm ~41
  opt = OptimizerConfig("adamw", schedule=ScheduleConfig("constant", 0.1, 0), weight_decay=0.0)
  for clip, expected in ((1.0, 1.0), (None, float(optax.tree.norm(grads)))):
    tx = make_optimizer(opt.replace(global_norm_clip=clip), axes)
    _, state = tx.update(grads, tx.init(params), params)
    adam = state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...)
    # Adam's first moment after one step is (1 - b1) * the gradient it was given.
    assert float(optax.tree.norm(adam.mu)) / (1 - opt.b1) == pytest.approx(expected, rel=1e-5)
  # The state structure does not depend on whether clipping is on (resumable either way).
  structure = lambda c: jax.tree.structure(  # noqa: E731
      make_optimizer(opt.replace(global_norm_clip=c), axes).init(params))
  assert structure(1.0) == structure(None)
