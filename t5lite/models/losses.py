"""Token-level cross entropy with label smoothing, z-loss and T5X's loss normalization."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Named normalizers, as T5X's LossNormalizingFactor.
NUM_REAL_TARGET_TOKENS = "NUM_REAL_TARGET_TOKENS"  # sum of loss weights
NUM_TOTAL_TARGET_TOKENS = "NUM_TOTAL_TARGET_TOKENS"  # every target position, padding included
AVERAGE_PER_SEQUENCE = "AVERAGE_PER_SEQUENCE"  # each sequence (packed segment) weighs 1
NORMALIZERS = (NUM_REAL_TARGET_TOKENS, NUM_TOTAL_TARGET_TOKENS, AVERAGE_PER_SEQUENCE)


def cross_entropy(logits: jax.Array, targets: jax.Array, *, label_smoothing: float = 0.0,
                  z_loss: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Per-token (loss, z_loss) in float32 for logits (..., V) and integer targets (...).

  With smoothing s the target distribution is 1-s on the label and s/(V-1) elsewhere; the
  loss subtracts that distribution's entropy so a perfect prediction scores 0, as in T5X.
  The soft targets are never materialized: -sum_j p_j log q_j is computed from log q at
  the label and the sum of log q. z_loss * logsumexp(logits)**2 keeps logits from drifting.
  Example: logits [[0, 0]], targets [0] -> loss log(2) = 0.693.
  """
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  log_z = jax.nn.logsumexp(logits, axis=-1)
  label_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  nll_label = log_z - label_logit  # -log q(label)
  if label_smoothing:
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    nll_all = vocab * log_z - jnp.sum(logits, axis=-1)  # -sum_j log q_j
    loss = (confidence - low) * nll_label + low * nll_all
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    loss = loss - entropy
  else:
    loss = nll_label
  z = z_loss * jnp.square(log_z)
  return loss + z, z


def per_segment_weights(weights: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """Rescales weights so each sequence (or packed segment) sums to 1."""
  if segment_ids is None:
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)
  length = segment_ids.shape[-1]
  per_row = lambda w, s: jax.ops.segment_sum(w, s, num_segments=length + 1)[s]  # O(T) per row
  totals = jax.vmap(per_row)(weights, segment_ids.astype(jnp.int32))
  return weights / jnp.where(totals > 0, totals, 1.0)


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None,
                           *, label_smoothing: float = 0.0, z_loss: float = 0.0,
                           loss_normalizing_factor: float | str | None = NUM_REAL_TARGET_TOKENS,
                           segment_ids: jax.Array | None = None) -> dict[str, jax.Array]:
  """Summed, weighted token loss divided by a normalizer, as T5X does.

  loss_normalizing_factor: a constant (T5X pretraining divides by a fixed number of target
  tokens so every batch weighs the same), one of NORMALIZERS, or None (plain sum).
  Returns float32 scalars: loss (z-loss included), z_loss, weight_sum (real target tokens).
  """
  if weights is None:
    weights = jnp.ones(targets.shape, jnp.float32)
  weights = weights.astype(jnp.float32)
  token_loss, token_z = cross_entropy(logits, targets, label_smoothing=label_smoothing,
                                      z_loss=z_loss)
  weight_sum = jnp.sum(weights)
  if loss_normalizing_factor == AVERAGE_PER_SEQUENCE:
    weights = per_segment_weights(weights, segment_ids)
    normalizer = jnp.sum(weights)
  elif loss_normalizing_factor == NUM_REAL_TARGET_TOKENS:
    normalizer = weight_sum
  elif loss_normalizing_factor == NUM_TOTAL_TARGET_TOKENS:
    normalizer = jnp.asarray(targets.size, jnp.float32)
  elif loss_normalizing_factor is None:
    normalizer = jnp.asarray(1.0, jnp.float32)
  elif isinstance(loss_normalizing_factor, (int, float)):
    normalizer = jnp.asarray(loss_normalizing_factor, jnp.float32)
  else:
    raise ValueError(f"loss_normalizing_factor={loss_normalizing_factor!r}: use a number, None "
                     f"or one of {NORMALIZERS}")
  normalizer = jnp.maximum(normalizer, 1e-8)  # an all-padding batch gives 0 loss, not NaN
  return {
      "loss": jnp.sum(token_loss * weights) / normalizer,
      "z_loss": jnp.sum(token_z * weights) / normalizer,
      "weight_sum": weight_sum,
  }


def token_accuracy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None):
  """Weighted fraction of positions whose argmax equals the target."""
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  if weights is None:
    return jnp.mean(correct)
  weights = weights.astype(jnp.float32)
  return jnp.sum(correct * weights) / jnp.maximum(jnp.sum(weights), 1e-8)
