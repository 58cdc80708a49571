"""Creating parameters: concrete or abstract (shapes only), with their logical axis names."""
from __future__ import annotations

from typing import Any

import functools

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util

from t5lite.models.config import ModelConfig
from t5lite.models.network import make_model

Params = Any  # a nested dict of arrays, as Flax returns under 'params'


def init_boxed(module: nn.Module, inputs: dict[str, jax.Array], rng: jax.Array):
  """module.init's params, still wrapped in nn.LogicallyPartitioned boxes that carry axis
  names (nn.unbox strips them, nn.get_partition_spec reads them)."""
  return module.init({"params": rng}, **inputs)["params"]


def _init_boxed(config: ModelConfig, rng: jax.Array):
  model = make_model(config)
  return init_boxed(model, type(model).dummy_inputs(config), rng)


def init_params(config: ModelConfig, rng: jax.Array | int = 0) -> Params:
  """Randomly initialized params (plain arrays) for a config."""
  if isinstance(rng, int):
    rng = jax.random.key(rng)
  return nn.unbox(jax.jit(_init_boxed, static_argnums=0)(config, rng))


def unbox_shapes(boxed) -> Params:
  """eval_shape'd boxed params -> plain ShapeDtypeStructs. Not nn.unbox: under an active mesh
  and axis rules (the trainer's) it constrains each leaf's sharding, which a shape cannot
  take (JAX raises a TypeError)."""
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
  return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, boxed,
                      is_leaf=is_box)


@functools.lru_cache(maxsize=64)
def _abstract_boxed(config: ModelConfig):
  """The boxed init's shapes, traced once per config (a frozen dataclass)."""
  return jax.eval_shape(functools.partial(_init_boxed, config), jax.random.key(0))


def abstract_params(config: ModelConfig) -> Params:
  """Params as jax.ShapeDtypeStructs, without allocating or computing anything (also under
  an active mesh)."""
  return unbox_shapes(_abstract_boxed(config))


def param_logical_axes(config: ModelConfig) -> Params:
  """Params tree of PartitionSpecs over logical axis names, e.g. P('embed', 'heads', 'kv')."""
  return nn.get_partition_spec(_abstract_boxed(config))


def count_params(params_or_config: Params | ModelConfig) -> int:
  """Number of scalars in a params tree (or in the params a config would create)."""
  tree = params_or_config
  if isinstance(tree, ModelConfig):
    tree = abstract_params(tree)
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


def unscan_params(params: Params) -> Params:
  """Scanned layout (stack/layers/... with a leading layer axis) -> layers_0, layers_1, ..."""
  out = dict(params)
  for stack in ("encoder", "decoder"):
    if stack in out and "layers" in out[stack]:
      stack_params = dict(out[stack])
      stacked = traverse_util.flatten_dict(stack_params.pop("layers"))
      n = next(iter(stacked.values())).shape[0]
      for i in range(n):
        stack_params[f"layers_{i}"] = traverse_util.unflatten_dict(
            {k: v[i] for k, v in stacked.items()})
      out[stack] = stack_params
  return out


def scan_params(params: Params, config: ModelConfig) -> Params:
  """Inverse of unscan_params, for a config with scan_layers=True."""
  out = dict(params)
  for stack, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    if stack in out and "layers_0" in out[stack]:
      stack_params = dict(out[stack])
      layers = [traverse_util.flatten_dict(stack_params.pop(f"layers_{i}")) for i in range(n)]
      stack_params["layers"] = traverse_util.unflatten_dict(
          {k: np.stack([layer[k] for layer in layers]) for k in layers[0]})
      out[stack] = stack_params
  return out
