"""The landmark models of the BERT and GPT lines as families: each is its architecture's family
with an HF layout (t5lite.interop.hf.<type>) to import from and export to.

    ModelConfig(architecture="encoder_only", family="bert", ...)   # BertForPreTraining
    ModelConfig(architecture="decoder_only", family="gpt2", ...)   # GPT2LMHeadModel

They train, decode and count FLOPs exactly as the generic encoder-only and decoder-only
families; the layer options that make a model BERT or GPT-2 are ModelConfig fields (gin
configs under gin/models/<name>/ set them), so that the family adds only the HF mapping.
"""
from __future__ import annotations

from t5lite.errors import ConfigError
from t5lite.families.decoder_only import DecoderOnlyFamily
from t5lite.families.encoder_only import EncoderOnlyFamily
from t5lite.families.registry import register


class ArchitectureChecked:
  """Refuses a config of another architecture (a 'bert' decoder would export nonsense)."""
  architecture = ""

  def __post_init__(self):
    if self.config.architecture != self.architecture:
      raise ConfigError(f"family {self.name!r} is an {self.architecture} family; the config "
                        f"says architecture={self.config.architecture!r}")


@register
class BertFamily(ArchitectureChecked, EncoderOnlyFamily):
  """BERT (HF BertForPreTraining: MLM head, pooler and next-sentence head)."""
  name = "bert"
  hf_model_type = "bert"
  architecture = "encoder_only"


@register
class RobertaFamily(ArchitectureChecked, EncoderOnlyFamily):
  """RoBERTa (HF RobertaForMaskedLM: positions start after the padding index)."""
  name = "roberta"
  hf_model_type = "roberta"
  architecture = "encoder_only"


@register
class AlbertFamily(ArchitectureChecked, EncoderOnlyFamily):
  """ALBERT (HF AlbertForPreTraining: factorized embeddings, shared layers, SOP head)."""
  name = "albert"
  hf_model_type = "albert"
  architecture = "encoder_only"


@register
class Gpt2Family(ArchitectureChecked, DecoderOnlyFamily):
  """GPT-2 (HF GPT2LMHeadModel: learned positions, LayerNorm with bias, tanh GELU, tied)."""
  name = "gpt2"
  hf_model_type = "gpt2"
  architecture = "decoder_only"


@register
class LlamaFamily(ArchitectureChecked, DecoderOnlyFamily):
  """LLaMA-style decoders (HF LlamaForCausalLM: RoPE, SwiGLU, RMSNorm, grouped-query)."""
  name = "llama"
  hf_model_type = "llama"
  architecture = "decoder_only"
