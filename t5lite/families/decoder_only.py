"""The decoder-only family: a causal LM, or a prefix LM (ModelConfig.prefix_lm).

Batches (DecoderOnlyFeatureConverter): inputs and targets concatenated into one stream,
decoder_input_tokens / decoder_target_tokens / decoder_loss_weights (the loss covers the
targets only), and decoder_causal_attention marking a prefix LM's bidirectional prefix.
Decoding continues a prompt in the same stream, so it can be prompted few-shot.

With ModelConfig.head='sequence_classification' (GPT2ForSequenceClassification, GPT-1's
finetuning), batches, loss and metrics are the head's (t5lite.families.heads).
"""
from __future__ import annotations

from typing import Mapping

from t5lite.data.converters import sequence as converters
from t5lite.data.objectives import chains as pretraining
from t5lite.families import heads
from t5lite.families.base import Family, attention_params, stack_mlp_params
from t5lite.families.registry import register


@register
class DecoderOnlyFamily(Family):
  """GPT-style language models (RoPE, SwiGLU, RMSNorm or the classic options)."""

  name = "decoder_only"
  token_features = ("decoder_target_tokens",)
  decodes = True
  continues_prompts = True

  def converter(self, pack: bool = True) -> converters.FeatureConverter:
    if self.config.head:
      return heads.converter(self.config)
    return converters.DecoderOnlyFeatureConverter(pack=pack, prefix_lm=self.config.prefix_lm,
                                                  bos_id=self.config.bos_id)

  def pretraining_preprocessors(self, vocabulary) -> list:
    """Next-token prediction over concatenated text; a prefix LM splits each piece into a
    bidirectional prefix and its continuation."""
    if self.config.prefix_lm:
      return pretraining.prefix_lm_preprocessors()
    return pretraining.causal_lm_preprocessors()

  def loss_fn(self, params, batch, rng):
    if self.config.head:
      return heads.family_loss(self, params, batch, rng)
    return super().loss_fn(params, batch, rng)

  def metrics(self, sums, normalizer):
    if self.config.head:
      return heads.metrics(sums, normalizer)
    return super().metrics(sums, normalizer)

  def tokens_per_example(self, lengths: Mapping[str, int]) -> int:
    if self.config.head:
      return int(lengths["decoder_input_tokens"])
    return super().tokens_per_example(lengths)

  def flops_per_example(self, lengths: Mapping[str, int]) -> float:
    """One stack over the stream's L positions (inputs and targets together):
    6*[P_dec*L + d*V*L] + 12*h*d_kv*n_dec*L^2 (a classifier head: no d*V*L unless it has
    GPT-1's auxiliary LM loss)."""
    c = self.config
    length = lengths.get("decoder_target_tokens") or lengths["decoder_input_tokens"]
    p_dec = (c.num_decoder_layers * attention_params(c)
             + stack_mlp_params(c, "encoder", c.num_decoder_layers))  # MoE: the encoder's step
    output = c.vocab_size if (not c.head or c.lm_loss_weight) else c.num_labels
    return float(6 * (p_dec + c.d_model * output) * length
                 + 12 * c.num_heads * c.d_kv * c.num_decoder_layers * length**2)
