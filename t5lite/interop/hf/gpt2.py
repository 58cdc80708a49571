"""The HF layout of GPT-2 (`GPT2LMHeadModel`, model_type 'gpt2'): a t5lite decoder-only model
with pre-LN LayerNorms (scale and bias, eps 1e-5), biases on every dense layer, tanh GELU
(HF's "gelu_new", our 'gelu'), attention scaled by 1/sqrt(d_head), learned positions and the
output projection tied to the token embedding:

  t5lite (decoder/...)                         GPT-2
  token_embedder/embedding                     transformer.wte.weight (lm_head when tied)
  position_embedder/embedding                  transformer.wpe.weight   (n_positions rows)
  layers_i/pre_attention_layer_norm            transformer.h.i.ln_1
  layers_i/attention/{query,key,value}         transformer.h.i.attn.c_attn   (fused q|k|v)
  layers_i/attention/out                       transformer.h.i.attn.c_proj
  layers_i/pre_mlp_layer_norm                  transformer.h.i.ln_2
  layers_i/mlp/wi, mlp/wo                      transformer.h.i.mlp.c_fc, mlp.c_proj
  decoder_norm                                 transformer.ln_f
  logits_dense/kernel (untied only)            lm_head.weight

GPT-2's Conv1D keeps weights as (in, out), so kernels are flattened, not transposed; c_attn
holds the query, key and value kernels side by side along `out` (HF splits its output in
three, each viewed as (heads, d_head)), and its bias likewise.

Config options: scale_attn_weights is our scale_attention; reorder_and_upcast_attn changes
only mixed-precision numerics (t5lite already computes attention logits and softmax in float32),
so it is read and ignored; scale_attn_by_inverse_layer_idx and add_cross_attention have no
t5lite equivalent and are refused. The three dropout rates become one dropout_rate (resid_pdrop).
bos_token_id / eos_token_id are ModelConfig.bos_id / eos_id both ways (GPT-2's 50256).

The published checkpoints (openai-community/gpt2 and its sizes) were saved from GPT2Model and
name their tensors without `transformer.`; `checkpoint_tensors` renames them to the names above.

GPT2ForSequenceClassification (config.head='sequence_classification'; t5lite.interop.hf.heads):
the backbone, no lm_head, and `score.weight` (head/score/kernel, no bias) on the last real
token. HF finds that token as the last one != pad_token_id, which export writes as 0 (the id
t5lite's head converter pads rows with); t5lite reads the last position with segment id > 0.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from t5lite.errors import ConfigError
from t5lite.interop.hf.bert import check_heads, norm_entries
from t5lite.interop.hf.heads import DECODER_HEADS, HeadSpec
from t5lite.interop.hf.layout import Entry, HFLayout, refuse, register
from t5lite.models.config import ModelConfig

# HF activation_function -> our mlp_activation, and back (GPT-2's MLP is ungated).
FROM_HF_ACTIVATION = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact",
                      "relu": "relu"}
TO_HF_ACTIVATION = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}
SIZES = {"vocab_size": "vocab_size", "n_embd": "d_model", "n_layer": "num_decoder_layers",
         "n_head": "num_heads", "n_positions": "max_position_embeddings"}
# Every option a GPT-2 config must have, with the value HF's model has.
GPT2_NEEDS = dict(architecture="decoder_only", norm="layer", norm_position="pre",
                  use_bias=True, position_encoding="learned", position_offset=0,
                  scale_logits=False, scale_embeddings=False, embedding_norm=False,
                  prefix_lm=False)
# GPT-2 options t5lite has no equivalent of, with the value it can read.
UNSUPPORTED = {"scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
# GPT2ForSequenceClassification has no dropout before `score`: no classifier dropout key.
HEADS = HeadSpec("GPT2", ("GPT2LMHeadModel", "GPT2Model"), heads=DECODER_HEADS,
                 dropout_key=None, decoder=True)


def check_kv_heads(config: ModelConfig, model_type: str) -> None:
  """GPT-2 (and BERT) have one key/value head per query head: no grouped-query attention."""
  if config.kv_heads != config.num_heads:
    raise ConfigError(f"HF {model_type!r} has no grouped-query attention; this model has "
                      f"num_key_value_heads={config.num_key_value_heads} < num_heads="
                      f"{config.num_heads} (set num_key_value_heads=0 to export it)")


@register
class Gpt2Layout(HFLayout):
  """GPT2LMHeadModel (also distilgpt2, which shares model_type 'gpt2')."""
  model_types = ("gpt2",)
  heads = HEADS
  size_fields = tuple(SIZES)

  def config_to_hf(self, config: ModelConfig) -> dict:
    HEADS.check(config, "gpt2")
    refuse(config, "gpt2", GPT2_NEEDS)
    check_heads(config, "gpt2")
    check_kv_heads(config, "gpt2")
    if config.mlp_activation not in TO_HF_ACTIVATION:
      raise ConfigError(f"HF 'gpt2' has no equivalent of mlp_activation="
                        f"{config.mlp_activation!r} (its MLP is ungated: "
                        f"{sorted(TO_HF_ACTIVATION)})")
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_position_embeddings,
        "n_embd": config.d_model,
        "n_layer": config.num_decoder_layers,
        "n_head": config.num_heads,
        "n_inner": config.d_ff,
        "activation_function": TO_HF_ACTIVATION[config.mlp_activation],
        "resid_pdrop": config.dropout_rate,
        "embd_pdrop": config.dropout_rate,
        "attn_pdrop": config.dropout_rate,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.init_std or 0.02,
        "scale_attn_weights": config.scale_attention,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": config.tie_output_embedding,
        "use_cache": True,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        **HEADS.config_to_hf(config),
    }

  def config_from_hf(self, hf: Mapping, tensors, **overrides) -> ModelConfig:
    for key, readable in UNSUPPORTED.items():
      if hf.get(key, readable) != readable:
        raise ConfigError(f"config.json: {key}={hf[key]!r} has no t5lite equivalent (t5lite "
                          f"reads GPT-2 models with {key}={readable})")
    sizes = self.sizes(hf, SIZES, defaults={"n_positions": 1024})
    if sizes["d_model"] % sizes["num_heads"]:
      raise ConfigError(f"config.json: n_embd={sizes['d_model']} is not a multiple of "
                        f"n_head={sizes['num_heads']}")
    inner = hf.get("n_inner")  # None: 4 * n_embd, as HF's GPT2MLP
    d_ff = 4 * sizes["d_model"] if inner is None else self.sizes(hf, {"n_inner": "d_ff"})["d_ff"]
    values = dict(
        architecture="decoder_only", family="gpt2", **sizes, d_ff=d_ff,
        d_kv=sizes["d_model"] // sizes["num_heads"],
        mlp_activation=self.choice(hf, "activation_function", FROM_HF_ACTIVATION, "gelu_new"),
        norm="layer", norm_position="pre", use_bias=True,
        scale_attention=bool(hf.get("scale_attn_weights", True)),
        layer_norm_epsilon=self.number(hf, "layer_norm_epsilon", 1e-5),
        position_encoding="learned",
        tie_output_embedding=bool(hf.get("tie_word_embeddings", True)),
        init_std=self.number(hf, "initializer_range", 0.02),
        dropout_rate=self.rate(hf, "resid_pdrop", 0.1),
        # GPT-2's <|endoftext|> (50256) both starts and ends its texts.
        **self.token_ids(hf, sizes["vocab_size"], "bos_token_id", 50256, 50256))
    head = HEADS.head_from_hf(hf, tensors)
    if head:
      values.update(HEADS.values_from_hf(hf, head))
    return ModelConfig(**{**values, **overrides})

  @staticmethod
  def checkpoint_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors under GPT2LMHeadModel's names. The published GPT-2 checkpoints
    (openai-community/gpt2, -medium, ...) were saved from GPT2Model: `wte.weight`,
    `h.0.attn.c_attn.weight`, ... without the `transformer.` prefix (transformers adds it when
    it loads them); such names get it here. No copies: the same arrays under new names."""
    prefix = "transformer."
    if any(name.startswith(prefix) for name in tensors):
      return dict(tensors)
    return {name if name.startswith(("lm_head.", "score.")) else prefix + name: value
            for name, value in tensors.items()}

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    entries = [Entry((("token_embedder", "embedding"),), "transformer.wte.weight"),
               Entry((("decoder", "position_embedder", "embedding"),), "transformer.wpe.weight")]
    for i in range(config.num_decoder_layers):
      ours, hf = ("decoder", f"layers_{i}"), f"transformer.h.{i}"
      qkv = [ours + ("attention", n) for n in ("query", "key", "value")]
      out, wi, wo = ours + ("attention", "out"), ours + ("mlp", "wi"), ours + ("mlp", "wo")
      entries += norm_entries(ours + ("pre_attention_layer_norm",), f"{hf}.ln_1")
      entries += [Entry(tuple(p + ("kernel",) for p in qkv), f"{hf}.attn.c_attn.weight", "conv1d"),
                  Entry(tuple(p + ("bias",) for p in qkv), f"{hf}.attn.c_attn.bias", "vector"),
                  Entry((out + ("kernel",),), f"{hf}.attn.c_proj.weight", "conv1d", n_in=2),
                  Entry((out + ("bias",),), f"{hf}.attn.c_proj.bias", "vector")]
      entries += norm_entries(ours + ("pre_mlp_layer_norm",), f"{hf}.ln_2")
      for path, name in ((wi, "c_fc"), (wo, "c_proj")):
        entries += [Entry((path + ("kernel",),), f"{hf}.mlp.{name}.weight", "conv1d"),
                    Entry((path + ("bias",),), f"{hf}.mlp.{name}.bias", "vector")]
    entries += norm_entries(("decoder", "decoder_norm"), "transformer.ln_f")
    if config.head:  # a classifier: `score`, no LM head
      return entries + HEADS.entries(config)
    if not config.tie_output_embedding:
      entries.append(Entry((("decoder", "logits_dense", "kernel"),), "lm_head.weight", "linear"))
    return entries
