"""Attention masks and multi-head dot-product attention (T5: unscaled logits; BERT, GPT-2 and
LLaMA scale by 1/sqrt(d_kv); grouped-query attention shares key/value heads).

Masks are boolean (B, Q, K) arrays, True where a query may attend to a key, turned into
one additive bias. Packing is expressed with segment ids: 1-based per example, 0 = padding.
"""
from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5lite.models import adapters, attention_kernels
from t5lite.models.attention_kernels import MASK_VALUE
from t5lite.models.config import ModelConfig
from t5lite.models.kernels.softmax_values import softmax_values
from t5lite.models.layers import dense
from t5lite.models.positions import add_position_bias, apply_rope


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


def cache_mask(positions: jax.Array, cache_length: int,
               causal_attention: jax.Array | None = None) -> jax.Array:
  """Incremental decoding: which cache slots the queries at `positions` (B, Q) may see.

  Slot j holds the key of position j, so a query sees slots j <= its position (later slots
  are unwritten or stale). causal_attention (B, Q), given for a prefix-LM prompt written from
  slot 0, also opens the prompt's slots to each other. Returns (B, Q, cache_length) bool.
  Example: positions [[2]], cache_length 4 -> [[[1 1 1 0]]].
  """
  slots = jnp.arange(cache_length, dtype=jnp.int32)
  mask = slots[None, None, :] <= positions[:, :, None]
  if causal_attention is not None:
    prefix = causal_attention.astype(bool)
    prefix_slots = jnp.pad(prefix, ((0, 0), (0, cache_length - prefix.shape[1])))
    mask = mask | (prefix[:, :, None] & prefix_slots[:, None, :])
  return mask


def with_prompt(mask: jax.Array, key_valid: jax.Array, n: int, *, causal: bool) -> jax.Array:
  """A token mask (B|1, Q, K) with prompt tuning's n soft tokens in front of queries and
  keys: (B, n + Q, n + K). Every token query sees the prompt. The prompt's queries see each
  other (causal: the earlier ones only) and, in a bidirectional stack, every valid key
  (key_valid (B, K), as HF's attention mask with peft's ones prepended).
  Example: n = 1, causal, mask [[1 0] [1 1]] -> [[1 0 0] [1 1 0] [1 1 1]]."""
  rows, q, k = max(mask.shape[0], key_valid.shape[0]), mask.shape[1], mask.shape[2]
  prompt = causal_mask(n) if causal else jnp.ones((1, n, n), bool)
  later = (jnp.zeros((rows, n, k), bool) if causal
           else jnp.broadcast_to(key_valid[:, None, :], (rows, n, k)))
  top = jnp.concatenate([jnp.broadcast_to(prompt, (rows, n, n)), later], axis=2)
  bottom = jnp.concatenate([jnp.ones((rows, q, n), bool),
                            jnp.broadcast_to(mask, (rows, q, k))], axis=2)
  return jnp.concatenate([top, bottom], axis=1)


def fold_rows_into_queries(query: jax.Array, bias: jax.Array, fold: int):
  """Rows b*fold .. b*fold + fold - 1 of query (B*fold, Q, H, K) -> row b of (B, fold*Q, H, K),
  and the bias (B*fold | 1, H|1, Q, S) to match, (B | 1, H|1, fold*Q, S). Cross-attention
  then reads each encoder row's keys and values once for all its beams: fewer bytes per
  step than a copy per beam, and the same numbers."""
  rows, length = query.shape[0] // fold, query.shape[1]
  query = query.reshape(rows, fold * length, *query.shape[2:])
  if bias.shape[0] == 1:
    return query, jnp.tile(bias, (1, 1, fold, 1))
  bias = bias.reshape(rows, fold, *bias.shape[1:])  # (B, fold, H|1, Q, S)
  bias = jnp.swapaxes(bias, 1, 2).reshape(rows, bias.shape[2], fold * length, bias.shape[-1])
  return query, bias


def mask_to_bias(mask: jax.Array) -> jax.Array:
  """(B, Q, K) bool -> (B, 1, Q, K) float32 additive bias, broadcast over heads."""
  return jnp.where(mask, 0.0, MASK_VALUE).astype(jnp.float32)[:, None]


@flax.struct.dataclass
class SegmentBias:
  """An attention bias kept in its parts: a same-segment (optionally causal) mask from segment
  ids, plus an optional position table shared by the batch. The 'pallas' implementation
  hands the parts to a kernel that builds the mask on chip and keeps the table's gradient
  one (H, Q, K) sum (attention_kernels.segment_attention); every other path reads `dense()`,
  the same (B, 1|H, Q, K) bias the stacks build for it."""
  query_segments: jax.Array  # (B, Q) int, 0 = padding
  key_segments: jax.Array  # (B, K)
  table: jax.Array | None = None  # (1, H, Q, K) float32
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  def dense(self) -> jax.Array:
    mask = segment_mask(self.query_segments, self.key_segments)
    if self.causal:
      mask = mask & causal_mask(mask.shape[-1])
    bias = mask_to_bias(mask)
    return bias if self.table is None else add_position_bias(bias, self.table)


def with_position_bias(bias, table: jax.Array):
  """bias (B, 1, Q, K) or a SegmentBias, with the shared position table (1, H, Q, K) added."""
  if isinstance(bias, SegmentBias):
    return bias.replace(table=table)
  return add_position_bias(bias, table)


def dense_bias(bias) -> jax.Array:
  return bias.dense() if isinstance(bias, SegmentBias) else bias


INTERMEDIATES = "intermediates"
"""The variable collection that holds what a model sows for distillation (hidden states,
attention scores); apply(..., mutable=[INTERMEDIATES]) fills it, otherwise sowing is free."""
ATTENTION_OUTPUT = "attention"
"""The name (jax.ad_checkpoint.checkpoint_name) of the heads' output before the out projection."""
SAVED_NAMES = ("query", "key", "value", ATTENTION_OUTPUT, "out")
"""What remat 'save_attention' keeps (t5lite.models.transformer.REMAT_POLICIES): the heads'
output and the projections' products, which layers.Dense names after their modules below."""


class MultiHeadAttention(nn.Module):
  """Multi-head attention from x_q over x_kv with an additive float32 bias (B|1, H|1, Q, K).

  T5 folds the 1/sqrt(d_kv) scaling into the query initializer, so logits are unscaled;
  config.scale_attention scales them instead. With config.num_key_value_heads, keys and values
  have fewer heads, each serving num_heads / num_key_value_heads consecutive query heads (HF's
  repeat_kv order); the cache holds the fewer heads.
  """
  config: ModelConfig
  deterministic: bool = True
  rotary: bool = True
  """Rotate queries and keys when the config uses 'rope' (off for cross-attention)."""
  cache: str | None = None
  """Incremental decoding (None in training). 'self': keys and values of this call are written
  into the 'cache' collection (cache_length slots, slot = position in q_positions) and the
  queries attend over all slots, the bias masking the unwritten ones. 'cross': x_kv is
  projected on the first call only (when the cache is empty) and reused by later steps."""
  cache_length: int = 0
  """Slots of a 'self' cache: the longest sequence (prompt + output) one decode can reach."""

  @nn.compact
  def __call__(self, x_q: jax.Array, x_kv: jax.Array, bias: jax.Array | SegmentBias,
               q_positions: jax.Array | None = None,
               kv_positions: jax.Array | None = None) -> jax.Array:
    cfg = self.config
    if self.cache or adapters.prefix_slots(cfg):  # decoding and prefix tuning edit the bias
      bias = dense_bias(bias)
    d, h, k, kvh = cfg.d_model, cfg.num_heads, cfg.d_kv, cfg.kv_heads
    heads_axes = ("embed", "heads", "kv")
    # Grouped key/value heads are few (often fewer than the tensor axis): their own logical
    # axis, which the rules replicate, as MaxText does.
    kv_axes = heads_axes if kvh == h else ("embed", "kv_heads", "kv")
    query_std = d ** -0.5 if cfg.scale_attention else (d * k) ** -0.5
    query = dense(cfg, (d,), (h, k), heads_axes, query_std, "query")(x_q)
    if cfg.scale_attention:
      query = query * jnp.asarray(k ** -0.5, query.dtype)
    cross_cached = self.cache == "cross" and self.has_variable("cache", "cached_key")
    if cross_cached:  # decoding steps: the encoder's keys and values were projected at prefill
      key = self.get_variable("cache", "cached_key")
      value = self.get_variable("cache", "cached_value")
    else:
      key = dense(cfg, (d,), (kvh, k), kv_axes, d ** -0.5, "key")(x_kv)
      value = dense(cfg, (d,), (kvh, k), kv_axes, d ** -0.5, "value")(x_kv)
    if cfg.position_encoding == "rope" and self.rotary:
      shift = adapters.prefix_slots(cfg)  # prefix tuning: tokens sit after the prefix
      query = apply_rope(query, q_positions + shift, cfg.rope_theta)
      key = apply_rope(key, kv_positions + shift, cfg.rope_theta)
    out_projection = dense(cfg, (h, k), (d,), ("heads", "kv", "embed"), (h * k) ** -0.5, "out")

    def project(heads_out):  # (B, Q, H x K) -> (B, Q, D)
      # Named as (B, Q, H x K), the layout the kernel writes: a saved (B, Q, H, 64) array
      # would take a TPU's padded 128-lane layout and a copy into it and back.
      named = checkpoint_name(heads_out, ATTENTION_OUTPUT)
      return out_projection(named.reshape(named.shape[:2] + (h, k)))

    if (isinstance(bias, SegmentBias) and self._kernel(query, key) == "pallas"
        and not attention_kernels.segment_refusal(query, key)):
      return project(self._segment_attention(query, key, value, bias))
    constrain = lambda t, heads="heads": nn.with_logical_constraint(
        t, ("batch", "length", heads, "kv"))
    kv_heads = "heads" if kvh == h else "kv_heads"
    query = constrain(query)  # (B, L, H, K)
    key, value = constrain(key, kv_heads), constrain(value, kv_heads)  # (B, L, kvh, K)
    if self.cache == "self":
      key, value = self._append_to_cache(key, value, q_positions)  # (B, cache_length, H, K)
    elif self.cache == "cross" and not cross_cached:
      self.put_variable("cache", "cached_key", key)
      self.put_variable("cache", "cached_value", value)
    if adapters.prefix_slots(cfg):  # prefix tuning: trained keys and values before these
      key, value, bias = self._with_prefix(key, value, bias, kv_axes)
    # Beam search: x_q may hold `fold` beams per x_kv row; they share the encoder's K/V.
    fold = query.shape[0] // key.shape[0] if self.cache == "cross" else 1
    if fold > 1:
      query, bias = fold_rows_into_queries(query, bias, fold)
    kernel = self._kernel(query, key)
    if kernel == "cudnn":
      out = constrain(attention_kernels.fused_attention(query, key, value, dense_bias(bias)))
    elif kernel == "pallas":
      out = constrain(attention_kernels.platform_attention(query, key, value, dense_bias(bias)))
    else:
      out = constrain(self._xla_attention(query, key, value, dense_bias(bias)))  # (B, Q, H, K)
    if fold > 1:
      out = out.reshape(out.shape[0] * fold, -1, *out.shape[2:])  # (B*fold, Q, H, K)
    return project(out.reshape(out.shape[:2] + (-1,)))

  def _segment_attention(self, query, key, value, bias):
    """t5lite's shared-bias kernel on the heads side by side, (B, L, H x K): the layout the
    projections' 2-D matmuls write and the out projection reads, so neither the (B, L, H, K)
    arrays (whose 64-wide minor dim a TPU pads to 128 lanes) nor a transpose is made."""
    heads = query.shape[2]
    flat = lambda t: nn.with_logical_constraint(  # noqa: E731
        t.reshape(t.shape[:2] + (-1,)), ("batch", "length", "heads"))
    key, value = (attention_kernels.every_head(t, heads) for t in (key, value))
    return flat(attention_kernels.platform_segment_attention(
        flat(query), flat(key), flat(value), bias, heads))

  def _kernel(self, query, key) -> str:
    """'cudnn', 'pallas' or 'xla': the kernel of this call (attention_kernels says when)."""
    cfg = self.config
    kernel = attention_kernels.resolve(cfg.attention_implementation, cfg.compute_dtype)
    if kernel == "xla":
      return kernel
    refusal = {"cudnn": attention_kernels.cudnn_refusal,
               "pallas": attention_kernels.pallas_refusal}[kernel](
        query, key, dropout=cfg.dropout_rate > 0 and not self.deterministic,
        reads_scores=self.is_mutable_collection(INTERMEDIATES))
    return "xla" if refusal else kernel

  def _xla_attention(self, query, key, value, bias):
    """Two einsums around a float32 softmax, with dropout on the weights; without dropout,
    softmax_values (the same core with fewer passes over the weights on the CPU)."""
    cfg = self.config
    logits = attention_kernels.attention_logits(query, key, bias)  # (B, H, Q, K)
    # Distillation (TinyBERT) reads the pre-softmax scores; a no-op unless asked for.
    self.sow(INTERMEDIATES, "attention_scores", logits)
    if self.deterministic or cfg.dropout_rate == 0:
      return softmax_values(logits, attention_kernels.every_head(value, logits.shape[1]))
    weights = jax.nn.softmax(logits, axis=-1).astype(cfg.compute_dtype)
    weights = nn.Dropout(cfg.dropout_rate)(weights, deterministic=self.deterministic)
    return attention_kernels.weighted_values(weights, value)

  def _with_prefix(self, key, value, bias, axes):
    """Prefix tuning's n trained keys and values (n, kv heads, K) before key and value (B, S,
    kv heads, K), seen by every query: no position (no rotation, no relative bias), as
    peft's past key values. The bias gets n zero columns in front."""
    n, (_, kvh, k) = adapters.prefix_slots(self.config), key.shape[1:]
    init = nn.with_logical_partitioning(nn.initializers.normal(1.0), (None,) + tuple(axes[1:]))
    out = []
    for name, states in ((adapters.PREFIX_KEY, key), (adapters.PREFIX_VALUE, value)):
      prefix = adapters.adapter_param(self, name, init, (n, kvh, k))
      prefix = adapters.rows_of(prefix.astype(states.dtype), states.shape[0], 3)
      out.append(jnp.concatenate([prefix, states], axis=1))
    bias = jnp.pad(bias, ((0, 0),) * (bias.ndim - 1) + ((n, 0),))
    return out[0], out[1], bias

  def _append_to_cache(self, key, value, positions):
    """Writes key/value (B, Q, H, K) at slots positions[b, 0] .. + Q - 1 of each row's cache
    and returns the whole caches (B, cache_length, H, K). Rows may sit at different positions
    (decoder-only prompts of different lengths)."""
    shape = (key.shape[0], self.cache_length) + key.shape[2:]
    # One slice update per row: XLA makes it a scatter that updates the cache in place.
    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(
        cache, new, start, axis=0))
    out = []
    for name, new in (("cached_key", key), ("cached_value", value)):
      cache = self.variable("cache", name, jnp.zeros, shape, new.dtype)
      cache.value = write(cache.value, new, positions[:, 0])
      out.append(cache.value)
    return tuple(out)
