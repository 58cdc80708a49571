"""The HF layout of LLaMA (`LlamaForCausalLM`, model_type 'llama'): a t5lite decoder-only model
with pre-RMSNorm (scale only, eps `rms_norm_eps`), a gated MLP down(act(gate) * up) (SiLU:
our 'swiglu'), rotary positions (rotate-half, our 'rope'), grouped-query attention
(num_key_value_heads), heads of `head_dim` (which may differ from hidden_size / heads),
attention scaled by 1/sqrt(head_dim), no biases by default and an untied output projection:

  t5lite (decoder/...)                         LLaMA
  token_embedder/embedding                     model.embed_tokens.weight (lm_head when tied)
  layers_i/pre_attention_layer_norm/scale      model.layers.i.input_layernorm.weight
  layers_i/attention/{query,key,value,out}     model.layers.i.self_attn.{q,k,v,o}_proj
  layers_i/pre_mlp_layer_norm/scale            model.layers.i.post_attention_layernorm.weight
  layers_i/mlp/wi_0, wi_1, wo                  model.layers.i.mlp.gate_proj, up_proj, down_proj
  decoder_norm/scale                           model.norm.weight
  logits_dense/kernel (untied)                 lm_head.weight

Rotary settings: transformers 5.x keeps them in `rope_parameters` ({rope_type, rope_theta});
4.x-era configs have a top-level `rope_theta` and `rope_scaling`. Only the default rotary
type has a t5lite equivalent: scaled variants (linear, dynamic, yarn, llama3, ...) are refused
by name. `attention_bias` and `mlp_bias` must agree (t5lite's use_bias covers both).
LLaMA's residual stream has no dropout, so an import has dropout_rate 0 (attention_dropout
is not read). Export writes both rope spellings; bos_token_id / eos_token_id are ModelConfig.bos_id / eos_id.

LlamaForSequenceClassification (config.head='sequence_classification'; t5lite.interop.hf.heads):
the backbone, no lm_head, and `score.weight` (head/score/kernel, no bias) on the last token
!= pad_token_id, written as 0 (t5lite's head converter pads with 0 and reads the last position
with segment id > 0).
"""
from __future__ import annotations

from typing import Mapping

from t5lite.errors import ConfigError
from t5lite.interop import limits
from t5lite.interop.hf.heads import DECODER_HEADS, HeadSpec
from t5lite.interop.hf.layout import Entry, HFLayout, refuse, register
from t5lite.models.config import ModelConfig

# HF hidden_act (applied to gate_proj) -> our gated mlp_activation, and back.
FROM_HF_ACTIVATION = {"silu": "swiglu", "swish": "swiglu", "gelu_new": "gated-gelu",
                      "gelu_pytorch_tanh": "gated-gelu", "relu": "reglu"}
TO_HF_ACTIVATION = {"swiglu": "silu", "gated-gelu": "gelu_new", "reglu": "relu"}
SIZES = {"vocab_size": "vocab_size", "hidden_size": "d_model",
         "intermediate_size": "d_ff", "num_hidden_layers": "num_decoder_layers",
         "num_attention_heads": "num_heads"}
# Every option a LLaMA config must have, with the value HF's model has.
LLAMA_NEEDS = dict(architecture="decoder_only", norm="rms", norm_position="pre",
                   scale_attention=True, position_encoding="rope", scale_logits=False,
                   scale_embeddings=False, embedding_norm=False, prefix_lm=False)
# 'LLaMAForCausalLM': the class's name in early conversions. No dropout before `score`.
HEADS = HeadSpec("Llama", ("LlamaForCausalLM", "LLaMAForCausalLM"), heads=DECODER_HEADS,
                 dropout_key=None, decoder=True)


def rope_theta(hf: Mapping) -> float:
  """The rotary base of a config (5.x rope_parameters, or 4.x rope_theta / rope_scaling);
  a ConfigError names any rotary setting t5lite cannot run."""
  params = hf.get("rope_parameters")
  theta = hf.get("rope_theta", 10000.0)
  for key, settings in (("rope_parameters", params), ("rope_scaling", hf.get("rope_scaling"))):
    if settings is None:
      continue
    if not isinstance(settings, Mapping):
      raise ConfigError(f"config.json: {key}={settings!r} is not an object of rotary settings")
    kind = settings.get("rope_type", settings.get("type", "default"))
    if kind != "default":
      raise ConfigError(f"config.json: {key}.rope_type={kind!r} has no t5lite equivalent "
                        "(t5lite runs the default, unscaled rotary embedding only)")
    if settings.get("partial_rotary_factor", 1.0) != 1.0:
      raise ConfigError(f"config.json: {key}.partial_rotary_factor="
                        f"{settings['partial_rotary_factor']!r} has no t5lite equivalent "
                        "(t5lite rotates every feature of a head)")
    theta = settings.get("rope_theta", theta)
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1:
    raise ConfigError(f"config.json: rope_theta={theta!r} is not a rotary base > 1")
  return float(theta)


def _optional_size(hf: Mapping, key: str, default: int) -> int:
  """A size HF's LlamaConfig derives when it is absent or null."""
  value = hf.get(key)
  return default if value is None else limits.size_field(value, key, "config.json")


@register
class LlamaLayout(HFLayout):
  """LlamaForCausalLM (LLaMA 1/2/3-style checkpoints with the default rotary embedding)."""
  model_types = ("llama",)
  heads = HEADS
  size_fields = tuple(SIZES)

  def config_to_hf(self, config: ModelConfig) -> dict:
    HEADS.check(config, "llama")
    refuse(config, "llama", LLAMA_NEEDS)
    if config.mlp_activation not in TO_HF_ACTIVATION:
      raise ConfigError(f"HF 'llama' has no equivalent of mlp_activation="
                        f"{config.mlp_activation!r} (its MLP is gated: "
                        f"{sorted(TO_HF_ACTIVATION)})")
    if config.d_model % config.num_heads:  # HF's LlamaConfig refuses to load such a config
      raise ConfigError(f"HF 'llama' needs hidden_size divisible by num_attention_heads; this "
                        f"model has d_model={config.d_model}, num_heads={config.num_heads}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.num_decoder_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.d_kv,
        "hidden_act": TO_HF_ACTIVATION[config.mlp_activation],
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layer_norm_epsilon,
        # 5.x reads rope_parameters (and ignores rope_theta beside it); 4.x reads rope_theta.
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "attention_bias": config.use_bias,
        "mlp_bias": config.use_bias,
        "attention_dropout": 0.0,
        "initializer_range": config.init_std or 0.02,
        "tie_word_embeddings": config.tie_output_embedding,
        "use_cache": True,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        **HEADS.config_to_hf(config),
    }

  def config_from_hf(self, hf: Mapping, tensors, **overrides) -> ModelConfig:
    sizes = self.sizes(hf, SIZES)
    d, heads = sizes["d_model"], sizes["num_heads"]
    if d % heads:
      raise ConfigError(f"config.json: hidden_size={d} is not a multiple of "
                        f"num_attention_heads={heads} (HF's LlamaConfig refuses it too)")
    kv_heads = _optional_size(hf, "num_key_value_heads", heads)
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if bool(attention_bias) != bool(mlp_bias):
      raise ConfigError(f"config.json: attention_bias={attention_bias!r} but mlp_bias="
                        f"{mlp_bias!r}; t5lite's use_bias puts biases on both or neither")
    values = dict(
        architecture="decoder_only", family="llama", **sizes,
        d_kv=_optional_size(hf, "head_dim", d // heads),
        num_key_value_heads=0 if kv_heads == heads else kv_heads,
        mlp_activation=self.choice(hf, "hidden_act", FROM_HF_ACTIVATION, "silu"),
        norm="rms", norm_position="pre", use_bias=bool(attention_bias), scale_attention=True,
        layer_norm_epsilon=self.number(hf, "rms_norm_eps", 1e-6),
        position_encoding="rope", rope_theta=rope_theta(hf),
        max_position_embeddings=_optional_size(hf, "max_position_embeddings", 2048),
        tie_output_embedding=bool(hf.get("tie_word_embeddings", False)),
        init_std=self.number(hf, "initializer_range", 0.02), dropout_rate=0.0,
        **self.token_ids(hf, sizes["vocab_size"], "bos_token_id", 1, 2))  # <s>, </s>
    head = HEADS.head_from_hf(hf, tensors)
    if head:
      values.update(HEADS.values_from_hf(hf, head))
    return ModelConfig(**{**values, **overrides})

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    def dense(ours: tuple[str, ...], hf: str, n_in: int = 1) -> list[Entry]:
      entries = [Entry((ours + ("kernel",),), f"{hf}.weight", "linear", n_in)]
      if config.use_bias:
        entries.append(Entry((ours + ("bias",),), f"{hf}.bias", "vector"))
      return entries

    entries = [Entry((("token_embedder", "embedding"),), "model.embed_tokens.weight")]
    for i in range(config.num_decoder_layers):
      ours, hf = ("decoder", f"layers_{i}"), f"model.layers.{i}"
      entries.append(Entry((ours + ("pre_attention_layer_norm", "scale"),),
                           f"{hf}.input_layernorm.weight"))
      for name, proj in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o")):
        entries += dense(ours + ("attention", name), f"{hf}.self_attn.{proj}_proj",
                         2 if name == "out" else 1)
      entries.append(Entry((ours + ("pre_mlp_layer_norm", "scale"),),
                           f"{hf}.post_attention_layernorm.weight"))
      for name, proj in (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down")):
        entries += dense(ours + ("mlp", name), f"{hf}.mlp.{proj}_proj")
    entries.append(Entry((("decoder", "decoder_norm", "scale"),), "model.norm.weight"))
    if config.head:  # a classifier: `score`, no LM head
      return entries + HEADS.entries(config)
    if not config.tie_output_embedding:
      entries.append(Entry((("decoder", "logits_dense", "kernel"),), "lm_head.weight", "linear"))
    return entries
