"""Family: the one object that knows a kind of model and how it trains.

T5X's BaseTransformerModel idea in our own shape. A family owns, for its kind of model:

  data      converter(pack)           the feature converter (task features -> model features)
            pretraining_preprocessors(vocabulary)   its self-supervised objective
  network   make_model(...)           the Flax module, model_inputs(batch), dummy_inputs()
            init_params / abstract_params / param_logical_axes
  training  loss_fn(params, batch, rng) -> (weighted loss sum, metric sums)
            trainable_mask(params)    which parameters the optimizer updates
            metrics(sums, normalizer) the figures a step reports from its sums
  decoding  generate(params, inputs, ...), score(params, inputs, targets)
  cost      flops_per_example(lengths), tokens_per_example(lengths)
  export    hf_model_type             the HF mapping t5lite.interop.hf.checkpoints uses
                                      (None: no HF layout)
            networks(params)          (name, config, params) of each network it holds

The trainer, evaluator, cost model, CLI and export ask the family; none of them branches on
which family it is. A new family is one module: subclass Family, set `name`, override what
differs, decorate with t5lite.families.registry.register.

A family object is a frozen dataclass of (ModelConfig, LossOptions): hashable, so it can be a
static argument of a jitted function, and cheap to make anywhere with family_of(config).

The defaults implement a token-prediction family: logits (B, L, V) from the network, cross
entropy against `target_features` with per-token loss weights, normalized as T5X does.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, ClassVar, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5lite.data.converters.sequence import FeatureConverter
from t5lite.errors import ConfigError
from t5lite.models import losses
from t5lite.models.decoding import search as decoding
from t5lite.models.moe import losses as moe_losses
from t5lite.models.config import ModelConfig
from t5lite.models.moe.layer import ROUTER
from t5lite.models.network import make_model
from t5lite.models.params import init_boxed, unbox_shapes

Batch = Mapping[str, jax.Array]
Tree = Any


@dataclasses.dataclass(frozen=True)
class LossOptions:
  """How a family's loss is computed (the train step's StepConfig carries these for gin)."""

  label_smoothing: float = 0.0
  """Probability mass spread over the other vocabulary entries."""
  z_loss: float = 0.0
  """Coefficient of logsumexp(logits)**2 (T5X pretraining: 1e-4)."""
  loss_normalizing_factor: float | str | None = losses.NUM_REAL_TARGET_TOKENS
  """What the summed weighted loss is divided by: a constant, one of losses.NORMALIZERS, or
  None (the plain sum). The family reports its share as sums['normalizer']."""


@dataclasses.dataclass(frozen=True)
class Family(abc.ABC):
  """A kind of model and how it trains; see the module docstring."""

  config: ModelConfig
  loss: LossOptions = LossOptions()

  name: ClassVar[str] = ""
  target_features: ClassVar[tuple[str, str, str]] = (
      "decoder_target_tokens", "decoder_loss_weights", "decoder_segment_ids")
  """(targets, loss weights, segment ids) batch features of the token loss."""
  token_features: ClassVar[tuple[str, ...]] = ()
  """Batch features whose lengths add up to the tokens an example trains on (throughput)."""
  decodes: ClassVar[bool] = False
  """generate / score work (the model has a decoder)."""
  continues_prompts: ClassVar[bool] = False
  """generate continues a prompt in one token stream (few-shot prompting needs this)."""
  hf_model_type: ClassVar[str | None] = None
  """The HF transformers model_type its export/import mapping is registered under."""

  # --- data ---------------------------------------------------------------------------------

  @abc.abstractmethod
  def converter(self, pack: bool = True) -> FeatureConverter:
    """The feature converter that turns task examples into this family's batches."""

  @abc.abstractmethod
  def pretraining_preprocessors(self, vocabulary) -> list:
    """The self-supervised objective this family pretrains with: preprocessors that follow
    `tokenize` in a task whose text is in `targets` (what `t5lite smoke` trains on)."""

  # --- network ------------------------------------------------------------------------------

  def make_model(self, *, enable_dropout: bool = False, cache_length: int = 0) -> nn.Module:
    """The Flax module; its params depend on neither argument."""
    return make_model(self.config, enable_dropout=enable_dropout, cache_length=cache_length)

  def dummy_inputs(self) -> dict[str, jax.Array]:
    """The smallest inputs that fix every parameter shape, for init."""
    return type(self.make_model()).dummy_inputs(self.config)

  def model_inputs(self, batch: Batch) -> dict[str, jax.Array]:
    """The part of a converted batch that the module's __call__ takes."""
    return {k: batch[k] for k in type(self.make_model()).INPUTS if k in batch}

  def _boxed_params(self, rng: jax.Array):
    return init_boxed(self.make_model(), self.dummy_inputs(), rng)

  def init_params(self, rng: jax.Array | int = 0) -> Tree:
    """Randomly initialized params (plain arrays). Under jit with out_shardings they are born
    sharded: the threefry RNG gives the same numbers however the computation is split.
    Called outside jit it is one compiled program (op by op, each parameter's draw would
    compile on its own)."""
    if isinstance(rng, int):
      rng = jax.random.key(rng)
    return nn.unbox(_jitted_boxed(self, rng))

  def abstract_params(self) -> Tree:
    """Params as jax.ShapeDtypeStructs: nothing allocated or computed."""
    return unbox_shapes(_abstract_boxed(self))

  def param_logical_axes(self) -> Tree:
    """Params tree of PartitionSpecs over logical axis names, e.g. P('embed', 'heads', 'kv')."""
    return nn.get_partition_spec(_abstract_boxed(self))

  def networks(self, params: Tree) -> list[tuple[str, ModelConfig, Tree]]:
    """(name, config, params) of each network a model holds, for export: one, named '', for
    most families; ELECTRA's pretraining pair gives its discriminator and generator."""
    return [("", self.config, params)]

  def trainable_mask(self, params: Tree) -> Tree:
    """A tree of bools shaped like params: True where the optimizer updates the parameter."""
    return jax.tree.map(lambda _: True, params)

  # --- training -----------------------------------------------------------------------------

  def logits(self, params: Tree, batch: Batch, rng: jax.Array | None = None) -> jax.Array:
    """The network's output on a batch; rng None: no dropout."""
    return self.forward(params, batch, rng)[0]

  def forward(self, params: Tree, batch: Batch, rng: jax.Array | None = None
              ) -> tuple[jax.Array, Tree | None]:
    """(the network's output, what its sparse layers sowed into the `router` collection, or
    None for a model without Mixture-of-Experts layers); rng None: no dropout, no jitter."""
    config = self.config
    # A training step (an rng) also turns on the router's jitter noise.
    dropout = rng is not None and (config.uses_dropout or bool(config.moe))
    model = self.make_model(enable_dropout=dropout)
    rngs = {"dropout": rng} if dropout else None
    if config.moe is None:
      return model.apply({"params": params}, **self.model_inputs(batch), rngs=rngs), None
    out, state = model.apply({"params": params}, **self.model_inputs(batch), rngs=rngs,
                             mutable=[ROUTER])
    return out, state.get(ROUTER, {})

  def with_router_losses(self, loss_sum: jax.Array, sums: dict[str, jax.Array],
                         routed: Tree | None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """loss_fn's (loss sum, sums) plus a Mixture-of-Experts model's router losses, weighted by
    the batch's share of the normalizer (t5lite.models.moe.losses); unchanged without."""
    if routed is None:
      return loss_sum, sums
    lnf = self.loss.loss_normalizing_factor
    weight = (sums["normalizer"] if isinstance(lnf, str)
              else jnp.asarray(1.0 if lnf is None else lnf, jnp.float32))
    extra, router_sums = moe_losses.router_loss_sums(self.config, routed, weight)
    return loss_sum + extra, {**sums, **router_sums}

  def loss_fn(self, params: Tree, batch: Batch, rng: jax.Array | None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(weighted loss sum, metric sums) of a (micro)batch; rng None: deterministic.

    Sums, not means, so that microbatches and eval batches add up: the train step divides
    once by the whole batch's normalizer. sums holds 'normalizer' (this batch's share of
    LossOptions.loss_normalizing_factor), 'weight_sum' (real target tokens), 'z_loss'
    (weighted sum) and 'correct' (weighted argmax hits).
    """
    target_key, weight_key, segment_key = self.target_features
    out, routed = self.forward(params, batch, rng)
    return self.with_router_losses(*token_loss_sums(
        out, batch[target_key], batch.get(weight_key), batch.get(segment_key), self.loss),
        routed)

  def metrics(self, sums: Mapping[str, jax.Array], normalizer: jax.Array
              ) -> dict[str, jax.Array]:
    """The per-step figures from a step's summed loss_fn sums (loss is the step's own)."""
    return {"z_loss": sums["z_loss"] / normalizer, "weight_sum": sums["weight_sum"],
            "accuracy": sums["correct"] / jnp.maximum(sums["weight_sum"], 1e-8),
            **self.router_metrics(sums, normalizer)}

  def router_metrics(self, sums: Mapping[str, jax.Array], normalizer: jax.Array) -> dict:
    """Routing figures of a Mixture-of-Experts model (none without one)."""
    if self.config.moe is None or "router_choices" not in sums:
      return {}
    return moe_losses.router_metrics(self.config, sums, normalizer)

  # --- decoding and scoring -----------------------------------------------------------------

  def _check_decodes(self) -> None:
    if self.config.head:
      raise ConfigError(f"a model with the {self.config.head!r} head predicts labels, not "
                        "tokens: it cannot generate or score sequences")
    if not self.decodes:
      raise ConfigError(f"a {self.name!r} model has no decoder: it cannot generate or score "
                        "sequences")

  def generate(self, params: Tree, inputs, **settings) -> np.ndarray:
    """Decoded tokens (B, max_decode_length); settings as t5lite.generate takes them."""
    self._check_decodes()
    return decoding.generate(self.config, params, inputs, **settings)

  def score(self, params: Tree, inputs, targets) -> np.ndarray:
    """Each row's summed target log-likelihood (B,)."""
    self._check_decodes()
    return decoding.score(self.config, params, inputs, targets)

  # --- cost ---------------------------------------------------------------------------------

  @abc.abstractmethod
  def flops_per_example(self, lengths: Mapping[str, int]) -> float:
    """Training FLOPs (forward + backward) of one example whose model features have these
    lengths, e.g. {'encoder_input_tokens': 512, 'decoder_target_tokens': 114}. Matmuls only
    (embedding lookups, norms and softmax are a rounding error and MFU is quoted against
    matmul FLOPs): 6 per weight and position, 12 * heads * d_kv per attended (query, key)
    pair, causal attention counted over the full square as published counts do."""

  def tokens_per_example(self, lengths: Mapping[str, int]) -> int:
    """Tokens one example trains on (what tokens/s counts)."""
    return int(sum(lengths.get(k, 0) for k in self.token_features))


def token_loss_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array | None,
                    segment_ids: jax.Array | None, options: LossOptions
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token cross entropy of logits (B, L, V) against targets (B, L) as (weighted loss sum,
  sums); see Family.loss_fn. With AVERAGE_PER_SEQUENCE each packed segment weighs 1: the
  rescaling is per row, so it is the same whichever microbatch holds the row."""
  weights = (jnp.ones(targets.shape, jnp.float32) if weights is None
             else weights.astype(jnp.float32))
  lnf = options.loss_normalizing_factor
  loss_weights = weights
  if lnf == losses.AVERAGE_PER_SEQUENCE:
    loss_weights = losses.per_segment_weights(weights, segment_ids)
  out = losses.weighted_cross_entropy(
      logits, targets, loss_weights, label_smoothing=options.label_smoothing,
      z_loss=options.z_loss, loss_normalizing_factor=None)
  weight_sum = jnp.sum(weights)
  if lnf == losses.NUM_TOTAL_TARGET_TOKENS:
    normalizer = jnp.asarray(targets.size, jnp.float32)
  elif lnf == losses.AVERAGE_PER_SEQUENCE:
    normalizer = jnp.sum(loss_weights)
  else:  # NUM_REAL_TARGET_TOKENS; unused for a constant or None
    normalizer = weight_sum
  sums = {
      "z_loss": out["z_loss"],
      "weight_sum": weight_sum,
      # token_accuracy is a weighted mean; times the weight sum it is the weighted hit count.
      "correct": losses.token_accuracy(logits, targets, weights) * weight_sum,
      "normalizer": normalizer,
  }
  return out["loss"], sums


def attention_params(config: ModelConfig) -> int:
  """Q, K, V and output projections of one attention block (K and V over the key/value heads
  of grouped-query attention)."""
  return 2 * config.d_model * config.d_kv * (config.num_heads + config.kv_heads)


def mlp_params(config: ModelConfig) -> int:
  """wi (wi_0 and wi_1 when gated) and wo of one MLP block."""
  return (3 if config.gated_mlp else 2) * config.d_model * config.d_ff


def stack_mlp_params(config: ModelConfig, stack: str, num_layers: int) -> int:
  """The MLP weights a token passes through in a stack of num_layers layers: mlp_params per
  dense layer; in a Mixture-of-Experts sparse layer top_k experts' plus the router (d x E)."""
  moe = config.moe
  sparse = len(moe.sparse_layers(stack, num_layers)) if moe is not None else 0
  routed = sparse * (moe.top_k * mlp_params(config) + config.d_model * moe.num_experts
                     ) if sparse else 0
  return (num_layers - sparse) * mlp_params(config) + routed


def _abstract_boxed(family: Family) -> Tree:
  """eval_shape of the family's boxed init, traced once per family (a frozen dataclass of its
  config and options, so equal families share it): a start of `t5lite train` asks for it
  several times (shardings, optimizer state, checkpoints, PEFT and warm-start checks), and
  tracing a model's init costs 0.1-0.3 s each time. Callers get fresh containers: some edit
  the tree they get."""
  try:
    boxed = _traced_boxed(family)
  except TypeError:  # an unhashable field (a family built outside the registry): no cache
    boxed = jax.eval_shape(family._boxed_params, jax.random.key(0))
  return jax.tree.map(lambda leaf: leaf, boxed,
                      is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def _jitted_boxed(family: Family, rng: jax.Array) -> Tree:
  """family._boxed_params(rng) as one program (inlined when called under jit)."""
  try:
    hash(family)
  except TypeError:  # an unhashable field (a family built outside the registry): no cache
    return jax.jit(family._boxed_params)(rng)
  return _boxed_by_family(family, rng)


@functools.partial(jax.jit, static_argnums=0)
def _boxed_by_family(family: Family, rng: jax.Array) -> Tree:
  return family._boxed_params(rng)


@functools.lru_cache(maxsize=64)
def _traced_boxed(family: Family) -> Tree:
  return jax.eval_shape(family._boxed_params, jax.random.key(0))
