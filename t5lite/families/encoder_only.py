"""The encoder-only family: a BERT-style encoder trained with masked language modelling.

Batches (EncoderOnlyFeatureConverter): encoder_input_tokens (masked) and mlm_target_tokens /
mlm_loss_weights (the original tokens; weight 1 where a token was chosen for prediction). The
loss is token cross entropy over the chosen positions. It has no decoder: nothing to generate.

A model with a sentence head (ModelConfig.sentence_classes: BERT's next-sentence, ALBERT's
sentence-order prediction) adds, when the batch holds `sentence_labels` (B,), the mean cross
entropy of the pooled first token's classes, as HF's BertForPreTraining sums the two means.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from t5lite.data.converters import sequence as converters
from t5lite.data.objectives import chains as pretraining
from t5lite.families import heads
from t5lite.families.base import (Family, attention_params, stack_mlp_params,
                                  token_loss_sums)
from t5lite.families.registry import register
from t5lite.models import losses
from t5lite.models.moe.layer import ROUTER


def mlm_slots(length: int) -> int:
  """Positions per row the MLM head runs on: a quarter of the row (BERT chooses 15%), in
  multiples of 8. Example: 128 -> 32, 512 -> 128, 10 -> 8."""
  quarter = -(-length // 4)  # ceil(L / 4)
  return min(length, (quarter + 7) // 8 * 8)


def on_chosen(loss_at, weights, normalizing_factor):
  """loss_at(pick, put) where pick gathers (B, L, ...) features at each row's first
  MLM_SLOTS(L) weighted positions (when no row has more) and put(full, values) writes
  picked-shaped values back into a (B, L) array; else both are the identity. The same sums
  either way, the other positions' weights being 0."""
  length = weights.shape[1] if weights is not None else 0
  slots = mlm_slots(length) if length else 0
  # NUM_TOTAL_TARGET_TOKENS counts every position, AVERAGE_PER_SEQUENCE every segment.
  if (weights is None or slots >= length
      or normalizing_factor in (losses.NUM_TOTAL_TARGET_TOKENS, losses.AVERAGE_PER_SEQUENCE)):
    return loss_at(lambda x: x, _identity_put)
  chosen = weights > 0  # (B, L)
  # Each row's weighted positions first (stable: in order), then the rest.
  order = jnp.argsort(~chosen, axis=1, stable=True)[:, :slots]  # (B, K)

  def pick(x):
    index = order.reshape(order.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)

  def put(full, values):
    rows = jnp.arange(full.shape[0])[:, None]
    return full.at[rows, order].set(values.astype(full.dtype))
  return jax.lax.cond(jnp.all(jnp.sum(chosen, axis=1) <= slots),
                      lambda: loss_at(pick, put),
                      lambda: loss_at(lambda x: x, _identity_put))


def _identity_put(full, values):
  return values.astype(full.dtype)


@register
class EncoderOnlyFamily(Family):
  """Masked language models (the MLM head predicts every position)."""

  name = "encoder_only"
  target_features = ("mlm_target_tokens", "mlm_loss_weights", "encoder_segment_ids")
  token_features = ("encoder_input_tokens",)

  def converter(self, pack: bool = True) -> converters.FeatureConverter:
    if self.config.head:
      return heads.converter(self.config)
    return converters.EncoderOnlyFeatureConverter(pack=pack)

  def pretraining_preprocessors(self, vocabulary) -> list:
    """BERT's MLM (15%, 80/10/10) with the vocabulary's mask token ([MASK]; T5's
    `<extra_id_0>`, or unk without extra ids). With a [CLS] and a [SEP] (WordPiece), each
    piece is `[CLS] tokens [SEP]` and no special token is masked or drawn at random."""
    bert_style = vocabulary.cls_id is not None and vocabulary.sep_id is not None
    return pretraining.mlm_preprocessors(mask_id=vocabulary.mask_id, add_cls_sep=bert_style,
                                         vocabulary_specials=bert_style)

  def loss_fn(self, params, batch, rng):
    """Token cross entropy over the MLM positions; plus, with a sentence head and
    `sentence_labels` in the batch, the sentence head's mean cross entropy (its sum, scaled by
    this batch's normalizer / rows, so that loss = MLM mean + sentence mean as in HF). With
    gradient accumulation the scale is each microbatch's own normalizer / rows: the sentence
    means are then weighted by their microbatch's share of MLM tokens, not equally.

    The MLM head (a d_model x vocab product, most of a small BERT's step) runs on the chosen
    positions only, as BERT's own code gathers its `masked_lm_positions`: each row's first
    MLM_SLOTS(L) weighted positions, when no row has more (else on every position, the same
    numbers); the loss is the same as over all positions, whose other weights are 0."""
    if self.config.head:
      return heads.family_loss(self, params, batch, rng)
    # A training step (an rng) also turns on a Mixture-of-Experts router's jitter.
    dropout = rng is not None and (self.config.uses_dropout or bool(self.config.moe))
    model = self.make_model(enable_dropout=dropout)
    apply = lambda method, *args, **kwargs: model.apply(  # noqa: E731
        {"params": params}, *args, method=method, rngs={"dropout": rng} if dropout else None,
        **kwargs)
    inputs = [batch.get(k) for k in model.INPUTS]
    routed = None  # what sparse layers sowed (t5lite.models.moe.layer), for the router losses
    if self.config.moe is None:
      states = apply("hidden_states", *inputs)  # (B, L, D)
    else:
      states, routed = apply("hidden_states", *inputs, mutable=[ROUTER])
      routed = routed.get(ROUTER, {})
    target_key, weight_key, segment_key = self.target_features
    targets, weights, segment_ids = (batch[target_key], batch.get(weight_key),
                                     batch.get(segment_key))
    mlm = lambda pick: token_loss_sums(  # noqa: E731
        apply("mlm_logits", pick(states)), pick(targets), pick(weights),
        None if segment_ids is None else pick(segment_ids), self.loss)
    loss_sum, sums = self._on_chosen(mlm, weights)
    if self.config.span_boundary and "mlm_span_offset" in batch:
      sbo_sum, sbo = self._on_chosen(
          lambda pick: self._span_boundary_sums(apply, states, batch, pick), weights)
      # SpanBERT's loss is the MLM mean plus the SBO mean over the same span tokens.
      loss_sum = loss_sum + sbo_sum * sums["normalizer"] / jnp.maximum(sbo["normalizer"], 1.0)
      sums = dict(sums, sbo_loss=sbo_sum, sbo_weight_sum=sbo["weight_sum"])
    if not (self.config.sentence_classes and "sentence_labels" in batch):
      return self.with_router_losses(loss_sum, sums, routed)
    sentence = apply("sentence_logits", states)  # (B, C)
    labels = batch["sentence_labels"].astype(jnp.int32)  # (B,)
    log_probs = jax.nn.log_softmax(sentence.astype(jnp.float32))  # (B, C)
    sentence_nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    # Rows of padding (the eval loop's filler rows) carry no sentence label.
    real = (jnp.ones(labels.shape, jnp.float32) if segment_ids is None
            else jnp.any(segment_ids > 0, axis=1).astype(jnp.float32))  # (B,)
    rows = jnp.sum(real)
    sentence_sum = jnp.sum(sentence_nll * real)
    loss_sum = loss_sum + sentence_sum * sums["normalizer"] / jnp.maximum(rows, 1.0)
    hits = (jnp.argmax(sentence, -1) == labels).astype(jnp.float32) * real
    sums = dict(sums, sentence_loss=sentence_sum, sentence_rows=rows,
                sentence_correct=jnp.sum(hits))
    return self.with_router_losses(loss_sum, sums, routed)

  def _span_boundary_sums(self, apply, states, batch, pick):
    """token_loss_sums of SpanBERT's span boundary head at the picked positions: each span
    token predicted from the states at its span's boundaries (row positions) and its offset."""
    offset = pick(batch["mlm_span_offset"])  # (B, K)
    boundary = lambda key: jnp.take_along_axis(  # noqa: E731
        states, pick(batch[key])[:, :, None].astype(jnp.int32), axis=1)  # (B, K, D)
    weights = pick(batch["mlm_loss_weights"]) * (offset > 0)
    logits = apply("span_boundary_logits", boundary("mlm_span_left"),
                   boundary("mlm_span_right"), offset)
    return token_loss_sums(logits, pick(batch["mlm_target_tokens"]), weights, None, self.loss)

  def _on_chosen(self, loss_at, weights):
    return on_chosen(lambda pick, put: loss_at(pick), weights, self.loss.loss_normalizing_factor)

  def metrics(self, sums, normalizer):
    if self.config.head:
      return heads.metrics(sums, normalizer)
    out = super().metrics(sums, normalizer)
    out["mlm_accuracy"] = out["accuracy"]
    if "sbo_loss" in sums:
      out["sbo_loss"] = sums["sbo_loss"] / jnp.maximum(sums["sbo_weight_sum"], 1e-8)
    if "sentence_rows" in sums:
      out["sentence_loss"] = sums["sentence_loss"] / sums["sentence_rows"]
      out["sentence_accuracy"] = sums["sentence_correct"] / sums["sentence_rows"]
    return out

  def flops_per_example(self, lengths: Mapping[str, int]) -> float:
    """One stack over the L input positions, the output projection at every position (MLM
    targets are aligned with the inputs): 6*[P_enc*L + d*V*L] + 12*h*d_kv*n_enc*L^2."""
    c = self.config
    length = lengths["encoder_input_tokens"]
    layers = c.num_encoder_layers * c.layer_repeats  # shared layers still run at every slot
    p_enc = layers * attention_params(c) + (c.layer_repeats  # MoE: never shared (ModelConfig)
                                           * stack_mlp_params(c, "encoder", c.num_encoder_layers))
    output = c.embedding_width * c.vocab_size if not c.head else c.d_model * c.num_labels
    return float(6 * (p_enc + output) * length
                 + 12 * c.num_heads * c.d_kv * layers * length**2)
