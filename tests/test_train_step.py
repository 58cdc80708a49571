"""Train step: learning, gradient accumulation == one big batch, non-finite skip, dropout rng,
scanned == unrolled. Tiny T5 (vocab 128, width 32, 1 + 1 layers; 2 + 2 where layers are
scanned), a batch of 8."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_trees_close, assert_trees_equal, tiny
from t5lite.families import family_of
from t5lite.models import init_params, param_logical_axes
from t5lite.models.params import scan_params, unscan_params
from t5lite.train.optimizers import OptimizerConfig, make_optimizer
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.step import StepConfig, new_window, train_step, windowed_train_step
from t5lite.train.train_state import TrainState

BATCH, INPUT_LEN, TARGET_LEN = 8, 12, 8
# One layer a stack: each test compiles its own step from a cold cache. The scanned test
# needs a stack of layers to scan: 2 + 2.
CONFIG = tiny(num_encoder_layers=1, num_decoder_layers=1)
STACKED = tiny()
ADAMW = optax.adamw(3e-3)
# Uneven loss weights: row r has r real targets (row 0 none), so with strided microbatches
# (rows i, i + M, ...) every microbatch holds a different number of real tokens.
LENGTHS = np.arange(BATCH)


def _batch(seed: int = 0) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  targets = rng.integers(2, 128, (BATCH, TARGET_LEN))
  weights = (np.arange(TARGET_LEN)[None, :] < LENGTHS[:, None]).astype(np.int32)
  targets = targets * weights
  inputs = np.concatenate([np.zeros((BATCH, 1), np.int64), targets[:, :-1]], axis=1)
  return {"encoder_input_tokens": jnp.asarray(rng.integers(2, 128, (BATCH, INPUT_LEN)), jnp.int32),
          "decoder_input_tokens": jnp.asarray(inputs, jnp.int32),
          "decoder_target_tokens": jnp.asarray(targets, jnp.int32),
          # float32, so that the inf of the non-finite test does not change the program.
          "decoder_loss_weights": jnp.asarray(weights, jnp.float32),
          "decoder_segment_ids": jnp.asarray(weights, jnp.int32)}


@functools.lru_cache(maxsize=None)
def _params(config=CONFIG):
  return init_params(config, 0)


@functools.lru_cache(maxsize=None)
def _step_fn(config, optimizer, step_config, donate: bool = False):
  """Jitted train_step (donating its state or not: then tests may reuse their input states)."""
  family = family_of(config, step_config.loss_options())
  return jax.jit(functools.partial(train_step, family=family, optimizer=optimizer,
                                   step_config=step_config), donate_argnums=0 if donate else ())


def test_loss_decreases_and_donating_step():
  step_config = StepConfig(nonfinite="skip")
  step = _step_fn(CONFIG, ADAMW, step_config, donate=True)
  # A copy: the step donates (deletes) its input state, and _params() is shared by other tests.
  state = TrainState.create(jax.tree.map(jnp.copy, _params()), ADAMW)
  batch = _batch()
  losses = []
  for _ in range(10):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    assert not bool(metrics["nonfinite"])
  assert int(state.step) == 10
  assert losses[-1] < 0.7 * losses[0], losses
  assert float(metrics["weight_sum"]) == LENGTHS.sum()
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0 and float(metrics["grad_norm"]) > 0


@pytest.mark.parametrize("normalizer", ["NUM_REAL_TARGET_TOKENS", 50.0])
def test_microbatches_equal_one_batch(normalizer):
  sgd = optax.sgd(1.0)  # the update is the gradient itself: compares grads directly
  state = TrainState.create(_params(), sgd)
  batch = _batch()
  results = {}
  # One microbatch count besides 1: m = 2 runs the same scan and split as m = 4.
  for m in (1, 4):
    step_config = StepConfig(loss_normalizing_factor=normalizer, microbatches=m)
    results[m] = _step_fn(CONFIG, sgd, step_config)(state, batch)
  ref_state, ref_metrics = results[1]
  for m in sorted(results)[1:]:
    new_state, metrics = results[m]
    for key in ("loss", "z_loss", "weight_sum", "accuracy", "grad_norm"):
      np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)
    assert_trees_close(new_state.params, ref_state.params, rtol=1e-7, atol=1e-5)
  # Averaging per-microbatch means would differ: the test batch is uneven enough to tell.
  assert float(ref_metrics["grad_norm"]) > 0


def test_nonfinite_skip_keeps_state_bitwise():
  # The donating step of the first test (same program, so a compilation cache hit): inputs
  # are donated, hence the copies kept for comparing.
  step = _step_fn(CONFIG, ADAMW, StepConfig(nonfinite="skip"), donate=True)
  state, _ = step(TrainState.create(jax.tree.map(jnp.copy, _params()), ADAMW), _batch())
  before = jax.tree.map(np.array, state)  # a non-trivial opt_state
  bad = dict(_batch(1))
  # inf loss weights make the loss inf / inf = NaN and the gradients NaN.
  bad["decoder_loss_weights"] = bad["decoder_loss_weights"].at[3, 0].set(jnp.inf)
  new_state, metrics = step(state, bad)
  assert bool(metrics["nonfinite"])
  assert_trees_equal(new_state.params, before.params)
  assert_trees_equal(new_state.opt_state, before.opt_state)
  assert int(new_state.step) == int(before.step) + 1  # 'skip' counts the step


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_window_freezes_the_state_after_a_nonfinite_step_in_stop_mode(mode):
  """A window counts the steps, averages the finite losses and names the first non-finite
  step; with 'stop' nothing is applied from that step on, whatever comes after."""
  step_config = StepConfig(nonfinite=mode)
  family = family_of(CONFIG, step_config.loss_options())
  step = jax.jit(functools.partial(windowed_train_step, family=family, optimizer=ADAMW,
                                   step_config=step_config))
  state, window = TrainState.create(_params(), ADAMW), jax.device_put(new_window())
  state, window, first = step(state, window, _batch())
  before = jax.tree.map(np.array, state)
  bad = dict(_batch(1))
  bad["decoder_loss_weights"] = bad["decoder_loss_weights"].at[3, 0].set(jnp.inf)
  state, window, metrics = step(state, window, bad)  # step 2: non-finite
  assert bool(metrics["nonfinite"])
  state, window, later = step(state, window, _batch(2))  # step 3: finite again
  assert not bool(later["nonfinite"])
  window = jax.device_get(window)
  assert int(window["steps"]) == 3 and int(window["first_nonfinite"]) == 2
  assert int(window["nonfinite_steps"]) == 1 and int(window["finite_steps"]) == 2
  np.testing.assert_allclose(window["loss_sum"], float(first["loss"]) + float(later["loss"]),
                             rtol=1e-6)
  if mode == "stop":  # frozen: exactly the state after step 1, the counter at 1
    assert_trees_equal(state, before)
  else:  # the bad update dropped, step 3 applied, every step counted
    assert int(state.step) == 3
    assert any(not np.array_equal(x, y) for x, y in
               zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params)))


def test_dropout_rng_is_reproducible_and_per_step():
  config = CONFIG.replace(dropout_rate=0.1)
  step = _step_fn(config, ADAMW, StepConfig())
  state = TrainState.create(_params(), ADAMW)  # dropout does not change the params
  batch = _batch()
  first = step(state, batch)
  second = step(state, batch)
  assert_trees_equal(first, second)
  later, later_metrics = step(state.replace(step=jnp.asarray(7, jnp.int32)), batch)
  assert float(later_metrics["loss"]) != float(first[1]["loss"])


def test_scanned_step_equals_unrolled():
  # Factor every matrix (min_dim 8): with unfactored Adafactor the first update is
  # lr * sign(grad), which turns float-rounding differences of tiny gradients into sign flips.
  opt_config = OptimizerConfig(schedule=ScheduleConfig("constant", 0.01, warmup_steps=0),
                               min_dim_size_to_factor=8)
  scanned_config = STACKED.replace(scan_layers=True)
  params = _params(STACKED)
  outs = []
  for config, p in ((STACKED, params), (scanned_config, scan_params(params, scanned_config))):
    tx = make_optimizer(opt_config, param_logical_axes(config))
    p = jax.tree.map(jnp.asarray, p)
    outs.append(_step_fn(config, tx, StepConfig())(TrainState.create(p, tx), _batch()))
  (unrolled, m_unrolled), (scanned, m_scanned) = outs
  np.testing.assert_allclose(m_scanned["loss"], m_unrolled["loss"], rtol=1e-6)
  flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]  # noqa: E731
  got = dict(flat(unscan_params(jax.tree.map(np.asarray, scanned.params))))
  for path, want in flat(unrolled.params):
    np.testing.assert_allclose(got[path], want, atol=1e-5, err_msg=jax.tree_util.keystr(path))
