"""The encoder-only family: a BERT-style encoder trained with masked language modelling.

Batches (EncoderOnlyFeatureConverter): encoder_input_tokens (masked) and mlm_target_tokens /
mlm_loss_weights (the original tokens; weight 1 where a token was chosen for prediction). The
loss is token cross entropy over the chosen positions. It has no decoder: nothing to generate.
"""
from __future__ import annotations

from typing import Mapping

from t5lite.data import converters, pretraining
from t5lite.families.base import Family, attention_params, mlp_params
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
    """BERT's MLM (15%, 80/10/10). The mask token is the vocabulary's first extra id
    (`<extra_id_0>`, its highest id), or unk (2) when it has none."""
    mask_id = vocabulary.vocab_size - 1 if vocabulary.extra_ids else 2
    return pretraining.mlm_preprocessors(mask_id=mask_id)

  def flops_per_example(self, lengths: Mapping[str, int]) -> float:
    """One stack over the L input positions, the output projection at every position (MLM
    targets are aligned with the inputs): 6*[P_enc*L + d*V*L] + 12*h*d_kv*n_enc*L^2."""
    c = self.config
    length = lengths["encoder_input_tokens"]
    p_enc = c.num_encoder_layers * (attention_params(c) + mlp_params(c))
    return float(6 * (p_enc + c.d_model * c.vocab_size) * length
                 + 12 * c.num_heads * c.d_kv * c.num_encoder_layers * length**2)
