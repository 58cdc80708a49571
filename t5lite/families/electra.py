"""ELECTRA: a small MLM generator and a replaced-token-detection discriminator, trained together.

The generator (an encoder with an MLM head, ElectraConfig.generator_hidden_fraction of the
discriminator's width; ModelConfig.electra holds ELECTRA's options) fills the masked positions
of a batch by sampling from its softmax; the discriminator (an encoder with ELECTRA's
per-token head) labels every real token of the result original (0) or replaced (1). A sampled
token equal to the original is labelled original. The loss is

    generator MLM mean + discriminator_loss_weight (50) x discriminator sigmoid CE mean,

the second over every non-padding token. No gradient flows through the sample; both losses
train the shared embeddings.

Params of a pretraining model (config.electra.generator_hidden_fraction > 0), one train state:

    {"discriminator": an encoder-only tree with the replaced-token head,
     "generator":     an encoder-only MLM tree without the tables it shares}

The generator reads the discriminator's token, position and token-type embeddings and their
norm (HF's `electra.embeddings`): one copy, updated by both losses. Each network projects
E -> its own hidden width when they differ (HF's `embeddings_project`). Both trees carry the
usual logical axes, so the partitioning rules shard them as any encoder.

A lone network is a family 'electra' model too: a discriminator (generator_hidden_fraction 0,
HF ElectraForPreTraining) or a generator (ModelConfig.electra None, HF ElectraForMaskedLM,
which trains as a plain MLM), e.g. as `t5lite import hf` reads them. A
discriminator finetunes with the encoder heads (ModelConfig.head): start a head model from
its exported HF directory (INITIAL_CHECKPOINT_PATH) and the backbone carries over.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from t5lite.data.objectives import chains as pretraining
from t5lite.errors import ConfigError
from t5lite.families.base import attention_params, stack_mlp_params, token_loss_sums
from t5lite.families.encoder_only import EncoderOnlyFamily, on_chosen
from t5lite.families.landmarks import ArchitectureChecked
from t5lite.families.registry import register
from t5lite.models.config import ModelConfig
from t5lite.models.moe.layer import ROUTER
from t5lite.models.network import EncoderOnly, make_model
from t5lite.models.params import init_boxed

SHARED = (("token_embedder",), ("encoder", "position_embedder"),
          ("encoder", "token_type_embedder"), ("encoder", "embedding_norm"))
"""Subtrees the generator reads from the discriminator (HF's electra.embeddings)."""
MASK_RATE, MASK_TOKEN_RATE = 0.15, 0.85
"""ELECTRA's masking: 15% of the tokens, of which 85% become [MASK] and 15% stay (no random
tokens: the generator's samples are the replacements)."""


def generator_config(config: ModelConfig) -> ModelConfig:
  """The generator of an ELECTRA config, as ELECTRA's get_generator_config sizes it: hidden
  round(d_model x fraction), heads of 64 (at least one, dividing the width), d_ff scaled alike,
  the discriminator's depth and embedding width (projected when it differs from the hidden
  width), an MLM head tied to the shared word embeddings. Example: ELECTRA-base (768, 12
  heads, 3072; fraction 1/3) -> hidden 256, 4 heads of 64, d_ff 1024, embedding_size 768."""
  hidden = config.electra.generator_width(config.d_model)
  heads = max(1, hidden // 64)
  while hidden % heads:
    heads -= 1
  e = config.embedding_width
  return config.replace(
      d_model=hidden, num_heads=heads, d_kv=hidden // heads, num_key_value_heads=0,
      d_ff=max(1, round(config.d_ff * hidden / config.d_model)),
      embedding_size=e if e != hidden else 0, electra=None, tie_output_embedding=True)


def discriminator_config(config: ModelConfig) -> ModelConfig:
  """The discriminator alone (what HF's ElectraForPreTraining holds)."""
  if not config.electra:
    return config
  return config.replace(electra=dataclasses.replace(config.electra, generator_hidden_fraction=0.0))


def _shared(path: tuple[str, ...]) -> bool:
  return any(path[:len(prefix)] == prefix for prefix in SHARED)


def without_shared(generator):
  """The generator tree less the subtrees it reads from the discriminator."""
  flat = traverse_util.flatten_dict(generator)
  return traverse_util.unflatten_dict({k: v for k, v in flat.items() if not _shared(k)})


def with_shared(generator, discriminator):
  """The generator's full tree: its own params plus the discriminator's shared embeddings."""
  flat = traverse_util.flatten_dict(generator)
  flat.update({k: v for k, v in traverse_util.flatten_dict(discriminator).items() if _shared(k)})
  return traverse_util.unflatten_dict(flat)


@register
class ElectraFamily(ArchitectureChecked, EncoderOnlyFamily):
  """ELECTRA (HF ElectraForPreTraining + ElectraForMaskedLM); see the module docstring."""
  name = "electra"
  hf_model_type = "electra"
  architecture = "encoder_only"

  @property
  def pretrains_pair(self) -> bool:
    """Generator and discriminator train together (else one network, as the config says)."""
    return bool(self.config.electra and self.config.electra.pretrains_pair)

  def pretraining_preprocessors(self, vocabulary) -> list:
    """ELECTRA's masking of `[CLS] piece [SEP]` pieces: 15% of the tokens, 85% of those
    [MASK], the rest unchanged (the generator supplies the replacements)."""
    bert_style = vocabulary.cls_id is not None and vocabulary.sep_id is not None
    return pretraining.mlm_preprocessors(
        mask_id=vocabulary.mask_id, add_cls_sep=bert_style, vocabulary_specials=bert_style,
        mask_rate=MASK_RATE, random_rate=0.0, keep_rate=1.0 - MASK_TOKEN_RATE)

  # --- network ------------------------------------------------------------------------------

  def _boxed_params(self, rng):
    if not self.pretrains_pair:
      return super()._boxed_params(rng)
    disc_rng, gen_rng = jax.random.split(rng)
    disc = init_boxed(make_model(self.config), EncoderOnly.dummy_inputs(self.config), disc_rng)
    gen_config = generator_config(self.config)
    gen = init_boxed(make_model(gen_config), EncoderOnly.dummy_inputs(gen_config), gen_rng)
    return {"discriminator": disc, "generator": without_shared(gen)}

  def networks(self, params) -> list[tuple[str, ModelConfig, object]]:
    """(name, config, params) of each network on its own; a pair gives 'discriminator' and
    'generator' (with the shared embeddings), which export writes as two HF directories."""
    if not self.pretrains_pair:
      return super().networks(params)
    disc = params["discriminator"]
    return [("discriminator", discriminator_config(self.config), disc),
            ("generator", generator_config(self.config), with_shared(params["generator"], disc))]

  def logits(self, params, batch, rng=None):
    """The discriminator's (B, L) logits of a pair (or the lone network's output)."""
    if not self.pretrains_pair:
      return super().logits(params, batch, rng)
    disc = type(self)(discriminator_config(self.config), self.loss)
    return disc.logits(params["discriminator"], batch, rng)

  # --- training -----------------------------------------------------------------------------

  def loss_fn(self, params, batch, rng):
    """Generator MLM loss + weight x discriminator loss (module docstring). With rng None
    (eval) the generator samples with a fixed key, so evaluation is deterministic."""
    config = self.config
    if config.head:
      return super().loss_fn(params, batch, rng)
    if not self.pretrains_pair:
      if config.electra:
        raise ConfigError("this ELECTRA discriminator has no generator to make its replaced "
                          "tokens: set ElectraConfig.generator_hidden_fraction (ELECTRA: 0.25 "
                          "for small and large, 1/3 for base) to pretrain the pair, or set a "
                          "finetuning head")
      return super().loss_fn(params, batch, rng)
    return electra_loss(self, params, batch, rng)

  def metrics(self, sums, normalizer):
    out = super().metrics(sums, normalizer)
    if "discriminator_tokens" not in sums:
      return out
    tokens = jnp.maximum(sums["discriminator_tokens"], 1.0)
    out.update(
        generator_loss=sums["generator_loss"] / jnp.maximum(sums["weight_sum"], 1e-8),
        generator_accuracy=out["accuracy"],
        discriminator_loss=sums["discriminator_loss"] / tokens,
        discriminator_accuracy=sums["discriminator_correct"] / tokens,
        replaced_precision=sums["replaced_hits"] / jnp.maximum(sums["replaced_predicted"], 1.0),
        replaced_recall=sums["replaced_hits"] / jnp.maximum(sums["replaced_actual"], 1.0),
        replaced_fraction=sums["replaced_actual"] / tokens)
    return out

  # --- cost ---------------------------------------------------------------------------------

  def flops_per_example(self, lengths: Mapping[str, int]) -> float:
    """Both networks when they train together: the discriminator's stack and head, the
    generator's stack and MLM output projection, each over the L input positions (the
    convention of EncoderOnlyFamily.flops_per_example; ELECTRA's paper counts alike)."""
    if not self.config.electra:
      return super().flops_per_example(lengths)
    length = lengths["encoder_input_tokens"]
    disc = self.config
    total = _stack_flops(disc, length, disc.d_model * disc.d_model + disc.d_model)
    if self.pretrains_pair:
      gen = generator_config(disc)
      total += _stack_flops(gen, length, gen.embedding_width * gen.vocab_size)
    return float(total)


def _stack_flops(config: ModelConfig, length: int, head_params: int) -> int:
  layers = config.num_encoder_layers * config.layer_repeats
  mlp = stack_mlp_params(config, "encoder", config.num_encoder_layers)  # MoE: never shared
  weights = layers * attention_params(config) + config.layer_repeats * mlp + head_params
  return 6 * weights * length + 12 * config.num_heads * config.d_kv * layers * length ** 2


def electra_loss(family: ElectraFamily, params, batch, rng):
  """(weighted loss sum, sums) of ELECTRA's two losses; see ElectraFamily.loss_fn. The
  generator's MLM head runs on the masked slots only (encoder_only.on_chosen), where it
  also samples the replacements."""
  config, options = family.config, family.loss
  gen_config = generator_config(config)
  # A training step (an rng) also turns on a Mixture-of-Experts router's jitter.
  dropout = rng is not None and (config.uses_dropout or bool(config.moe))
  mutable = [ROUTER] if config.moe else False  # both networks' sparse layers sow routing
  routed = {}
  gen_rng, disc_rng, sample_rng = (jax.random.split(rng, 3) if rng is not None
                                   else (None, None, jax.random.key(0)))
  inputs = [batch.get(k) for k in EncoderOnly.INPUTS]
  tokens, segment_ids = batch["encoder_input_tokens"], batch.get("encoder_segment_ids")
  targets, weights = batch["mlm_target_tokens"], batch["mlm_loss_weights"]
  generator = make_model(gen_config, enable_dropout=dropout)
  gen_params = {"params": with_shared(params["generator"], params["discriminator"])}
  gen_rngs = {"dropout": gen_rng} if dropout else None
  states = generator.apply(gen_params, *inputs, method="hidden_states", rngs=gen_rngs,
                           mutable=mutable)
  if config.moe:
    states, routed["generator"] = states[0], states[1].get(ROUTER, {})
  original = jnp.where(weights > 0, targets, tokens)  # (B, L)

  def generator_at(pick, put):
    logits = generator.apply(gen_params, pick(states), method="mlm_logits", rngs=gen_rngs)
    loss_sum, sums = token_loss_sums(logits, pick(targets), pick(weights),
                                     None if segment_ids is None else pick(segment_ids),
                                     options)
    # The sample is data for the discriminator: no gradient through it.
    temperature = config.electra.sampling_temperature
    sampled = jax.random.categorical(sample_rng,
                                     jax.lax.stop_gradient(logits) / temperature)  # (B, K)
    return loss_sum, sums, put(original, sampled)

  gen_sum, sums, sampled = on_chosen(generator_at, weights, options.loss_normalizing_factor)
  corrupted = jnp.where(weights > 0, sampled, original)  # (B, L)
  replaced = (corrupted != original).astype(jnp.float32)
  discriminator = make_model(discriminator_config(config), enable_dropout=dropout)
  logits = discriminator.apply({"params": params["discriminator"]}, corrupted, *inputs[1:],
                               rngs={"dropout": disc_rng} if dropout else None,
                               mutable=mutable)  # (B, L)
  if config.moe:
    logits, routed["discriminator"] = logits[0], logits[1].get(ROUTER, {})
  real = ((tokens > 0) if segment_ids is None else (segment_ids > 0)).astype(jnp.float32)
  disc_sum = jnp.sum(optax.sigmoid_binary_cross_entropy(logits, replaced) * real)
  count = jnp.sum(real)
  # The discriminator mean enters as the sentence loss of BERT's does: scaled by this
  # batch's normalizer / tokens, so that loss = generator mean + weight x discriminator mean.
  weight = config.electra.discriminator_loss_weight
  loss_sum = gen_sum + weight * disc_sum * sums["normalizer"] / jnp.maximum(count, 1.0)
  predicted = (logits > 0).astype(jnp.float32) * real
  sums = dict(sums, generator_loss=gen_sum, discriminator_loss=disc_sum,
              discriminator_tokens=count,
              discriminator_correct=jnp.sum((predicted == replaced).astype(jnp.float32) * real),
              replaced_hits=jnp.sum(predicted * replaced),
              replaced_predicted=jnp.sum(predicted),
              replaced_actual=jnp.sum(replaced * real))
  # Mixture-of-Experts: both networks' router losses, over the normalizer like the MLM's.
  return family.with_router_losses(loss_sum, sums, routed if config.moe else None)
