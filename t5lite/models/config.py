"""ModelConfig: the one frozen dataclass that describes every t5lite model.

It is carried everywhere (model, losses, export, MODEL_DIR/config.json); variants are
made with `config.replace(...)`. Gin binds its fields at the entry points only.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp

from t5lite.errors import ConfigError

ARCHITECTURES = ("encoder_decoder", "decoder_only", "encoder_only")
# Gated activations multiply act(x @ wi_0) by (x @ wi_1); the others use one input kernel `wi`.
GATED_ACTIVATIONS = ("gated-gelu", "swiglu", "reglu")
ACTIVATIONS = ("relu", "gelu") + GATED_ACTIVATIONS
ACTIVATION_ALIASES = {"geglu": "gated-gelu", "gated_gelu": "gated-gelu"}
NORMS = ("rms", "layer")
POSITION_ENCODINGS = ("relative_bias", "sinusoidal", "learned", "rope")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of a model. Defaults are T5 v1.1 small."""

  architecture: str = "encoder_decoder"
  """The network's stacks: 'encoder_decoder' (T5), 'decoder_only' (causal or prefix LM) or
  'encoder_only' (MLM)."""
  family: str = ""
  """The model family (t5lite.families) that builds, trains, decodes and exports this model:
  its converter, loss, heads and HF mapping. Empty: the family named like the architecture."""
  vocab_size: int = 32128
  """Rows of the embedding table (T5: 32100 ids padded to a multiple of 128)."""
  d_model: int = 512
  """Width of the residual stream."""
  d_ff: int = 1024
  """Hidden width of the MLP."""
  num_heads: int = 6
  """Attention heads per layer."""
  d_kv: int = 64
  """Width of one head's queries, keys and values (num_heads * d_kv need not equal d_model)."""
  num_encoder_layers: int = 8
  """Layers of the encoder stack (encoder_decoder, encoder_only)."""
  num_decoder_layers: int = 8
  """Layers of the decoder stack (encoder_decoder, decoder_only)."""
  mlp_activation: str = "gated-gelu"
  """'relu', 'gelu', 'gated-gelu' (alias 'geglu'), 'swiglu' or 'reglu'. GELU is the tanh approximation."""
  norm: str = "rms"
  """'rms' (T5 LayerNorm: scale only, no mean subtraction) or 'layer' (scale and bias)."""
  layer_norm_epsilon: float = 1e-6
  """Added to the variance before the reciprocal square root."""
  position_encoding: str = "relative_bias"
  """'relative_bias' (T5), 'sinusoidal', 'learned' (absolute) or 'rope' (rotary)."""
  relative_attention_num_buckets: int = 32
  """Buckets of the relative position bias (one table per stack, shared by its layers)."""
  relative_attention_max_distance: int = 128
  """Distances at or past this share the last bucket."""
  max_position_embeddings: int = 512
  """Rows of the table for 'learned' positions (longer inputs are an error)."""
  rope_theta: float = 10000.0
  """Base of the rotary frequencies."""
  tie_output_embedding: bool = False
  """Output projection is the transposed input embedding (T5 v1.0) instead of its own kernel."""
  scale_logits: bool = False
  """Multiply the final hidden state by d_model**-0.5 before the output projection (T5 v1.0)."""
  dropout_rate: float = 0.0
  """Dropout after embeddings, attention weights, sublayer outputs and the MLP activation."""
  dtype: str = "float32"
  """Activation (compute) dtype; softmax, norms and losses run in float32 regardless."""
  param_dtype: str = "float32"
  """Storage dtype of parameters."""
  scan_layers: bool = False
  """Run each stack as nn.scan over stacked layer params, so compile time does not grow with depth."""
  remat_policy: str = "none"
  """Rematerialization per layer: 'none', 'full' (save nothing), 'dots', 'dots_no_batch'."""
  prefix_lm: bool = False
  """Decoder-only: positions flagged by `decoder_causal_attention` see each other bidirectionally."""

  def __post_init__(self):
    activation = ACTIVATION_ALIASES.get(self.mlp_activation, self.mlp_activation)
    object.__setattr__(self, "mlp_activation", activation)
    for field, allowed in (("architecture", ARCHITECTURES), ("mlp_activation", ACTIVATIONS),
                           ("norm", NORMS), ("position_encoding", POSITION_ENCODINGS),
                           ("remat_policy", REMAT_POLICIES), ("dtype", DTYPES),
                           ("param_dtype", DTYPES)):
      value = getattr(self, field)
      if value not in allowed:
        raise ConfigError(f"ModelConfig.{field}={value!r} is not one of {allowed}")
    for field in ("vocab_size", "d_model", "d_ff", "num_heads", "d_kv",
                  "relative_attention_num_buckets", "max_position_embeddings"):
      if getattr(self, field) < 1:
        raise ConfigError(f"ModelConfig.{field} must be positive, got {getattr(self, field)}")
    if self.has_encoder and self.num_encoder_layers < 1:
      raise ConfigError(f"{self.architecture} needs num_encoder_layers >= 1")
    if self.has_decoder and self.num_decoder_layers < 1:
      raise ConfigError(f"{self.architecture} needs num_decoder_layers >= 1")
    if self.prefix_lm and self.architecture != "decoder_only":
      raise ConfigError("ModelConfig.prefix_lm applies to architecture='decoder_only' only")
    buckets, distance = self.relative_attention_num_buckets, self.relative_attention_max_distance
    if self.position_encoding == "relative_bias" and (buckets < 4 or distance <= buckets // 2):
      # T5's bucketing halves the buckets per direction, then keeps half of those exact and
      # spreads the rest logarithmically up to max_distance: fewer leaves nothing to divide.
      raise ConfigError(f"ModelConfig.relative_attention_num_buckets={buckets} must be >= 4 and "
                        f"relative_attention_max_distance={distance} > num_buckets // 2")
    if self.position_encoding == "rope" and self.d_kv % 2:
      raise ConfigError(f"rope needs an even d_kv, got {self.d_kv}")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ConfigError(f"ModelConfig.dropout_rate must be in [0, 1), got {self.dropout_rate}")

  @property
  def family_name(self) -> str:
    """The registered family this config belongs to (t5lite.families.family_of looks it up)."""
    return self.family or self.architecture

  @property
  def has_encoder(self) -> bool:
    return self.architecture in ("encoder_decoder", "encoder_only")

  @property
  def has_decoder(self) -> bool:
    return self.architecture in ("encoder_decoder", "decoder_only")

  @property
  def gated_mlp(self) -> bool:
    return self.mlp_activation in GATED_ACTIVATIONS

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def storage_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
    return cls(**values)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "ModelConfig":
    return cls.from_dict(json.loads(text))
