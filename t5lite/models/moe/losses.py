"""Router losses and routing figures of a Mixture-of-Experts model, from what its sparse
layers sowed into the `router` collection (t5lite.models.moe.layer).

Per layer (T5X's and HF's formulas, groups = sequences):
  z-loss    mean over tokens of logsumexp(router logits)^2
  aux loss  E^2 * mean over (sequence, expert) of f * P, f: the fraction of the sequence's
            tokens that chose the expert among their top-k (top-1: the argmax of the raw
            logits), P: the sequence's mean router probability of the expert
MoeConfig.router_losses picks the set they are taken over: 'per_layer' sums them over the
sparse layers; 'pooled' concatenates each stack's router logits along the sequence first and
sums the stacks, giving HF's encoder_z_loss + decoder_z_loss (and aux), 0 for a stack whose
sparse step is <= 1, as in HF. The training loss adds aux_loss_coef * aux + z_loss_coef * z.

Figures a step logs: router_z_loss, router_aux_loss (unweighted), dropped_fraction (token
choices no expert had room for) and expert_load_<e> (expert e's share of the choices,
1 / num_experts when balanced), over every sparse layer.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import traverse_util

from t5lite.models.config import ModelConfig
from t5lite.models.moe.layer import top_k_experts


def _layers(router_state: Mapping) -> list[tuple[tuple, str, int, dict]]:
  """(network, stack, layer index, {'logits', 'load', 'kept'}) of each sparse layer, encoder
  before decoder. network: the path above the stack (() for one network; ELECTRA's
  ('generator',) and ('discriminator',))."""
  flat = traverse_util.flatten_dict(dict(router_state))
  layers: dict[tuple, dict] = {}
  for path, value in flat.items():
    *where, name = path
    at = next(i for i, p in enumerate(where) if p.startswith("layers_"))
    network, stack = tuple(where[:at - 1]), where[at - 1]
    key = (network, stack != "encoder", stack, int(where[at].split("_")[1]))
    layers.setdefault(key, {})[name] = value[0]  # sow keeps a tuple
  return [(network, stack, i, layers[(network, late, stack, i)])
          for network, late, stack, i in sorted(layers)]


def z_loss(logits: jax.Array) -> jax.Array:
  """mean(logsumexp(logits)^2) over every token of (B, L, E) logits."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def load_balancing_loss(logits: jax.Array, top_k: int) -> jax.Array:
  """E^2 * mean over (B, E) of f * P (see the module docstring); logits (B, L, E)."""
  experts = logits.shape[-1]
  probs = jax.nn.softmax(logits, axis=-1)
  _, chosen = top_k_experts(logits, top_k)
  routed = jnp.max(jax.nn.one_hot(chosen, experts, dtype=jnp.float32), axis=-2)  # (B, L, E)
  return jnp.mean(jnp.mean(routed, axis=1) * jnp.mean(probs, axis=1)) * experts ** 2


def router_loss_sums(config: ModelConfig, router_state: Mapping, weight: jax.Array
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(what the weighted loss sum gains, figure sums) for one (micro)batch. weight: the
  batch's share of the loss normalizer, so that the step's loss gains the coefficients times
  the router losses once it divides by the whole normalizer."""
  moe = config.moe
  layers = _layers(router_state)
  if moe.router_losses == "pooled":
    groups = []
    for network in dict.fromkeys(n for n, _, _, _ in layers):
      for stack in ("encoder", "decoder"):
        logits = [v["logits"] for n, s, _, v in layers if (n, s) == (network, stack)]
        if logits and moe.sparse_step(stack) > 1:
          groups.append(jnp.concatenate(logits, axis=1))
  else:
    groups = [v["logits"] for _, _, _, v in layers]
  z = sum((z_loss(g) for g in groups), jnp.zeros((), jnp.float32))
  aux = sum((load_balancing_loss(g, moe.top_k) for g in groups), jnp.zeros((), jnp.float32))
  load = sum(v["load"] for _, _, _, v in layers)  # (E,) token choices per expert
  choices = jnp.sum(load)
  kept = sum(v["kept"] for _, _, _, v in layers)
  sums = {"router_z_loss": z * weight, "router_aux_loss": aux * weight,
          "router_choices": choices, "router_kept": kept,
          **{f"expert_load_{e}": load[e] for e in range(moe.num_experts)}}
  return (moe.aux_loss_coef * aux + moe.z_loss_coef * z) * weight, sums


def router_metrics(config: ModelConfig, sums: Mapping[str, Any], normalizer) -> dict:
  """The step's (or an eval split's) routing figures from summed router_loss_sums sums."""
  choices = jnp.maximum(sums["router_choices"], 1.0)
  return {"router_z_loss": sums["router_z_loss"] / normalizer,
          "router_aux_loss": sums["router_aux_loss"] / normalizer,
          "dropped_fraction": 1.0 - sums["router_kept"] / choices,
          **{f"expert_load_{e}": sums[f"expert_load_{e}"] / choices
             for e in range(config.moe.num_experts)}}
