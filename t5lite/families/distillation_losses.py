"""The distillation losses, as sums over the positions a mask selects (and their counts), so
that microbatches and eval batches add up like every other t5lite loss.

  soft_cross_entropy   T^2 KL(softmax(t / T) || softmax(s / T)), summed over the classes
                       (Hinton et al.; DistilBERT's loss_ce; TinyBERT's prediction loss is
                       the soft cross entropy, the same gradient, without T^2)
  cosine_distance      1 - cos(s, t) per position (DistilBERT's loss_cos on last hidden states)
  squared_error        sum over the last axis of (s - t)^2, per position (TinyBERT's MSE on
                       hidden states, embeddings and attention scores: mean = sum / (count * d))
  layer_map            TinyBERT's uniform g(m) = m * N / M: which teacher layer teaches
                       student layer m

Each returns (sum over selected positions, number of selected positions); the caller divides.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _select(per_position: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  mask = mask.astype(jnp.float32)
  return jnp.sum(per_position * mask), jnp.sum(mask)


def soft_cross_entropy(student: jax.Array, teacher: jax.Array, mask: jax.Array,
                       temperature: float) -> tuple[jax.Array, jax.Array]:
  """T^2 * KL(p_t || p_s) at temperature T over the last axis of logits (..., C), summed
  over the positions where mask (...) is set; the T^2 keeps the gradient's scale independent
  of T (Hinton et al. 2015). DistilBERT's KLDivLoss(reduction='batchmean') over its
  selected positions is this sum divided by their number."""
  s = jax.nn.log_softmax(student.astype(jnp.float32) / temperature, axis=-1)
  t = jax.nn.log_softmax(teacher.astype(jnp.float32) / temperature, axis=-1)
  kl = jnp.sum(jnp.exp(t) * (t - s), axis=-1)  # (...)
  return _select(kl * temperature ** 2, mask)


def cosine_distance(student: jax.Array, teacher: jax.Array,
                    mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """1 - cos(s, t) between states (..., D) of equal width, summed over the masked positions
  (torch's CosineEmbeddingLoss with target 1; its eps 1e-8 guards zero vectors)."""
  s, t = student.astype(jnp.float32), teacher.astype(jnp.float32)
  dot = jnp.sum(s * t, axis=-1)
  norms = jnp.sqrt(jnp.sum(s * s, axis=-1) * jnp.sum(t * t, axis=-1))
  return _select(1.0 - dot / jnp.maximum(norms, 1e-8), mask)


def squared_error(student: jax.Array, teacher: jax.Array,
                  mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Sum over the last axis of (s - t)^2, summed over the masked positions; the mean squared
  error is the sum / (count * the last axis' width)."""
  diff = student.astype(jnp.float32) - teacher.astype(jnp.float32)
  return _select(jnp.sum(diff * diff, axis=-1), mask)


def layer_map(student_layers: int, teacher_layers: int) -> list[int]:
  """TinyBERT's uniform mapping: student layer m (1-based) learns from teacher layer
  g(m) = m * N / M (rounded down when M does not divide N); layer 0, the embeddings, from the
  teacher's embeddings. Example: 4 student, 12 teacher layers -> [3, 6, 9, 12]."""
  if not 1 <= student_layers <= teacher_layers:
    raise ValueError(f"a student of {student_layers} layers cannot learn layer by layer from a "
                     f"teacher of {teacher_layers}: it needs 1 to {teacher_layers} layers")
  return [m * teacher_layers // student_layers for m in range(1, student_layers + 1)]
