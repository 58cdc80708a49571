"""Optimizers from a run's config: T5X's Adafactor (t5lite/train/adafactor.py) or AdamW,
behind global-norm clipping.

    tx = make_optimizer(OptimizerConfig(), param_logical_axes(model_config))
    opt_state = tx.init(params)
    state_axes = tx.state_axes(params)     # logical PartitionSpecs shaped like opt_state
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

Every optimizer made here is an optimizer_axes.Optimizer, which declares the logical axes of
its state (how that state is sharded: t5lite/train/optimizer_axes.py). AdamW decays the
params of per-layer rank >= 2 but biases and norm scales (`weight_decay_mask`); PEFT runs
train a subset (`trainable_only`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import optax
from jax.sharding import PartitionSpec as P

from t5lite.errors import ConfigError
from t5lite.runtime.partitioning import key_name
from t5lite.train.adafactor import adafactor
from t5lite.train.optimizer_axes import Optimizer, Tree, axes_tree, is_stacked, leaf_axes
from t5lite.train.schedules import ScheduleConfig, make_schedule

OPTIMIZERS = ("adafactor", "adamw")


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
        jax.eval_shape(tx.init, params), axes_tree(params, param_axes),
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
    axes = leaf_axes(params, param_axes)
    return treedef.unflatten([
        len(a) - is_stacked(a) >= 2 and _last_name(path) not in NOT_DECAYED
        for (path, _), a in zip(paths, axes)])
  return mask


def _last_name(path) -> str:
  return key_name(path[-1]) if path else ""


# ------------------------------------------------------------------------------------------------
# Adafactor.


