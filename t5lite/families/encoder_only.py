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
    means are then weighted by their microbatch's share of MLM tokens, not equally."""
    if not (self.config.sentence_classes and "sentence_labels" in batch):
      return super().loss_fn(params, batch, rng)
    dropout = rng is not None and self.config.dropout_rate > 0
    model = self.make_model(enable_dropout=dropout)
    logits, sentence = model.apply({"params": params}, **self.model_inputs(batch),
                                   with_sentence_logits=True,
                                   rngs={"dropout": rng} if dropout else None)
    target_key, weight_key, segment_key = self.target_features
    loss_sum, sums = token_loss_sums(logits, batch[target_key], batch.get(weight_key),
                                     batch.get(segment_key), self.loss)
    labels = batch["sentence_labels"].astype(jnp.int32)  # (B,)
    log_probs = jax.nn.log_softmax(sentence.astype(jnp.float32))  # (B, C)
    sentence_nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
    rows = jnp.asarray(labels.shape[0], jnp.float32)
    loss_sum = loss_sum + jnp.sum(sentence_nll) * sums["normalizer"] / rows
    sums = dict(sums, sentence_loss=jnp.sum(sentence_nll), sentence_rows=rows,
                sentence_correct=jnp.sum(jnp.argmax(sentence, -1) == labels).astype(jnp.float32))
    return loss_sum, sums

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
