"""The HF layout of T5 (`T5ForConditionalGeneration`, also mT5): t5lite's encoder-decoder.

Layout facts: torch Linear weights are (out, in), so kernels are transposed; attention
kernels (D, H, K) flatten to (H*K, D). The relative bias table sits in block 0 of each stack.
transformers 5.x always says `tie_word_embeddings: true` and records logit scaling as
`scale_decoder_outputs`; 4.x-era configs use `tie_word_embeddings` for both, so an export
needs tie_output_embedding == scale_logits (the combinations both read alike). A model is
untied when its checkpoint has an `lm_head.weight` that differs from `shared.weight`.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from t5lite.errors import ConfigError, ConfigKeyError
from t5lite.interop import limits
from t5lite.interop.hf.layout import Entry, HFLayout, refuse, register
from t5lite.models.config import GATED_ACTIVATIONS, ModelConfig
from t5lite.models.transformer import CROSS_ATTENTION

# Our activation names <-> HF `feed_forward_proj` ("gated-X" = act(wi_0) * wi_1).
TO_HF_ACTIVATION = {"relu": "relu", "gated-gelu": "gated-gelu", "gelu": "gelu_new",
                    "swiglu": "gated-silu", "reglu": "gated-relu"}
FROM_HF_ACTIVATION = {v: k for k, v in TO_HF_ACTIVATION.items()}
# config.json sizes -> ModelConfig fields; each must be a positive integer.
SIZE_FIELDS = {"vocab_size": "vocab_size", "d_model": "d_model", "d_ff": "d_ff",
               "num_heads": "num_heads", "d_kv": "d_kv", "num_layers": "num_encoder_layers",
               "num_decoder_layers": "num_decoder_layers",
               "relative_attention_num_buckets": "relative_attention_num_buckets",
               "relative_attention_max_distance": "relative_attention_max_distance"}
# Options HF's T5 has no equivalent for, with the value it needs.
T5_NEEDS = dict(norm="rms", norm_position="pre", position_encoding="relative_bias",
                use_bias=False, scale_attention=False, num_key_value_heads=0,
                scale_embeddings=False, embedding_norm=False)


def config_to_hf(config: ModelConfig) -> dict:
  """HF config.json contents; raises for variants that HF's T5 cannot express."""
  refuse(config, "t5", T5_NEEDS)
  if config.moe is not None:
    raise ConfigError("a Mixture-of-Experts model (ModelConfig.moe) exports to HF "
                      "'switch_transformers', not 't5'")
  if config.mlp_activation not in TO_HF_ACTIVATION:
    raise ConfigError(f"HF 't5' has no equivalent of mlp_activation={config.mlp_activation!r} "
                      f"(it has {sorted(TO_HF_ACTIVATION)}); this model cannot be exported")
  if config.tie_output_embedding != config.scale_logits:
    # transformers 4.x reads tie_word_embeddings as "tie and scale": such an export would
    # give it wrong logits (5.x alone reads scale_decoder_outputs).
    raise ConfigError(
        f"tie_output_embedding={config.tie_output_embedding} but scale_logits="
        f"{config.scale_logits}: HF's T5 layout (transformers 4.x semantics, where "
        "tie_word_embeddings means tied and scaled) needs them equal; this model cannot be "
        "exported to it")
  return {
      "architectures": ["T5ForConditionalGeneration"],
      "model_type": "t5",
      "d_model": config.d_model,
      "d_kv": config.d_kv,
      "d_ff": config.d_ff,
      "num_layers": config.num_encoder_layers,
      "num_decoder_layers": config.num_decoder_layers,
      "num_heads": config.num_heads,
      "feed_forward_proj": TO_HF_ACTIVATION[config.mlp_activation],
      "relative_attention_num_buckets": config.relative_attention_num_buckets,
      "relative_attention_max_distance": config.relative_attention_max_distance,
      "layer_norm_epsilon": config.layer_norm_epsilon,
      "dropout_rate": config.dropout_rate,
      "initializer_factor": 1.0,
      "is_encoder_decoder": True,
      "tie_word_embeddings": config.tie_output_embedding,
      "scale_decoder_outputs": config.scale_logits,
      "vocab_size": config.vocab_size,
      "pad_token_id": 0,
      "eos_token_id": config.eos_id,
      "decoder_start_token_id": config.bos_id,
      "use_cache": True,
  }


def hf_sizes(hf: Mapping, where: str = "config.json") -> dict[str, int]:
  """config.json's sizes by HF name, each checked to be a positive integer (a ConfigError
  names the field otherwise); num_decoder_layers defaults to num_layers, as in HF."""
  if not isinstance(hf, Mapping):
    raise ConfigError(f"{where}: a JSON {type(hf).__name__}, not an object of settings")
  defaults = {"num_decoder_layers": None, "relative_attention_num_buckets": 32,
              "relative_attention_max_distance": 128}
  sizes = {}
  for field in SIZE_FIELDS:
    if field not in hf and field not in defaults:
      raise ConfigError(f"{where} lacks {field!r}: not an HF T5 config")
    value = hf.get(field, defaults.get(field))
    if field == "num_decoder_layers" and (value is None or (value == 0 and value is not False)):
      value = sizes["num_layers"]  # HF's T5Config: None (or 0) means as many as the encoder
    sizes[field] = limits.size_field(value, field, where)
  return sizes


def implied_params(sizes: Mapping[str, int], gated: bool) -> int:
  """Parameters an HF T5 config implies (Python ints: no overflow), lm_head left out."""
  d, f, h, k = sizes["d_model"], sizes["d_ff"], sizes["num_heads"], sizes["d_kv"]
  attention, mlp = 4 * d * h * k, (3 if gated else 2) * d * f
  return (sizes["vocab_size"] * d + 2 * sizes["relative_attention_num_buckets"] * h + 2 * d
          + sizes["num_layers"] * (attention + mlp + 2 * d)
          + sizes["num_decoder_layers"] * (2 * attention + mlp + 3 * d))


def config_from_hf(hf: Mapping, *, tied: bool, **overrides) -> ModelConfig:
  """ModelConfig from HF config.json contents; `tied` comes from the weights (see module doc)."""
  if hf.get("model_type", "t5") not in T5Layout.model_types:  # mT5 shares T5's layout
    raise ConfigError(f"model_type={hf.get('model_type')!r}: not an HF T5 config")
  proj = hf.get("feed_forward_proj", "relu")
  if not isinstance(proj, str) or proj not in FROM_HF_ACTIVATION:
    raise ConfigError(f"feed_forward_proj={proj!r} has no t5lite equivalent; "
                      f"supported: {sorted(FROM_HF_ACTIVATION)}")
  # 5.x: scale_decoder_outputs; 4.x-era: tie_word_embeddings also meant "scale" (default True).
  scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
  sizes = {SIZE_FIELDS[field]: value for field, value in hf_sizes(hf).items()}
  values = dict(  # ModelConfig's default architecture: T5's encoder-decoder
      **sizes,
      mlp_activation=FROM_HF_ACTIVATION[proj],
      norm="rms",
      layer_norm_epsilon=HFLayout.number(hf, "layer_norm_epsilon", 1e-6),
      position_encoding="relative_bias",
      tie_output_embedding=tied,
      scale_logits=bool(scale),
      dropout_rate=HFLayout.rate(hf, "dropout_rate", 0.1),  # HF's T5Config default
      **HFLayout.token_ids(hf, sizes["vocab_size"], "decoder_start_token_id", 0, 1),
  )
  values.update(overrides)
  return ModelConfig(**values)


def _attention(ours: tuple[str, ...], hf: str) -> list[Entry]:
  return [Entry((ours + (n, "kernel"),), f"{hf}.{h}.weight", "linear", 2 if n == "out" else 1)
          for n, h in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))]


def _norm(ours: tuple[str, ...], hf: str) -> Entry:
  return Entry((ours + ("scale",),), f"{hf}.weight")


def _mlp(config: ModelConfig, ours: tuple[str, ...], hf: str) -> list[Entry]:
  wis = ("wi_0", "wi_1") if config.gated_mlp else ("wi",)
  return [Entry((ours + ("mlp", w, "kernel"),), f"{hf}.DenseReluDense.{w}.weight", "linear")
          for w in wis + ("wo",)]


def weight_map(config: ModelConfig) -> list[Entry]:
  """Every HF tensor of a T5 config and the param of ours (unscanned layout) it holds."""
  entries = [Entry((("token_embedder", "embedding"),), "shared.weight")]
  if not config.tie_output_embedding:
    entries.append(Entry((("decoder", "logits_dense", "kernel"),), "lm_head.weight", "linear"))
  for stack, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    entries.append(Entry(((stack, "relpos_bias", "rel_embedding"),),
                         f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"))
    entries.append(_norm((stack, f"{stack}_norm"), f"{stack}.final_layer_norm"))
    for i in range(n):
      ours, hf = (stack, f"layers_{i}"), f"{stack}.block.{i}"
      if stack == "encoder":
        entries += (_attention(ours + ("attention",), f"{hf}.layer.0.SelfAttention")
                    + [_norm(ours + ("pre_attention_layer_norm",), f"{hf}.layer.0.layer_norm")]
                    + _mlp(config, ours, f"{hf}.layer.1")
                    + [_norm(ours + ("pre_mlp_layer_norm",), f"{hf}.layer.1.layer_norm")])
      else:
        entries += (
            _attention(ours + ("self_attention",), f"{hf}.layer.0.SelfAttention")
            + [_norm(ours + ("pre_self_attention_layer_norm",), f"{hf}.layer.0.layer_norm")]
            + _attention(ours + (CROSS_ATTENTION,), f"{hf}.layer.1.EncDecAttention")
            + [_norm(ours + ("pre_cross_attention_layer_norm",), f"{hf}.layer.1.layer_norm")]
            + _mlp(config, ours, f"{hf}.layer.2")
            + [_norm(ours + ("pre_mlp_layer_norm",), f"{hf}.layer.2.layer_norm")])
  return entries


def tied_lm_head(tensors: Mapping[str, np.ndarray] | None, model: str) -> bool:
  """Whether the checkpoint's output projection is its shared embedding: no lm_head.weight,
  or one equal to shared.weight (tensors None: config.json alone, taken as tied)."""
  if tensors is None:
    return True
  if "shared.weight" not in tensors:
    raise ConfigKeyError(f"the checkpoint holds no 'shared.weight': not an HF {model} checkpoint")
  lm_head = tensors.get("lm_head.weight")
  return lm_head is None or np.array_equal(lm_head, tensors["shared.weight"])


@register
class T5Layout(HFLayout):
  """T5 v1.0 / v1.1 / mT5 (`T5ForConditionalGeneration`)."""
  model_types = ("t5", "mt5")
  reads_torch_files = True  # legacy T5 checkpoints ship pytorch_model.bin only

  def config_to_hf(self, config: ModelConfig) -> dict:
    return config_to_hf(config)

  def config_from_hf(self, hf, tensors, **overrides) -> ModelConfig:
    return config_from_hf(hf, tied=tied_lm_head(tensors, "T5"), **overrides)

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    return weight_map(config)

  def check_claim(self, hf, where, max_params=None) -> tuple[int, str]:
    sizes = hf_sizes(hf, where)
    ceiling = limits.max_import_params(max_params)
    for field, value in sizes.items():
      if value > ceiling:
        raise ConfigError(f"{where}: {field}={value:,} is over the import ceiling of "
                          f"{ceiling:,} parameters ({limits.HOW_TO_RAISE})")
    proj = hf.get("feed_forward_proj", "relu")
    gated = isinstance(proj, str) and FROM_HF_ACTIVATION.get(proj) in GATED_ACTIVATIONS
    claimed = implied_params(sizes, gated)
    named = ", ".join(f"{k}={v:,}" for k, v in sizes.items())
    limits.check_ceiling(claimed, f"{where} ({named})", ceiling)
    return claimed, f"{where} ({named})"
