"""Optimizers: T5X's Adafactor, with scanned layers handled one layer at a time, and AdamW.

    tx = make_optimizer(OptimizerConfig(), param_logical_axes(model_config))
    opt_state = tx.init(params)
    state_axes = tx.state_axes(params)     # logical PartitionSpecs shaped like opt_state
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

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

Sharding the state. Every optimizer made here is an `Optimizer`: an optax transformation that
also declares the logical axes of its state, as T5X's optimizers do (derive_logical_axes).
Adafactor's v_row keeps the param's axes minus the column dims it factored, v_col minus the row
dims, both taken from `factored_dims`, the same rule the update uses; shapes alone cannot tell
which dim of a square kernel was reduced. optax's states (AdamW's mu / nu, counts, masks,
global-norm clipping) are declared through optax.tree_map_params. Counts and (1,) placeholders
get P(). t5lite.runtime.partitioning.state_shardings maps the declared names with the params'
logical rules.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from t5lite.errors import ConfigError
from t5lite.train.schedules import ScheduleConfig, make_schedule

Tree = Any
OPTIMIZERS = ("adafactor", "adamw")
STACKED_AXIS = "layers"
"""Logical name of the leading axis of scanned (stacked) layer params."""
FACTOR_ROW_AXES = frozenset({"embed"})
FACTOR_COLUMN_AXES = frozenset({"vocab", "mlp", "heads", "kv", "joined_kv"})
"""T5X's standard_logical_factor_rules, for params of rank > 2 (others use the heuristic)."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """The optimizer and its learning-rate schedule. Defaults are T5 v1.1 pretraining (T5X)."""

  name: str = "adafactor"
  """'adafactor' (T5X's, per layer under scan) or 'adamw' (optax.adamw)."""
  schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
  """Learning rate per step; T5's 1 / sqrt(max(step, 10000)) by default."""
  global_norm_clip: float | None = None
  """Scale the gradients so that their global L2 norm is at most this, before the optimizer."""

  # Adafactor (T5X defaults).
  decay_rate: float = 0.8
  """Second-moment decay 1 - (step + 1) ** -decay_rate."""
  clipping_threshold: float | None = 1.0
  """Divide each parameter's update by max(1, RMS(update) / threshold); None = no clipping."""
  factored: bool = True
  """Keep row and column second-moment statistics instead of a full one for matrices."""
  multiply_by_parameter_scale: bool = True
  """Scale each update by max(RMS(param), epsilon2): relative step sizes."""
  min_dim_size_to_factor: int = 128
  """Factor only when both sides of the (per-layer, 2-D) matrix are at least this long."""
  epsilon1: float = 1e-30
  """Added to squared gradients."""
  epsilon2: float = 1e-3
  """Lower bound of the parameter scale (lets zero-initialized params move)."""
  momentum: float | None = None
  """Adafactor's beta1 (an EMA of updates, float32); None = no first moment (T5)."""

  # AdamW.
  b1: float = 0.9
  """AdamW first-moment decay."""
  b2: float = 0.999
  """AdamW second-moment decay."""
  eps: float = 1e-8
  """AdamW denominator epsilon."""
  weight_decay: float = 0.01
  """AdamW decoupled weight decay (times the learning rate, as in torch.optim.AdamW), applied to
  params of per-layer rank >= 2 only: kernels and embeddings, not norm scales or biases."""

  def __post_init__(self):
    if self.name not in OPTIMIZERS:
      raise ConfigError(f"OptimizerConfig.name={self.name!r} is not one of {OPTIMIZERS}")
    if self.global_norm_clip is not None and self.global_norm_clip <= 0:
      raise ConfigError(f"global_norm_clip must be positive or None, got {self.global_norm_clip}")
    if self.clipping_threshold is not None and self.clipping_threshold <= 0:
      raise ConfigError(f"clipping_threshold must be positive or None, got "
                        f"{self.clipping_threshold}")
    if self.momentum is not None and not 0.0 <= self.momentum < 1.0:
      raise ConfigError(f"momentum must be in [0, 1) or None, got {self.momentum}")

  def replace(self, **changes) -> "OptimizerConfig":
    return dataclasses.replace(self, **changes)


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


def make_optimizer(config: OptimizerConfig, param_axes: Tree) -> Optimizer:
  """The optimizer for params whose logical specs are `param_axes`.

  param_axes: t5lite.models.param_logical_axes(model_config), a params tree of PartitionSpecs;
  it tells Adafactor which leaves are layer stacks and which dims to factor, AdamW which
  leaves to decay, and both the axes of their state. The state is always (global-norm clip,
  optimizer), with optax.identity() when clipping is off, so switching clipping on for a
  resumed run keeps the state structure.
  """
  schedule = make_schedule(config.schedule)
  if config.name == "adafactor":
    core = adafactor(schedule, param_axes, decay_rate=config.decay_rate,
                     clipping_threshold=config.clipping_threshold, factored=config.factored,
                     multiply_by_parameter_scale=config.multiply_by_parameter_scale,
                     min_dim_size_to_factor=config.min_dim_size_to_factor,
                     epsilon1=config.epsilon1, epsilon2=config.epsilon2,
                     momentum=config.momentum)
  else:
    core = declared(optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                                weight_decay=config.weight_decay,
                                mask=weight_decay_mask(param_axes)), param_axes)
  clip = (optax.identity() if config.global_norm_clip is None
          else optax.clip_by_global_norm(config.global_norm_clip))
  return chain(declared(clip, param_axes), core)


def declared(tx: optax.GradientTransformation, param_axes: Tree | None) -> Optimizer:
  """An optax transformation whose state axes follow from optax.tree_map_params.

  tree_map_params finds the subtrees of the state that mirror the params (Adam's mu and nu);
  they get the params' axes, every other leaf (counts, injected hyperparameters) P(). Masked
  states' MaskedNodes stay as they are. Only for states whose statistics keep the params'
  shapes: Adafactor declares its own (see `adafactor`).
  """
  def state_axes(params):
    is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    return optax.tree_map_params(
        tx, lambda value, spec: value if is_masked(value) else spec,
        jax.eval_shape(tx.init, params), _axes_tree(params, param_axes),
        transform_non_params=lambda _: P(), is_leaf=is_masked)
  return Optimizer(tx.init, tx.update, state_axes)


def chain(*stages: Optimizer) -> Optimizer:
  """optax.chain of declared stages: its state is the tuple of theirs, and so are its axes."""
  tx = optax.chain(*stages)
  return Optimizer(tx.init, tx.update,
                   lambda params: tuple(stage.state_axes(params) for stage in stages))


def trainable_only(optimizer: Optimizer, mask: Tree) -> Optimizer:
  """`optimizer` on the params where `mask` is True; the others get zero updates and no state.

  `optimizer` itself when every param trains. optax.multi_transform does the work; its state
  ({'train': masked state of `optimizer`, 'frozen': empty}) is declared here, since optax cannot
  say what `optimizer`'s own state looks like.
  """
  if all(jax.tree.leaves(mask)):
    return optimizer
  labels = jax.tree.map(lambda trainable: "train" if trainable else "frozen", mask)
  tx = optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)

  def state_axes(params):
    trained = jax.tree.map(lambda keep, p: p if keep else optax.MaskedNode(), mask, params)
    return optax.MultiTransformState({
        "train": optax.MaskedState(optimizer.state_axes(trained)),
        "frozen": optax.MaskedState(optax.EmptyState())})
  return Optimizer(tx.init, tx.update, state_axes)


def optimizer_count(opt_state: Tree) -> jax.Array | None:
  """The optimizer's own update count (what its schedule reads): the first `count` leaf of
  the optax state. It restarts at 0 when finetuning starts a fresh optimizer at a
  checkpoint's step, so the schedule warms up again there, as in T5X."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    if path and str(getattr(path[-1], "name", getattr(path[-1], "key", ""))) == "count":
      return leaf
  return None


def learning_rate_at(config: OptimizerConfig | ScheduleConfig, step: int) -> float:
  """The learning rate of update number `step` (0-based), for logging."""
  schedule = config.schedule if isinstance(config, OptimizerConfig) else config
  return float(make_schedule(schedule)(step))


# ------------------------------------------------------------------------------------------------
# Which leaves are layer stacks, and which dims Adafactor factors.


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


def _key_name(key) -> str:
  """The plain name of a pytree path entry (DictKey.key, GetAttrKey.name, SequenceKey.idx)."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _leaf_axes(params: Tree, param_axes: Tree | None) -> list[tuple]:
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
  by_path = {tuple(_key_name(k) for k in path): spec for path, spec in specs}
  out = []
  for path, leaf in flat:
    name = "/".join(_key_name(k) for k in path)
    key = tuple(_key_name(k) for k in path)
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


def _is_stacked(axes: tuple) -> bool:
  return bool(axes) and axes[0] == STACKED_AXIS


def _axes_tree(params: Tree, param_axes: Tree | None) -> Tree:
  """param_axes rebuilt in params' own tree structure, each spec padded to its leaf's rank."""
  treedef = jax.tree.structure(params)
  return treedef.unflatten([P(*axes) for axes in _leaf_axes(params, param_axes)])


NOT_DECAYED = ("bias", "scale")
"""Param names never decayed, whatever their rank: biases (a (heads, kv) attention bias is a
matrix by rank) and norm scales."""


def weight_decay_mask(param_axes: Tree | None) -> Callable[[Tree], Tree]:
  """A mask fn for optax: True for params of per-layer rank >= 2 (kernels, embeddings) that
  are not named in NOT_DECAYED.

  Norm scales and biases are not decayed (the BERT / GPT convention: HF's finetuning scripts
  exclude `bias` and `LayerNorm.weight`). The rank is taken per layer, so a scanned (layers,
  embed) norm scale is not mistaken for a matrix and scanned and unrolled models decay the
  same params.
  """
  def mask(params):
    paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    axes = _leaf_axes(params, param_axes)
    return treedef.unflatten([
        len(a) - _is_stacked(a) >= 2 and _last_name(path) not in NOT_DECAYED
        for (path, _), a in zip(paths, axes)])
  return mask


def _last_name(path) -> str:
  key = path[-1] if path else None
  return str(getattr(key, "key", getattr(key, "name", key)))


# ------------------------------------------------------------------------------------------------
# Adafactor.


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
    for axes, leaf in zip(_leaf_axes(params, param_axes), jax.tree.leaves(params)):
      stacked = _is_stacked(axes)
      layer_axes, layer_shape = (axes[1:], leaf.shape[1:]) if stacked else (axes, leaf.shape)
      dims = (factored_dims(layer_axes, layer_shape, min_dim_size_to_factor)
              if factored else None)
      rules.append((axes, stacked, dims))
    return rules

  def leaf_axes(axes, stacked, dims):
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
    stats = [leaf_axes(*rules) for rules in leaf_rules(params)]
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
