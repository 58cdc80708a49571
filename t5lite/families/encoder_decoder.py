"""The encoder-decoder family (T5): inputs through the encoder, targets through the decoder.

Batches (EncDecFeatureConverter): encoder_input_tokens / decoder_input_tokens /
decoder_target_tokens / decoder_loss_weights with segment ids and positions when packed. The
loss is token cross entropy on the decoder's targets; decoding runs the encoder once and the
decoder step by step; HF's T5 layout (t5lite.interop.hf.checkpoints) is its import/export mapping.
"""
from __future__ import annotations

from typing import Mapping

from t5lite.data.converters import sequence as converters
from t5lite.data.objectives import chains as pretraining
from t5lite.families.base import Family, attention_params, stack_mlp_params
from t5lite.families.registry import register


@register
class EncoderDecoderFamily(Family):
  """T5 v1.0 / v1.1 and their variants."""

  name = "encoder_decoder"
  token_features = ("encoder_input_tokens", "decoder_target_tokens")
  decodes = True
  # A Mixture-of-Experts T5 is HF's Switch Transformers.
  hf_model_type = property(lambda self: "switch_transformers" if self.config.moe else "t5")

  def converter(self, pack: bool = True) -> converters.FeatureConverter:
    return converters.EncDecFeatureConverter(pack=pack, bos_id=self.config.bos_id)

  def pretraining_preprocessors(self, vocabulary) -> list:
    """T5's span corruption (sentinels are the vocabulary's extra ids)."""
    return pretraining.span_corruption_preprocessors()

  def flops_per_example(self, lengths: Mapping[str, int]) -> float:
    """6*[P_enc*L_in + (P_dec - P_xkv)*L_tgt + P_xkv*L_in + d*V*L_tgt]
         + 12*h*d_kv*[n_enc*L_in^2 + n_dec*(L_tgt^2 + L_tgt*L_in)]
    with P_xkv = 2*d*h*d_kv per decoder layer: cross-attention's K/V projections run over the
    L_in encoder positions, not the L_tgt decoder ones. T5 v1.1 base (12+12 layers, d 768,
    d_ff 2048, 12 heads of 64, V 32128) at 512/114: 6 * 64.84e9 + 36.88e9 = 425.9 GFLOP."""
    c = self.config
    l_in, l_tgt = lengths["encoder_input_tokens"], lengths["decoder_target_tokens"]
    n_enc, n_dec = c.num_encoder_layers, c.num_decoder_layers
    p_enc = n_enc * attention_params(c) + stack_mlp_params(c, "encoder", n_enc)
    p_dec = n_dec * 2 * attention_params(c) + stack_mlp_params(c, "decoder", n_dec)
    p_xkv = n_dec * 2 * c.d_model * c.num_heads * c.d_kv
    dense = p_enc * l_in + (p_dec - p_xkv) * l_tgt + p_xkv * l_in + c.d_model * c.vocab_size * l_tgt
    pairs = n_enc * l_in**2 + n_dec * (l_tgt**2 + l_tgt * l_in)
    return float(6 * dense + 12 * c.num_heads * c.d_kv * pairs)
