"""The routed MLP of a Mixture-of-Experts layer (Switch Transformers, GShard / ST-MoE top-k).

    x (B, L, D) -> router logits (B, L, E) in float32 -> top-k experts and their probabilities
    -> each expert takes its first `capacity` tokens of each sequence (the first choices of
       every token before any second choice, then sequence order) -> the experts' MLPs
    -> their outputs weighted by the router probabilities; a token no expert took gets 0 (the
       residual alone carries it)

Dispatch and combine are gathers of rows (each slot's token, each token's slots), not T5X's
one-hot einsums over (token, expert, slot), which cost B x L x E x C x D multiply-adds each (on
a CPU more than the experts themselves at small sizes). With the expert kernels' leading
`expert` axis on a mesh axis, the reshard of the slots between two sharding constraints is the
all-to-all of expert parallelism. The module sows, per sparse layer, its router logits, the
number of token choices per expert and how many of them an expert took, into the `router`
collection (t5lite.models.moe.losses turns those into the losses and metrics).

Params of a sparse layer's `mlp`: router (D, E); wi (or wi_0 and wi_1) (E, D, F); wo (E, F, D). Example (E=4, top-1, capacity 2, one sequence choosing experts
[0, 0, 0, 1]): the third token is dropped (expert 0 is full), the others each go to theirs.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite.models.config import ModelConfig
from t5lite.models.layers import ACTIVATION_FNS

ROUTER = "router"
"""The variable collection the sparse layers sow their router outputs into."""


class Routing(NamedTuple):
  position: jax.Array  # (B, L, k) int32: the slot e * C + c a choice holds; E * C: dropped
  gates: jax.Array  # (B, L, k) float32: its router probability (0 when dropped)
  load: jax.Array  # (E,) float32: token choices per expert (before capacity)
  kept: jax.Array  # () float32: choices an expert took


def top_k_experts(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(values, indices) of the k largest entries of the last axis, as lax.top_k (ties: the
  lower index first), by k rounds of argmax: a sort, which top_k lowers to, is gathered
  whole onto every device under GSPMD, where an argmax stays with its batch shard."""
  values, indices, remaining = [], [], probs
  for _ in range(k):
    index = jnp.argmax(remaining, axis=-1)
    values.append(jnp.take_along_axis(probs, index[..., None], axis=-1)[..., 0])
    indices.append(index)
    remaining = jnp.where(jax.nn.one_hot(index, probs.shape[-1], dtype=bool), -jnp.inf,
                          remaining)
  return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1).astype(jnp.int32)


def route(logits: jax.Array, top_k: int, capacity: int) -> Routing:
  """Tokens choose their top-k experts; each expert keeps the first `capacity` choices of
  each sequence, first choices before second ones (T5X's priority), in sequence order
  within each (HF's cumulative sum over the sequence). logits (B, L, E) float32."""
  batch, length, experts = logits.shape
  probs = jax.nn.softmax(logits, axis=-1)
  gates, chosen = top_k_experts(probs, top_k)  # (B, L, k): ties go to the lower expert id
  choice = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # (B, L, k, E)
  by_priority = jnp.swapaxes(choice, 1, 2).reshape(batch, top_k * length, experts)
  slot = jnp.cumsum(by_priority, axis=1) * by_priority  # 1-based slot in the chosen expert
  slot = jnp.swapaxes(slot.reshape(batch, top_k, length, experts), 1, 2)  # (B, L, k, E)
  slot = jnp.sum(slot, axis=-1) - 1  # (B, L, k): 0-based slot in the chosen expert
  kept = slot < capacity
  position = jnp.where(kept, chosen * capacity + slot, experts * capacity)
  return Routing(position.astype(jnp.int32), jnp.where(kept, gates, 0.0),
                 jnp.sum(choice, axis=(0, 1, 2)).astype(jnp.float32),
                 jnp.sum(kept).astype(jnp.float32))


def dispatch(x: jax.Array, position: jax.Array, slots: int) -> jax.Array:
  """The tokens in their slots: (B, L, D) -> (B, slots, D), empty slots 0 (a gather of each
  slot's token; positions >= slots are dropped choices)."""
  batch, length, _ = x.shape
  tokens = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[:, None], position.shape[1:])
  # Which token each slot holds (length: none), one scatter per row; the extra slot takes
  # the dropped choices.
  holder = jax.vmap(lambda p: jnp.full((slots + 1,), length, jnp.int32)
                    .at[p.reshape(-1)].set(tokens.reshape(-1)))(position)[:, :slots]
  padded = jnp.pad(x, ((0, 0), (0, 1), (0, 0)))  # row `length`: zeros
  return jnp.take_along_axis(padded, holder[:, :, None], axis=1)


def combine(slotted: jax.Array, routing: Routing) -> jax.Array:
  """Each token's experts' outputs weighted by their gates: (B, slots, D) -> (B, L, D)."""
  batch, length, top_k = routing.position.shape
  padded = jnp.pad(slotted, ((0, 0), (0, 1), (0, 0)))  # the dropped choices read zeros
  rows = jnp.take_along_axis(padded, routing.position.reshape(batch, -1)[:, :, None], axis=1)
  rows = rows.reshape(batch, length, top_k, -1)
  return jnp.einsum("blkd,blk->bld", rows, routing.gates.astype(rows.dtype))


class RoutedMlp(nn.Module):
  """A sparse layer's MLP: `num_experts` MLPs of the model's shape behind a top-k router."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg, moe = self.config, self.config.moe
    d, f, e = cfg.d_model, cfg.d_ff, moe.num_experts
    training = not self.deterministic
    router = self.param("router", nn.with_logical_partitioning(
        nn.initializers.normal(cfg.init_std or (0.1 / d) ** 0.5), ("embed", None)),
        (d, e), cfg.storage_dtype)
    hidden = x.astype(jnp.float32)  # selective precision: the router always runs in float32
    if training and moe.jitter_noise > 0:
      noise = jax.random.uniform(self.make_rng("dropout"), hidden.shape, jnp.float32,
                                 1.0 - moe.jitter_noise, 1.0 + moe.jitter_noise)
      hidden = hidden * noise
    logits = jnp.einsum("bld,de->ble", hidden, router.astype(jnp.float32))
    capacity = moe.capacity(x.shape[1], training)
    routing = route(logits, moe.top_k, capacity)
    self.sow(ROUTER, "logits", logits)
    self.sow(ROUTER, "load", routing.load)
    self.sow(ROUTER, "kept", routing.kept)

    def kernel(name, shape, axes, stddev):
      init = nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std or stddev), axes)
      return self.param(name, init, shape, cfg.storage_dtype).astype(cfg.compute_dtype)

    dtype = cfg.compute_dtype
    slots = e * capacity
    # Dispatch where the tokens are (each device its rows, every expert's slots), then move
    # the slots to the devices that hold their experts: the reshard between the two
    # constraints is the all-to-all of expert parallelism (and its mirror after the experts).
    slotted = dispatch(x.astype(dtype), routing.position, slots)  # (B, E * C, D)
    expert_in = jnp.swapaxes(slotted.reshape(x.shape[0], e, capacity, d), 0, 1)  # (E, B, C, D)
    expert_in = nn.with_logical_constraint(expert_in, (None, "batch", None, "embed"))
    expert_in = nn.with_logical_constraint(expert_in, ("expert", "batch", None, "embed"))
    act = ACTIVATION_FNS[cfg.mlp_activation]
    wi_axes, wo_axes = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
    if cfg.gated_mlp:
      h = act(jnp.einsum("ebcd,edf->ebcf", expert_in, kernel("wi_0", (e, d, f), wi_axes,
                                                              d ** -0.5)))
      h = h * jnp.einsum("ebcd,edf->ebcf", expert_in, kernel("wi_1", (e, d, f), wi_axes,
                                                              d ** -0.5))
    else:
      h = act(jnp.einsum("ebcd,edf->ebcf", expert_in, kernel("wi", (e, d, f), wi_axes,
                                                            d ** -0.5)))
    h = nn.with_logical_constraint(h, ("expert", "batch", None, "mlp"))
    h = nn.Dropout(moe.dropout(cfg.dropout_rate))(h, deterministic=self.deterministic)
    expert_out = jnp.einsum("ebcf,efd->ebcd", h, kernel("wo", (e, f, d), wo_axes, f ** -0.5))
    expert_out = nn.with_logical_constraint(expert_out, ("expert", "batch", None, "embed"))
    expert_out = nn.with_logical_constraint(expert_out, (None, "batch", None, "embed"))
    # HF scales the expert output by its router probability in the activation dtype.
    y = combine(jnp.swapaxes(expert_out, 0, 1).reshape(x.shape[0], slots, d), routing)
    return y.astype(dtype)

