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

from t5lite.data import converters, pretraining
from t5lite.families.base import Family, attention_params, mlp_params, token_loss_sums
from t5lite.models import losses


def mlm_slots(length: int) -> int:
  """Positions per row the MLM head runs on: a quarter of the row (BERT chooses 15%), in
  multiples of 8. Example: 128 -> 32, 512 -> 128, 10 -> 8."""
  quarter = -(-length // 4)  # ceil(L / 4)
  return min(length, (quarter + 7) // 8 * 8)
from t5lite.families.registry import register


@register
class EncoderOnlyFamily(Family):
  """Masked language models (the MLM head predicts every position)."""

  name = "encoder_only"
  target_features = ("mlm_target_tokens", "mlm_loss_weights", "encoder_segment_ids")
  token_features = ("encoder_input_tokens",)

  def converter(self, pack: bool = True) -> converters.FeatureConverter:
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
    dropout = rng is not None and self.config.dropout_rate > 0
    model = self.make_model(enable_dropout=dropout)
    apply = lambda method, *args: model.apply(  # noqa: E731
        {"params": params}, *args, method=method, rngs={"dropout": rng} if dropout else None)
    states = apply("hidden_states", *[batch.get(k) for k in model.INPUTS])  # (B, L, D)
    target_key, weight_key, segment_key = self.target_features
    loss_sum, sums = self._mlm_loss(apply, states, batch[target_key], batch.get(weight_key),
                                    batch.get(segment_key))
    if not (self.config.sentence_classes and "sentence_labels" in batch):
      return loss_sum, sums
    sentence = apply("sentence_logits", states)  # (B, C)
    labels = batch["sentence_labels"].astype(jnp.int32)  # (B,)
    log_probs = jax.nn.log_softmax(sentence.astype(jnp.float32))  # (B, C)
    sentence_nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    rows = jnp.asarray(labels.shape[0], jnp.float32)
    loss_sum = loss_sum + jnp.sum(sentence_nll) * sums["normalizer"] / rows
    sums = dict(sums, sentence_loss=jnp.sum(sentence_nll), sentence_rows=rows,
                sentence_correct=jnp.sum(jnp.argmax(sentence, -1) == labels).astype(jnp.float32))
    return loss_sum, sums

  def _mlm_loss(self, apply, states, targets, weights, segment_ids):
    """token_loss_sums of the MLM head, on the weighted positions when they fit the slots."""
    full = lambda: token_loss_sums(apply("mlm_logits", states), targets, weights,  # noqa: E731
                                   segment_ids, self.loss)
    slots = mlm_slots(targets.shape[1])
    # NUM_TOTAL_TARGET_TOKENS counts every position, AVERAGE_PER_SEQUENCE every segment.
    if (weights is None or slots >= targets.shape[1]
        or self.loss.loss_normalizing_factor in (losses.NUM_TOTAL_TARGET_TOKENS,
                                                 losses.AVERAGE_PER_SEQUENCE)):
      return full()
    chosen = weights > 0  # (B, L)
    # Each row's weighted positions first (stable: in order), then the rest.
    order = jnp.argsort(~chosen, axis=1, stable=True)[:, :slots]  # (B, K)
    take = lambda x: jnp.take_along_axis(x, order, axis=1)  # noqa: E731

    def gathered():
      picked = jnp.take_along_axis(states, order[:, :, None], axis=1)  # (B, K, D)
      return token_loss_sums(apply("mlm_logits", picked), take(targets), take(weights),
                             None if segment_ids is None else take(segment_ids), self.loss)
    return jax.lax.cond(jnp.all(jnp.sum(chosen, axis=1) <= slots), gathered, full)

  def metrics(self, sums, normalizer):
    out = super().metrics(sums, normalizer)
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
    p_enc = layers * (attention_params(c) + mlp_params(c))
    return float(6 * (p_enc + c.embedding_width * c.vocab_size) * length
                 + 12 * c.num_heads * c.d_kv * layers * length**2)
