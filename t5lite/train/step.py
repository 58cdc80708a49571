"""The train step: a pure, module-level function of (state, batch), jitted at one call site.

    family = family_of(model_config, step_config.loss_options())
    step_fn = jax.jit(functools.partial(train_step, family=family, optimizer=tx,
                                        step_config=step_config, seed=0),
                      in_shardings=(state_shardings, batch_sharding),
                      out_shardings=(state_shardings, None), donate_argnums=0)
    state, metrics = step_fn(state, batch)

The training loop (t5lite.train.loop) jits `windowed_train_step` instead, which also adds the
step's metrics into an on-device window, so the host reads nothing until a log is due.

Loss. The family's loss_fn (t5lite.families): the step never knows which family it trains. It
returns the weighted loss sum and metric sums (with the batch's share of the normalizer); the
step divides once by the whole batch's normalizer.

Gradient accumulation. With `microbatches=M` the batch is split into M microbatches that a
jax.lax.scan runs one after the other, so activations are held for one microbatch only. Each
microbatch contributes the *unnormalized* weighted sum of its token losses and its share of the
normalizer (its real target tokens, positions or per-sequence weights); gradients of the sums are
added up and divided once by the whole batch's normalizer. Averaging per-microbatch means instead
would weigh a microbatch with few real tokens as much as a full one; this way the update equals
that of one big batch, for every loss_normalizing_factor (a constant normalizer is never summed).

Non-finite steps. When the loss or any gradient is NaN/inf, the returned params and opt_state are
the input ones, bit for bit (a jnp.where over every leaf: cheap next to the step, and it keeps
shardings as they are), and metrics['nonfinite'] is True. Then, by StepConfig.nonfinite:
- 'skip': state.step still advances, as T5X counts skipped steps: the step number keeps matching
  the number of batches the data iterator has produced and the dropout rng of the next step is
  fresh, so a restart from a checkpoint replays the same batches with the same masks.
- 'stop': state.step does not advance either, and the window freezes the state from then on
  (windowed_train_step passes `frozen`): every later step of the run returns its input state,
  so the state the loop holds when it next looks is exactly the one before the first
  non-finite step, and the window names that step. The loop then raises.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5lite.errors import ConfigError
from t5lite.families import Family, LossOptions
from t5lite.models import losses
from t5lite.train.train_state import TrainState

Batch = dict[str, jax.Array]
NONFINITE_MODES = ("stop", "skip")

@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Loss and update options of the train step (static: a change recompiles)."""

  label_smoothing: float = 0.0
  """Probability mass spread over the other vocabulary entries (0 in T5 pretraining)."""
  z_loss: float = 1e-4
  """Coefficient of logsumexp(logits)**2, which keeps logits from drifting (T5X: 1e-4)."""
  loss_normalizing_factor: float | str | None = losses.NUM_REAL_TARGET_TOKENS
  """Divide the summed weighted loss by: a constant, one of losses.NORMALIZERS, or None (sum)."""
  microbatches: int = 1
  """Gradient accumulation: split the batch into this many sequential microbatches."""
  nonfinite: str = "stop"
  """On a NaN/inf loss or gradient: 'stop' (the loop raises) or 'skip' (the update is dropped,
  the step counted). The update is never applied in either mode; see the module docstring."""
  max_skipped_fraction: float | None = 0.1
  """With 'skip': the training loop stops once more than this fraction of the steps it ran
  were skipped (checked from the tenth step on); None never stops. Host-side only."""

  def __post_init__(self):
    if self.microbatches < 1:
      raise ConfigError(f"microbatches must be >= 1, got {self.microbatches}")
    if self.nonfinite not in NONFINITE_MODES:
      raise ConfigError(f"nonfinite={self.nonfinite!r} is not one of {NONFINITE_MODES}")
    fraction = self.max_skipped_fraction
    if fraction is not None and not 0 <= fraction <= 1:
      raise ConfigError(f"max_skipped_fraction={fraction!r} must be in [0, 1] or None")
    lnf = self.loss_normalizing_factor
    if not (lnf is None or lnf in losses.NORMALIZERS
            or (isinstance(lnf, (int, float)) and not isinstance(lnf, bool) and lnf > 0)):
      raise ConfigError(f"loss_normalizing_factor={lnf!r}: use a positive number, None or one of "
                        f"{losses.NORMALIZERS}")

  def replace(self, **changes) -> "StepConfig":
    return dataclasses.replace(self, **changes)

  def loss_options(self) -> LossOptions:
    """The loss settings the family's loss_fn takes."""
    return LossOptions(label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                       loss_normalizing_factor=self.loss_normalizing_factor)


def _split(batch: Batch, microbatches: int) -> Batch:
  """(B, ...) -> (M, B/M, ...), microbatch i taking rows i, i + M, i + 2M, ...

  Strided rather than contiguous: with the batch sharded over devices in contiguous blocks, each
  device then holds an equal part of every microbatch and no rows move between devices.
  Example: rows [0..5], M = 2 -> [[0, 2, 4], [1, 3, 5]].
  """
  def split(x):
    if x.shape[0] % microbatches:
      raise ConfigError(f"batch size {x.shape[0]} is not divisible by microbatches={microbatches}")
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])  # (B/M, M, ...)
    return jnp.swapaxes(x, 0, 1)  # (M, B/M, ...)
  return jax.tree.map(split, batch)


def train_step(state: TrainState, batch: Batch, *, family: Family,
               optimizer: optax.GradientTransformation, step_config: StepConfig = StepConfig(),
               seed: int = 0, frozen: jax.Array | None = None, fixed_params=None
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on `batch`; returns (new state, metrics).

  seed: the dropout rng of a step is fold_in(key(seed), state.step), so it depends only on the
  seed and the saved step (reproducible across restarts). frozen (bool scalar): when True the
  update is not applied and the step does not advance, whatever the loss (see 'stop' in the
  module docstring). fixed_params: params the loss reads but never trains (a distillation
  teacher: t5lite.train.recipes.teacher), passed to loss_fn and never differentiated.

  metrics (scalars): loss (z-loss included, normalized as configured), grad_norm (global L2
  norm of the normalized gradients), nonfinite (bool), and the family's own figures
  (Family.metrics: z_loss, weight_sum, accuracy for token families). The learning rate is the
  caller's to log (optimizers.learning_rate_at).
  """
  rng = jax.random.fold_in(jax.random.key(seed), state.step)
  loss_fn = _loss_fn(family, fixed_params)
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
  m = step_config.microbatches
  if m == 1:
    (loss_sum, sums), grads = value_and_grad(state.params, batch, rng)
  else:
    def body(carry, xs):
      index, micro = xs
      (mb_loss, mb_sums), mb_grads = value_and_grad(state.params, micro,
                                                    jax.random.fold_in(rng, index))
      return jax.tree.map(jnp.add, carry, (mb_loss, mb_sums, mb_grads)), None

    micro_batches = _split(batch, m)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    sums_shape = jax.eval_shape(loss_fn, state.params, first, rng)[1]
    init = (jnp.zeros((), jnp.float32), jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                                      sums_shape),
            jax.tree.map(jnp.zeros_like, state.params))
    (loss_sum, sums, grads), _ = jax.lax.scan(body, init, (jnp.arange(m), micro_batches))

  lnf = step_config.loss_normalizing_factor
  if lnf is None:
    normalizer = jnp.asarray(1.0, jnp.float32)
  elif isinstance(lnf, str):
    normalizer = sums["normalizer"]
  else:
    normalizer = jnp.asarray(lnf, jnp.float32)
  normalizer = jnp.maximum(normalizer, 1e-8)  # an all-padding batch gives 0 loss, not NaN
  # The normalizer does not depend on params, so grad(sum) / N is grad(sum / N).
  grads = jax.tree.map(lambda g: g / normalizer.astype(g.dtype), grads)
  loss = loss_sum / normalizer
  grad_norm = optax.tree.norm(grads)  # optax.global_norm, under its non-deprecated name
  # A NaN/inf anywhere in the grads makes their global norm NaN/inf.
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  apply = finite if frozen is None else finite & jnp.logical_not(frozen)

  updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa: E731
  advance = 1 if step_config.nonfinite == "skip" else apply.astype(jnp.int32)
  new_state = state.replace(step=state.step + advance, params=keep(new_params, state.params),
                            opt_state=keep(new_opt_state, state.opt_state))
  metrics = {"loss": loss, **family.metrics(sums, normalizer), "grad_norm": grad_norm,
             "nonfinite": jnp.logical_not(finite)}
  return new_state, metrics


def _loss_fn(family: Family, fixed_params):
  """family.loss_fn, with the family's fixed params (a teacher) bound when it has them."""
  if fixed_params is None:
    return family.loss_fn
  return lambda params, batch, rng: family.loss_fn(params, batch, rng,
                                                   fixed_params=fixed_params)


def eval_step(params, batch: Batch, fixed_params=None, *, family: Family
              ) -> dict[str, jax.Array]:
  """Sums over one evaluation batch, without dropout: loss (the weighted loss sum, not
  normalized) and the family's metric sums (weight_sum: real target tokens, correct: weighted
  argmax hits, ...).

  Sums, so that batches add up: the mean token loss of an eval split is sum(loss) /
  sum(weight_sum) and its token accuracy sum(correct) / sum(weight_sum), whatever the
  batches' padding.
  """
  loss_sum, sums = _loss_fn(family, fixed_params)(params, batch, None)
  return {"loss": loss_sum, **sums}


# --- the metrics window ----------------------------------------------------------------------

def new_window() -> dict[str, np.ndarray]:
  """An empty metrics window: what windowed_train_step adds each step into, on the device.

  steps: steps since the window opened; loss_sum / finite_steps: the finite steps' losses
  (their mean is the window's loss_mean); nonfinite_steps: steps whose loss or gradients were
  NaN/inf (skipped or, with 'stop', the first of them); first_nonfinite: the number of the
  first such step, -1 while there is none.
  """
  # Distinct arrays (numpy, placed by the caller): the step donates every leaf of the window.
  count = lambda value=0: np.full((), value, np.int32)  # noqa: E731
  return {"steps": count(), "loss_sum": np.zeros((), np.float32), "finite_steps": count(),
          "nonfinite_steps": count(), "first_nonfinite": count(-1)}


def windowed_train_step(state: TrainState, window: dict[str, jax.Array], batch: Batch,
                        fixed_params=None, *, family: Family,
                        optimizer: optax.GradientTransformation,
                        step_config: StepConfig = StepConfig(), seed: int = 0
                        ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
  """train_step, then the step's metrics added into `window`; returns (state, window, the
  step's metrics). With nonfinite='stop' a window that holds a non-finite step freezes the
  state (train_step's `frozen`), so nothing is applied after it until the host looks."""
  frozen = window["first_nonfinite"] >= 0 if step_config.nonfinite == "stop" else None
  number = state.step + 1  # this step's number (before 'stop' freezes the counter)
  state, metrics = train_step(state, batch, family=family, optimizer=optimizer,
                              step_config=step_config, seed=seed, frozen=frozen,
                              fixed_params=fixed_params)
  bad = metrics["nonfinite"]
  window = {
      "steps": window["steps"] + 1,
      "loss_sum": window["loss_sum"] + jnp.where(bad, 0.0, metrics["loss"]),
      "finite_steps": window["finite_steps"] + jnp.logical_not(bad).astype(jnp.int32),
      "nonfinite_steps": window["nonfinite_steps"] + bad.astype(jnp.int32),
      "first_nonfinite": jnp.where(bad & (window["first_nonfinite"] < 0), number,
                                   window["first_nonfinite"]),
  }
  return state, window, metrics


def with_fixed_params(fn, fixed_params):
  """A jitted fn whose last argument is `fixed_params` (a teacher), bound: called, lowered
  and compiled as if it took the others only (the loop compiles the step once). fn itself
  when there are none."""
  return fn if fixed_params is None else _WithFixed(fn, fixed_params)


class _WithFixed:
  def __init__(self, fn, fixed_params):
    self.fn, self.fixed_params = fn, fixed_params

  def __call__(self, *args):
    return self.fn(*args, self.fixed_params)

  def lower(self, *args):
    return _WithFixed(self.fn.lower(*args, self.fixed_params), self.fixed_params)

  def compile(self):
    return _WithFixed(self.fn.compile(), self.fixed_params)

  def memory_analysis(self):
    return self.fn.memory_analysis()
