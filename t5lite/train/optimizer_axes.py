"""What an optimizer declares about its state, and which params are stacks of layers.

Every optimizer t5lite makes (t5lite/train/optimizers.py) is an `Optimizer`: an optax
transformation that also declares the logical axes of its state, as T5X's optimizers do
(derive_logical_axes), so that its state is sharded as its params are. Adafactor's v_row keeps
the param's axes minus the column dims it factored, v_col minus the row dims, both taken from
`adafactor.factored_dims`, the same rule its update uses; shapes alone cannot tell
which dim of a square kernel was reduced. optax's states (AdamW's mu / nu, counts, masks,
global-norm clipping) are declared through optax.tree_map_params. Counts and (1,) placeholders
get P(). t5lite.runtime.partitioning.state_shardings maps the declared names with the params'
logical rules.

Leaves whose logical spec starts with STACKED_AXIS ('layers', ModelConfig.scan_layers) hold
every layer's param stacked; `leaf_axes` gives each leaf's axis names, matched to the params
by path, and both optimizers read it (Adafactor's per-layer statistics, AdamW's decay mask).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from t5lite.runtime.partitioning import key_name

Tree = Any
STACKED_AXIS = "layers"
"""Logical name of the leading axis of scanned (stacked) layer params."""


class Optimizer(NamedTuple):
  """An optax GradientTransformation that also declares the logical axes of its state.

  Only the optimizer knows for sure what each dim of its state is (which dims Adafactor reduced
  away, which subtrees mirror the params), so it says so, and sharding never has to guess.
  init / update are used as any optax transformation's (optax.chain accepts it too).
  """

  init: Callable[[Tree], Tree]
  update: Callable[..., tuple[Tree, Tree]]
  state_axes: Callable[[Tree], Tree]
  """params (arrays or jax.ShapeDtypeStructs) -> PartitionSpecs over logical axis names, in a
  tree shaped exactly like init(params); P() for counts, hyperparameters and placeholders."""


def leaf_axes(params: Tree, param_axes: Tree | None) -> list[tuple]:
  """Each leaf's logical axis names (flattening order of params), padded with None to its rank.

  Matched by path rather than by tree structure so that dict / FrozenDict containers mix. A
  param without axes is an error, not a guess: axes of the unscanned config given for scanned
  params would otherwise silently treat every layer stack as one matrix.
  """
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  if param_axes is None:
    return [(None,) * len(np.shape(leaf)) for _, leaf in flat]
  specs = jax.tree_util.tree_flatten_with_path(
      param_axes, is_leaf=lambda x: isinstance(x, P) or x is None)[0]
  by_path = {tuple(key_name(k) for k in path): spec for path, spec in specs}
  out = []
  for path, leaf in flat:
    name = "/".join(key_name(k) for k in path)
    key = tuple(key_name(k) for k in path)
    if key not in by_path:
      raise ValueError(f"param_axes has no logical axes for {name}: build them from the same "
                       f"ModelConfig (scan_layers included) as the params")
    spec = tuple(by_path[key]) if by_path[key] is not None else ()
    ndim = len(np.shape(leaf))
    if len(spec) > ndim:
      raise ValueError(f"logical axes {spec} of {name} have more names than its rank {ndim}")
    if STACKED_AXIS in spec[1:]:
      raise ValueError(f"{name}: the {STACKED_AXIS!r} axis must lead, got {spec}")
    out.append(spec + (None,) * (ndim - len(spec)))
  return out


def is_stacked(axes: tuple) -> bool:
  return bool(axes) and axes[0] == STACKED_AXIS


def axes_tree(params: Tree, param_axes: Tree | None) -> Tree:
  """param_axes rebuilt in params' own tree structure, each spec padded to its leaf's rank."""
  treedef = jax.tree.structure(params)
  return treedef.unflatten([P(*axes) for axes in leaf_axes(params, param_axes)])
