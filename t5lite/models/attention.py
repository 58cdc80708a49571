"""Attention masks and multi-head dot-product attention (T5 style: no 1/sqrt(d) scaling).

Masks are boolean (B, Q, K) arrays, True where a query may attend to a key, turned into
one additive bias. Packing is expressed with segment ids: 1-based per example, 0 = padding.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite.models.config import ModelConfig
from t5lite.models.layers import Dense
from t5lite.models.positions import apply_rope

# Large enough to zero a softmax weight, small enough to stay finite in float32 sums.
MASK_VALUE = -1e10


def segment_mask(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
  """Same-segment, non-padding pairs. (B, Q), (B, K) -> (B, Q, K) bool.

  Example: q = k = [[1, 1, 2, 0]] gives rows [1 1 0 0], [1 1 0 0], [0 0 1 0], [0 0 0 0].
  """
  same = query_segments[:, :, None] == key_segments[:, None, :]
  return same & (key_segments[:, None, :] > 0)


def causal_mask(length: int) -> jax.Array:
  """(1, L, L) bool, True where key index <= query index."""
  idx = jnp.arange(length)
  return (idx[None, :] <= idx[:, None])[None]


def prefix_lm_mask(causal_attention: jax.Array) -> jax.Array:
  """Causal mask opened up bidirectionally among prefix positions.

  causal_attention (B, L) is 1 on the prefix (the inputs of a prefix LM), 0 elsewhere.
  Example: [[1, 1, 0]] -> rows [1 1 0], [1 1 0], [1 1 1].
  """
  prefix = causal_attention.astype(bool)
  return causal_mask(prefix.shape[-1]) | (prefix[:, :, None] & prefix[:, None, :])


def mask_to_bias(mask: jax.Array) -> jax.Array:
  """(B, Q, K) bool -> (B, 1, Q, K) float32 additive bias, broadcast over heads."""
  return jnp.where(mask, 0.0, MASK_VALUE).astype(jnp.float32)[:, None]


class MultiHeadAttention(nn.Module):
  """Multi-head attention from x_q over x_kv with an additive float32 bias (B|1, H|1, Q, K).

  T5 folds the 1/sqrt(d_kv) scaling into the query initializer, so logits are unscaled.
  """
  config: ModelConfig
  deterministic: bool = True
  rotary: bool = True
  """Rotate queries and keys when the config uses 'rope' (off for cross-attention)."""

  @nn.compact
  def __call__(self, x_q: jax.Array, x_kv: jax.Array, bias: jax.Array,
               q_positions: jax.Array | None = None,
               kv_positions: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    d, h, k = cfg.d_model, cfg.num_heads, cfg.d_kv
    dtypes = dict(dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)
    heads_axes = ("embed", "heads", "kv")
    query = Dense((d,), (h, k), heads_axes, (d * k) ** -0.5, name="query", **dtypes)(x_q)
    key = Dense((d,), (h, k), heads_axes, d ** -0.5, name="key", **dtypes)(x_kv)
    value = Dense((d,), (h, k), heads_axes, d ** -0.5, name="value", **dtypes)(x_kv)
    if cfg.position_encoding == "rope" and self.rotary:
      query = apply_rope(query, q_positions, cfg.rope_theta)
      key = apply_rope(key, kv_positions, cfg.rope_theta)
    constrain = lambda t: nn.with_logical_constraint(t, ("batch", "length", "heads", "kv"))
    query, key, value = constrain(query), constrain(key), constrain(value)  # (B, L, H, K)

    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) + bias
    weights = jax.nn.softmax(logits, axis=-1).astype(cfg.compute_dtype)  # (B, H, Q, K)
    weights = nn.Dropout(cfg.dropout_rate)(weights, deterministic=self.deterministic)
    out = constrain(jnp.einsum("bhqk,bkhd->bqhd", weights, value))  # (B, Q, H, K)
    return Dense((h, k), (d,), ("heads", "kv", "embed"), (h * k) ** -0.5, name="out",
                 **dtypes)(out)  # (B, Q, D)
