"""Position encodings: T5 relative bias, sinusoidal (t2t and the original Transformer's
interleaved layout), learned absolute, rotary (RoPE)."""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5lite.errors import ConfigError
from t5lite.models.config import ModelConfig


def relative_position_bucket(relative_position: jax.Array, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> jax.Array:
  """Maps key_pos - query_pos to a bucket id, exactly as Mesh TF / HF T5.

  Half the buckets are exact small distances, the rest log-spaced up to max_distance.
  Bidirectional (encoder): positive and negative offsets get separate halves.
  Causal (decoder): positive offsets (the future) collapse into bucket 0.
  Example (bidirectional, 32 buckets, 128): offsets [-1, 0, 1, 200] -> [1, 0, 17, 31].
  """
  buckets = jnp.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (relative_position > 0).astype(jnp.int32) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  # Clamp to 1 before the log: distance 0 is small anyway and must not produce -inf.
  log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
  large = max_exact + (log_ratio / math.log(max_distance / max_exact)
                       * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
  """One (buckets, heads) table per stack; returns an additive attention bias (1, H, Q, K).

  Offsets come from sequence indices, not packed `*_positions`: inside one packed segment
  the two give the same key - query offsets, and pairs across segments are masked anyway.
  `query_offset` shifts the query indices (incremental decoding): a scalar, or one offset per
  row (B,), which gives a per-row bias (B, H, Q, K).
  """
  config: ModelConfig
  bidirectional: bool

  @nn.compact
  def __call__(self, query_length: int, key_length: int, query_offset: int | jax.Array = 0):
    cfg = self.config
    init = nn.with_logical_partitioning(nn.initializers.normal(cfg.d_model ** -0.5),
                                        ("relpos_buckets", "heads"))
    table = self.param("rel_embedding", init,
                       (cfg.relative_attention_num_buckets, cfg.num_heads), cfg.storage_dtype)
    offset = jnp.asarray(query_offset, jnp.int32)
    query = jnp.arange(query_length, dtype=jnp.int32)[:, None] + offset[..., None, None]
    key = jnp.arange(key_length, dtype=jnp.int32)[None, :]
    buckets = relative_position_bucket(
        key - query, bidirectional=self.bidirectional,
        num_buckets=cfg.relative_attention_num_buckets,
        max_distance=cfg.relative_attention_max_distance)  # (Q, K) or (B, Q, K)
    bias = _gather_heads(table.astype(jnp.float32).T, buckets)  # (H, [B,] Q, K)
    return jnp.moveaxis(bias, 0, 1) if offset.ndim else bias[None]  # (B|1, H, Q, K)


@jax.custom_vjp
def _gather_heads(table_t: jax.Array, buckets: jax.Array) -> jax.Array:
  """table_t (H, buckets) gathered at bucket ids (..., Q, K) -> (H, ..., Q, K).

  Its gradient, the sums of the bias gradient per (head, bucket), is taken on the CPU as one
  flat scatter-add per head. Differentiated as a gather, XLA:CPU first copies the (H, Q, K)
  gradient into a (Q, K, H) layout for its scatter, a strided copy that took 57-85 ms of a
  T5 train step (8 x 4 x 512 x 512 scores, 2-core AMD EPYC) where the per-head scatters take
  a few. Other platforms (and TPU programs compiled on a CPU host) keep the gather's own
  gradient."""
  return jnp.take(table_t, buckets, axis=1)


def _gather_heads_fwd(table_t, buckets):
  return _gather_heads(table_t, buckets), (table_t.shape, buckets)


def _scatter_per_head(g, shape, buckets):
  ids = buckets.reshape(-1)
  return jnp.stack([jnp.zeros(shape[1], g.dtype).at[ids].add(g[h].reshape(-1))
                    for h in range(shape[0])])


def _gather_heads_bwd(res, g):
  shape, buckets = res
  return (jax.lax.platform_dependent(
      g, cpu=lambda g: _scatter_per_head(g, shape, buckets),
      default=lambda g: jnp.zeros(shape, g.dtype).at[:, buckets].add(g)), None)


_gather_heads.defvjp(_gather_heads_fwd, _gather_heads_bwd)


def add_position_bias(bias: jax.Array, position_bias: jax.Array) -> jax.Array:
  """bias (B, 1|H, Q, K) + position_bias (1|B, H, Q, K): the same sum as `bias +
  position_bias`, with a cheaper gradient for the shared (1, H, Q, K) table.

  Its gradient sums the (B, H, Q, K) attention-logit gradients over the batch. XLA:CPU runs
  that reduction over the leading axis far slower than the same sum written as B - 1
  elementwise adds (one fused loop, the same order, bitwise the same result): 70-90 ms vs
  under 1 ms for 8 x 4 x 512 x 512 on a 2-core AMD EPYC, 36 ms of a T5 train step. Other
  platforms (and TPU programs compiled on a CPU host) keep the plain reduction, which a
  sharded batch turns into a local sum and one all-reduce."""
  rows = bias.shape[0]
  # A symbolic batch (jax.export's serving programs: no gradients) keeps the plain sum.
  if position_bias.shape[0] == 1 and isinstance(rows, int) and rows > 1:
    position_bias = _shared_rows(position_bias, rows)
  return bias + position_bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _shared_rows(table: jax.Array, rows: int) -> jax.Array:
  """(1, ...) -> (rows, ...), one table seen by every row; gradient: the rows' sum."""
  return jnp.broadcast_to(table, (rows,) + table.shape[1:])


def _shared_rows_fwd(table, rows):
  return _shared_rows(table, rows), None


def _sum_rows_in_order(g: jax.Array) -> jax.Array:
  total = g[0]
  for row in range(1, g.shape[0]):
    total = total + g[row]
  return total[None]


def _shared_rows_bwd(rows, _, g):
  return (jax.lax.platform_dependent(g, cpu=_sum_rows_in_order,
                                     default=lambda g: jnp.sum(g, axis=0, keepdims=True)),)


_shared_rows.defvjp(_shared_rows_fwd, _shared_rows_bwd)


def sinusoidal_embedding(positions: jax.Array, features: int) -> jax.Array:
  """Transformer sin/cos encodings: (B, L) int positions -> (B, L, features) float32.

  First half sines, second half cosines, timescales geometric from 1 to 10,000.
  """
  half = features // 2
  inv_timescales = np.exp(-math.log(10000.0) * np.arange(half) / max(half - 1, 1))
  angles = positions[..., None].astype(jnp.float32) * inv_timescales.astype(np.float32)
  emb = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
  if features % 2:
    emb = jnp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, 1)])
  return emb


def interleaved_sinusoidal_embedding(positions: jax.Array, features: int) -> jax.Array:
  """The original Transformer's encodings, (B, L) -> (B, L, features) float32:
  PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).

  Example (d=4, pos=1): [sin(1), cos(1), sin(0.01), cos(0.01)].
  """
  half = (features + 1) // 2
  inv_timescales = np.power(10000.0, -2.0 * np.arange(half) / features).astype(np.float32)
  angles = positions[..., None].astype(jnp.float32) * inv_timescales  # (B, L, ceil(d/2))
  emb = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # (B, L, ceil(d/2), 2)
  return emb.reshape(*emb.shape[:-2], 2 * half)[..., :features]


class LearnedPositionEmbedding(nn.Module):
  """A trained (max_position_embeddings, embedding width) table looked up by position +
  config.position_offset (RoBERTa's positions start after its padding index)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, positions: jax.Array) -> jax.Array:
    cfg = self.config
    needed = positions.shape[-1] + cfg.position_offset
    if needed > cfg.max_position_embeddings:
      raise ConfigError(f"sequence length {positions.shape[-1]} (+ position_offset "
                        f"{cfg.position_offset}) exceeds max_position_embeddings="
                        f"{cfg.max_position_embeddings} of the learned position table")
    init = nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std or 0.02),
                                        (None, "embed"))
    table = self.param("embedding", init, (cfg.max_position_embeddings, cfg.embedding_width),
                       cfg.storage_dtype)
    return jnp.take(table, positions + cfg.position_offset,
                    axis=0).astype(cfg.compute_dtype)  # (B, L, E)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates query/key features (B, L, H, K) by position (B, L), rotate-half convention."""
  half = x.shape[-1] // 2
  freqs = theta ** (-np.arange(half, dtype=np.float32) / half)
  angles = positions[..., None].astype(jnp.float32) * freqs  # (B, L, K/2)
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
