"""The train step: a pure, module-level function of (state, batch), jitted at one call site.

    step_fn = make_train_step(model_config, optimizer, StepConfig())   # jit, donates the state
    state, metrics = step_fn(state, batch)
    if metrics["nonfinite"]:          # the loop's job: the step only reports it
      ...                             # 'stop': raise; 'skip': log and go on

Or jit it yourself with shardings:

    jax.jit(functools.partial(train_step, model_config=mc, optimizer=tx, step_config=sc),
            in_shardings=(state_shardings, batch_sharding), out_shardings=(state_shardings, None),
            donate_argnums=0)

Loss. Per token cross entropy (label smoothing, z-loss) from t5lite.models.losses, weighted by
the family's loss weights: decoder_target_tokens / decoder_loss_weights for encoder-decoder and
decoder-only models, mlm_target_tokens / mlm_loss_weights for encoder-only ones.

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
- 'stop': state.step does not advance either; the returned state is exactly the one before the
  failing step (the input is donated, so this is the only copy the loop has), ready to be saved
  or inspected. The loop must check metrics['nonfinite'] and raise.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from t5lite.models import losses
from t5lite.models.config import ModelConfig
from t5lite.models.network import make_model, model_inputs
from t5lite.train.train_state import TrainState

Batch = dict[str, jax.Array]
NONFINITE_MODES = ("stop", "skip")

# (targets, loss weights, segment ids) keys of each model family.
TARGET_KEYS = {
    "encoder_decoder": ("decoder_target_tokens", "decoder_loss_weights", "decoder_segment_ids"),
    "decoder_only": ("decoder_target_tokens", "decoder_loss_weights", "decoder_segment_ids"),
    "encoder_only": ("mlm_target_tokens", "mlm_loss_weights", "encoder_segment_ids"),
}


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
  seed: int = 0
  """Dropout rng seed; the rng of a step is fold_in(key(seed), step)."""

  def __post_init__(self):
    if self.microbatches < 1:
      raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
    if self.nonfinite not in NONFINITE_MODES:
      raise ValueError(f"nonfinite={self.nonfinite!r} is not one of {NONFINITE_MODES}")
    lnf = self.loss_normalizing_factor
    if not (lnf is None or lnf in losses.NORMALIZERS
            or (isinstance(lnf, (int, float)) and not isinstance(lnf, bool) and lnf > 0)):
      raise ValueError(f"loss_normalizing_factor={lnf!r}: use a positive number, None or one of "
                       f"{losses.NORMALIZERS}")

  def replace(self, **changes) -> "StepConfig":
    return dataclasses.replace(self, **changes)


def _loss_sums(params, batch: Batch, rng: jax.Array | None, *, model_config: ModelConfig,
               step_config: StepConfig):
  """(weighted loss sum, sums) of one microbatch; sums add up across microbatches.

  rng None: deterministic (no dropout), as in evaluation.

  sums: z_loss (weighted sum), weight_sum (real target tokens), correct (weighted count of
  argmax hits) and normalizer (this microbatch's share; unused for a constant normalizer).
  """
  dropout = rng is not None and model_config.dropout_rate > 0
  model = make_model(model_config, enable_dropout=dropout)
  logits = model.apply({"params": params}, **model_inputs(model_config, batch),
                       rngs={"dropout": rng} if dropout else None)  # (B, L, V)
  target_key, weight_key, segment_key = TARGET_KEYS[model_config.architecture]
  targets = batch[target_key]
  weights = batch.get(weight_key)
  weights = (jnp.ones(targets.shape, jnp.float32) if weights is None
             else weights.astype(jnp.float32))
  lnf = step_config.loss_normalizing_factor
  loss_weights = weights
  if lnf == losses.AVERAGE_PER_SEQUENCE:
    # Rescaling is per row, so it gives the same weights whichever microbatch holds the row.
    loss_weights = losses.per_segment_weights(weights, batch.get(segment_key))
  # normalizer=None: plain weighted sums, divided once for the whole batch by train_step.
  out = losses.weighted_cross_entropy(
      logits, targets, loss_weights, label_smoothing=step_config.label_smoothing,
      z_loss=step_config.z_loss, loss_normalizing_factor=None)
  weight_sum = jnp.sum(weights)
  if lnf == losses.NUM_TOTAL_TARGET_TOKENS:
    normalizer = jnp.asarray(targets.size, jnp.float32)
  elif lnf == losses.AVERAGE_PER_SEQUENCE:
    normalizer = jnp.sum(loss_weights)
  else:  # NUM_REAL_TARGET_TOKENS; ignored for a constant or None
    normalizer = weight_sum
  sums = {
      "z_loss": out["z_loss"],
      "weight_sum": weight_sum,
      # token_accuracy is a weighted mean; times the weight sum it is the weighted hit count.
      "correct": losses.token_accuracy(logits, targets, weights) * weight_sum,
      "normalizer": normalizer,
  }
  return out["loss"], sums


def _split(batch: Batch, microbatches: int) -> Batch:
  """(B, ...) -> (M, B/M, ...), microbatch i taking rows i, i + M, i + 2M, ...

  Strided rather than contiguous: with the batch sharded over devices in contiguous blocks, each
  device then holds an equal part of every microbatch and no rows move between devices.
  Example: rows [0..5], M = 2 -> [[0, 2, 4], [1, 3, 5]].
  """
  def split(x):
    if x.shape[0] % microbatches:
      raise ValueError(f"batch size {x.shape[0]} is not divisible by microbatches={microbatches}")
    x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])  # (B/M, M, ...)
    return jnp.swapaxes(x, 0, 1)  # (M, B/M, ...)
  return jax.tree.map(split, batch)


def train_step(state: TrainState, batch: Batch, *, model_config: ModelConfig,
               optimizer: optax.GradientTransformation,
               step_config: StepConfig = StepConfig()) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on `batch`; returns (new state, metrics).

  metrics (scalars): loss (z-loss included, normalized as configured), z_loss, weight_sum (real
  target tokens), accuracy (weighted), grad_norm (global L2 norm of the normalized gradients),
  nonfinite (bool). The learning rate is the caller's to log (optimizers.learning_rate_at).
  """
  # Reproducible across restarts: the rng depends only on the seed and the saved step.
  rng = jax.random.fold_in(jax.random.key(step_config.seed), state.step)
  value_and_grad = jax.value_and_grad(
      functools.partial(_loss_sums, model_config=model_config, step_config=step_config),
      has_aux=True)
  m = step_config.microbatches
  if m == 1:
    (loss_sum, sums), grads = value_and_grad(state.params, batch, rng)
  else:
    def body(carry, xs):
      index, micro = xs
      (mb_loss, mb_sums), mb_grads = value_and_grad(state.params, micro,
                                                    jax.random.fold_in(rng, index))
      return jax.tree.map(jnp.add, carry, (mb_loss, mb_sums, mb_grads)), None

    zero = jnp.zeros((), jnp.float32)
    init = (zero, {k: zero for k in ("z_loss", "weight_sum", "correct", "normalizer")},
            jax.tree.map(jnp.zeros_like, state.params))
    (loss_sum, sums, grads), _ = jax.lax.scan(body, init, (jnp.arange(m), _split(batch, m)))

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

  updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
  advance = 1 if step_config.nonfinite == "skip" else finite.astype(jnp.int32)
  new_state = state.replace(step=state.step + advance, params=keep(new_params, state.params),
                            opt_state=keep(new_opt_state, state.opt_state))
  metrics = {
      "loss": loss,
      "z_loss": sums["z_loss"] / normalizer,
      "weight_sum": sums["weight_sum"],
      "accuracy": sums["correct"] / jnp.maximum(sums["weight_sum"], 1e-8),
      "grad_norm": grad_norm,
      "nonfinite": jnp.logical_not(finite),
  }
  return new_state, metrics


def eval_step(params, batch: Batch, *, model_config: ModelConfig,
              step_config: StepConfig = StepConfig()) -> dict[str, jax.Array]:
  """Sums over one evaluation batch, without dropout: loss (weighted, z-loss included, not
  normalized), weight_sum (real target tokens) and correct (weighted argmax hits).

  Sums, so that batches add up: the mean token loss of an eval split is sum(loss) /
  sum(weight_sum) and its token accuracy sum(correct) / sum(weight_sum), whatever the
  batches' padding.
  """
  loss_sum, sums = _loss_sums(params, batch, None, model_config=model_config,
                              step_config=step_config)
  return {"loss": loss_sum, "weight_sum": sums["weight_sum"], "correct": sums["correct"]}


def make_train_step(model_config: ModelConfig, optimizer: optax.GradientTransformation,
                    step_config: StepConfig = StepConfig(), **jit_kwargs: Any) -> Callable:
  """train_step jitted as fn(state, batch), donating the state (its buffers are reused).

  jit_kwargs go to jax.jit, e.g. in_shardings / out_shardings. After a call the state passed in
  must not be used again: keep only the returned one.
  """
  fn = functools.partial(train_step, model_config=model_config, optimizer=optimizer,
                         step_config=step_config)
  return jax.jit(fn, donate_argnums=0, **jit_kwargs)
