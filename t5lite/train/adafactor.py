"""T5X's Adafactor, with scanned layers handled one layer at a time.

    tx = adafactor(schedule, param_logical_axes(model_config))   # an optimizer_axes.Optimizer
    (make_optimizer(OptimizerConfig(name="adafactor"), ...) in t5lite/train/optimizers.py
    builds it from a run's config, behind global-norm clipping)

Why not optax.adafactor. Adafactor's statistics are per *matrix*: the factored second moment
keeps one row vector and one column vector per weight matrix, update clipping divides by the RMS
of the whole update of one parameter, and parameter scaling multiplies by the RMS of one
parameter. optax.adafactor decides all three from the array shape alone, and with
`ModelConfig.scan_layers` every layer parameter is a stack (layers, ...) of the matrices of all
layers. Then optax clips and scales by the RMS over all layers at once and factors whichever two
dims are largest (or nothing), so a scanned model trains differently from the same model
unrolled. T5X solves this with logical factor rules (`factor_map`, 'layers' -> BATCH). Here the
same is done by running the per-parameter Adafactor under jax.vmap over the leading axis of every
leaf whose logical spec starts with 'layers': each layer's slice sees exactly the computation the
unrolled layer would see, so scanned and unrolled updates agree layer by layer.

Which dims are factored (per layer, i.e. after the 'layers' axis is removed):
- rank 2: both dims (the "row" / "column" naming does not matter: the estimate
  v_row (x) v_col / mean(v_row) is symmetric), when the smaller one is >= min_dim_size_to_factor.
  This is T5X's heuristic rule, which it applies to every rank <= 2 parameter.
- rank > 2, e.g. attention kernels (embed, heads, kv) and out (heads, kv, embed): 'embed' is the
  row side and every other axis (heads, kv, mlp, vocab) the column side, as in T5X's
  standard_logical_factor_rules. The statistics are v_row over embed and v_col over (heads, kv),
  the same numbers as factoring the (embed, heads*kv) matrix. T5X's own T5 layers store exactly
  that 2-D (embed, joined_kv) kernel and reshape it on use, so this reproduces T5X's optimizer
  on T5X's layout; optax would instead factor (embed, kv) with heads as a batch dim, or nothing
  at all when d_kv < 128. The min_dim_size_to_factor test is made on that 2-D view too.
  A rank > 2 parameter whose axes are not all row/column names is not factored.
- rank < 2: not factored (a full second moment, as small as the parameter).
One deliberate difference from T5X: for scanned params T5X's explicit BATCH rules skip the
min_dim_size_to_factor test, so its scanned and unscanned runs factor small kernels differently.
Here the test applies per layer either way, so scanning never changes the optimizer.

The state keeps T5X's layout (v_row, v_col, v, m trees shaped like the params, (1,) placeholders
where a statistic is unused, float32).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from t5lite.train.optimizer_axes import Optimizer, Tree, is_stacked, leaf_axes

FACTOR_ROW_AXES = frozenset({"embed"})
FACTOR_COLUMN_AXES = frozenset({"vocab", "mlp", "heads", "kv", "joined_kv"})
"""T5X's standard_logical_factor_rules, for params of rank > 2 (others use the heuristic)."""


def factored_dims(axes: Sequence[str | None], shape: Sequence[int],
                  min_dim_size_to_factor: int = 128
                  ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(row dims, column dims) of one (per-layer) parameter's factored second moment, or None.

  factored_dims(('embed', 'heads', 'kv'), (512, 6, 64)) == ((0,), (1, 2))   # (512, 384) matrix
  factored_dims(('embed', 'mlp'), (512, 64)) is None                       # 64 < 128
  """
  shape = tuple(shape)
  if len(shape) < 2:
    return None
  if len(shape) == 2:
    rows, cols = (0,), (1,)  # T5X's heuristic for rank <= 2; the names do not matter
  else:
    rows = tuple(i for i, a in enumerate(axes) if a in FACTOR_ROW_AXES)
    cols = tuple(i for i, a in enumerate(axes) if a in FACTOR_COLUMN_AXES)
    if not rows or not cols or len(rows) + len(cols) != len(shape):
      return None
  size = lambda dims: math.prod(shape[d] for d in dims)  # noqa: E731
  if min(size(rows), size(cols)) < min_dim_size_to_factor:
    return None
  return rows, cols


class AdafactorState(NamedTuple):
  """T5X's Adafactor state: each statistic tree is shaped like the params (placeholders (1,))."""

  count: jax.Array
  """Updates done so far (int32): the step of the schedules."""
  v_row: Tree
  """Factored second moment over the row dims (column dims reduced away)."""
  v_col: Tree
  """Factored second moment over the column dims (row dims reduced away)."""
  v: Tree
  """Full second moment of params that are not factored."""
  m: Tree
  """First moment (EMA of updates) when momentum is on."""


def _placeholder() -> jax.Array:
  return jnp.zeros((1,), jnp.float32)


def _rms(x: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.mean(jnp.square(x)))


def adafactor(learning_rate: float | optax.Schedule, param_axes: Tree | None = None, *,
              decay_rate: float = 0.8, clipping_threshold: float | None = 1.0,
              factored: bool = True, multiply_by_parameter_scale: bool = True,
              min_dim_size_to_factor: int = 128, epsilon1: float = 1e-30,
              epsilon2: float = 1e-3, momentum: float | None = None) -> Optimizer:
  """T5X's Adafactor as an optax transformation (see the module docstring for the rules).

  Leaves whose spec starts with 'layers' are vmapped over that axis: factoring, update clipping
  and parameter scaling happen per layer. With param_axes=None nothing is a stack and only
  rank-2 params are factored; for params of rank <= 2 this equals optax.adafactor. Its
  state_axes come from the same per-leaf rules as init, so they cannot disagree.
  """
  schedule = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

  def init_leaf(param, dims):
    """(v_row, v_col, v, m) of one layer's parameter."""
    shape = param.shape
    if dims is not None:
      rows, cols = dims
      v_row = jnp.zeros([n for i, n in enumerate(shape) if i not in cols], jnp.float32)
      v_col = jnp.zeros([n for i, n in enumerate(shape) if i not in rows], jnp.float32)
      v = _placeholder()
    else:
      v_row, v_col, v = _placeholder(), _placeholder(), jnp.zeros(shape, jnp.float32)
    m = jnp.zeros(shape, jnp.float32) if momentum is not None else _placeholder()
    return v_row, v_col, v, m

  def update_leaf(grad, v_row, v_col, v, m, param, decay, lr, dims):
    """(update, v_row, v_col, v, m) of one layer's parameter; T5X's apply_param_gradient."""
    grad = grad.astype(jnp.float32)
    grad_sqr = jnp.square(grad) + epsilon1
    mix = 1.0 - decay
    if dims is not None:
      rows, cols = dims
      v_row = decay * v_row + mix * jnp.mean(grad_sqr, axis=cols)  # (row dims...)
      v_col = decay * v_col + mix * jnp.mean(grad_sqr, axis=rows)  # (column dims...)
      # The rank-1 estimate of E[g^2] is v_row (x) v_col / mean(v_row) (Adafactor, sec. 3).
      row_factor = (v_row / jnp.mean(v_row)) ** -0.5
      col_factor = v_col ** -0.5
      y = grad * jnp.expand_dims(row_factor, cols) * jnp.expand_dims(col_factor, rows)
    else:
      v = decay * v + mix * grad_sqr
      y = grad * v ** -0.5
    if clipping_threshold is not None:
      y = y / jnp.maximum(1.0, _rms(y) / clipping_threshold)
    scale = lr
    if multiply_by_parameter_scale:
      scale = scale * jnp.maximum(_rms(param.astype(jnp.float32)), epsilon2)
    update = scale * y
    if momentum is not None:
      m = momentum * m + (1.0 - momentum) * update
      update = m
    return (-update).astype(param.dtype), v_row, v_col, v, m

  def leaf_rules(params):
    """Per leaf: (logical axes, stacked, factored dims of one layer)."""
    rules = []
    for axes, leaf in zip(leaf_axes(params, param_axes), jax.tree.leaves(params)):
      stacked = is_stacked(axes)
      layer_axes, layer_shape = (axes[1:], leaf.shape[1:]) if stacked else (axes, leaf.shape)
      dims = (factored_dims(layer_axes, layer_shape, min_dim_size_to_factor)
              if factored else None)
      rules.append((axes, stacked, dims))
    return rules

  def statistics_axes(axes, stacked, dims):
    """Logical axes of (v_row, v_col, v, m) of one (possibly stacked) param, as init_leaf
    shapes them: a factored statistic keeps the param's axes minus the dims reduced away."""
    lead, layer_axes = (axes[:1], axes[1:]) if stacked else ((), axes)
    m = P(*axes) if momentum is not None else P()
    if dims is None:
      return P(), P(), P(*axes), m
    rows, cols = dims

    def without(dropped):
      return P(*lead, *(a for i, a in enumerate(layer_axes) if i not in dropped))
    return without(cols), without(rows), P(), m

  def state_axes_fn(params):
    treedef = jax.tree.structure(params)
    stats = [statistics_axes(*rules) for rules in leaf_rules(params)]
    v_row, v_col, v, m = ([treedef.unflatten(s) for s in zip(*stats)] if stats
                          else [treedef.unflatten([])] * 4)
    return AdafactorState(P(), v_row, v_col, v, m)

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    stats = []
    for leaf, (_, stacked, dims) in zip(leaves, leaf_rules(params)):
      fn = functools.partial(init_leaf, dims=dims)
      stats.append(jax.vmap(fn)(leaf) if stacked else fn(leaf))
    v_row, v_col, v, m = ([treedef.unflatten(s) for s in zip(*stats)] if stats
                          else [treedef.unflatten([])] * 4)
    return AdafactorState(jnp.zeros([], jnp.int32), v_row, v_col, v, m)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("adafactor needs params (parameter scaling): call update(g, s, params)")
    leaves, treedef = jax.tree.flatten(params)
    columns = [treedef.flatten_up_to(t)
               for t in (updates, state.v_row, state.v_col, state.v, state.m)]
    count = state.count
    # T5X's _decay_rate_pow: 1 - (step + 1) ** -decay_rate, which is 0 at the first step.
    decay = 1.0 - (count.astype(jnp.float32) + 1.0) ** -decay_rate
    lr = jnp.asarray(schedule(count), jnp.float32)
    outs = []
    for args, leaf, (_, stacked, dims) in zip(zip(*columns), leaves, leaf_rules(params)):
      fn = functools.partial(update_leaf, dims=dims)
      if stacked:  # one Adafactor per layer: batch over the leading 'layers' axis
        fn = jax.vmap(fn, in_axes=(0, 0, 0, 0, 0, 0, None, None))
      outs.append(fn(*args, leaf, decay, lr))
    new = [treedef.unflatten(c) for c in zip(*outs)] if outs else [treedef.unflatten([])] * 5
    new_updates, v_row, v_col, v, m = new
    return new_updates, AdafactorState(optax.safe_increment(count), v_row, v_col, v, m)

  return Optimizer(init_fn, update_fn, state_axes_fn)
