"""ModelConfig: the one frozen dataclass that describes every t5lite model.

It is carried everywhere (model, losses, export, MODEL_DIR/config.json); variants are
made with `config.replace(...)`. Gin binds its fields at the entry points only.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax.numpy as jnp

from t5lite.errors import ConfigError
from t5lite.models import shared_stacks
from t5lite.models.adapters import AdapterConfig
from t5lite.models.config_legacy import upgrade_legacy_keys
from t5lite.models.electra_config import ElectraConfig
from t5lite.models.moe.config import MoeConfig
from t5lite.models.span_boundary_config import SpanBoundaryConfig

ARCHITECTURES = ("encoder_decoder", "decoder_only", "encoder_only")
# Gated activations multiply act(x @ wi_0) by (x @ wi_1); the others use one input kernel `wi`.
GATED_ACTIVATIONS = ("gated-gelu", "swiglu", "reglu")
ACTIVATIONS = ("relu", "gelu", "gelu_exact") + GATED_ACTIVATIONS
ACTIVATION_ALIASES = {"geglu": "gated-gelu", "gated_gelu": "gated-gelu"}
NORMS = ("rms", "layer")
POSITION_ENCODINGS = ("relative_bias", "sinusoidal", "sinusoidal_interleaved", "learned", "rope")
NORM_POSITIONS = ("pre", "post")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_attention")
DTYPES = ("float32", "bfloat16", "float16")
# The kernel of attention's core (t5lite.models.attention_kernels).
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")
# Finetuning heads (t5lite.models.heads); '' is the pretraining head (LM / MLM [+ NSP/SOP]).
HEADS = ("", "sequence_classification", "token_classification", "question_answering",
         "multiple_choice")
PROBLEM_TYPES = ("", "single_label_classification", "multi_label_classification", "regression")
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
  """'relu', 'gelu' (the tanh approximation: HF's 'gelu_new', T5 v1.1, GPT-2, ALBERT),
  'gelu_exact' (erf: HF's 'gelu', BERT), 'gated-gelu' (alias 'geglu', tanh GELU), 'swiglu'
  (LLaMA) or 'reglu'. An encoder-only model's MLM head uses the same (ungated) activation."""
  norm: str = "rms"
  """'rms' (T5 LayerNorm: scale only, no mean subtraction) or 'layer' (scale and bias)."""
  norm_position: str = "pre"
  """'pre': norm before each sublayer, residual around it, one final norm per stack (T5, GPT-2,
  LLaMA). 'post': norm after each residual sum, no final norm (original Transformer, BERT)."""
  use_bias: bool = False
  """Biases on the dense layers: attention, MLP, embedding projection and an MLM head's output
  (BERT, GPT-2, the original Transformer). T5 and LLaMA have none."""
  scale_attention: bool = False
  """Scale attention logits by d_kv**-0.5 (BERT, GPT-2, LLaMA). False: T5, which folds the
  scale into the query kernel's initialization."""
  num_key_value_heads: int = 0
  """Grouped-query attention: heads of keys and values, each shared by num_heads /
  num_key_value_heads query heads (LLaMA-style). 0: as many as num_heads."""
  init_std: float = 0.0
  """> 0: every kernel and embedding initialized normal(init_std) (HF's initializer_range,
  0.02 for BERT and GPT-2). 0: T5's fan-in scaled initialization."""
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
  position_offset: int = 0
  """Added to positions before the 'learned' table (RoBERTa: its positions start after the
  padding index, at 2; the table then needs max_position_embeddings >= length + 2)."""
  rope_theta: float = 10000.0
  """Base of the rotary frequencies."""
  embedding_size: int = 0
  """Factorized embeddings (ALBERT, ELECTRA): token, position and type embeddings of this
  width, a norm there, then a dense projection to d_model (even when the widths are equal, as
  ALBERT's); the MLM head projects back to it. 0: width d_model, no projection. Encoder-only."""
  type_vocab_size: int = 0
  """Token-type (segment A/B) embeddings added to the token embeddings (BERT: 2). 0: none."""
  embedding_norm: bool = False
  """A norm over the summed embeddings (BERT, ALBERT) before dropout."""
  scale_embeddings: bool = False
  """Multiply token embeddings by sqrt(d_model) before adding positions (original Transformer)."""
  shared_encoder_decoder: bool = False
  """T5's shared encoder-decoder (Table 2): decoder layer i runs encoder layer i's
  self-attention and MLP params; cross-attention, position biases and final norms stay each
  stack's own (t5lite.models.shared_stacks). Encoder-decoder models of equal depths."""
  shared_layer_groups: int = 0
  """Cross-layer parameter sharing (ALBERT's num_hidden_groups): the encoder's layers use this
  many parameter sets, layer i the group i * groups // num_encoder_layers. 0: no sharing.
  Encoder-only models, unscanned."""
  layers_per_group: int = 1
  """Layers inside one shared group, applied in turn at every use (ALBERT's inner_group_num)."""
  pooler: bool = False
  """Encoder-only: a dense + tanh over the first token's final state (BERT's pooler)."""
  sentence_classes: int = 0
  """Encoder-only: a linear classifier of that many classes on the pooler (BERT's next-sentence,
  ALBERT's sentence-order head: 2). Needs pooler. 0: none."""
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
  attention_implementation: str = "auto"
  """The kernel of softmax(q k + bias) v (t5lite.models.attention_kernels): 'xla' (einsums and
  a float32 softmax, every backend), 'cudnn' (cuDNN's fused attention: a CUDA GPU, 16-bit
  compute), 'pallas' (Pallas's flash attention where the program runs on a TPU, XLA's
  elsewhere) or 'auto' (cuDNN where it runs, else XLA). The same function either way."""
  scan_layers: bool = False
  """Run each stack as nn.scan over stacked layer params, so compile time does not grow with depth."""
  remat_policy: str = "none"
  """Rematerialization per layer: 'none', 'full' (save nothing), 'dots', 'dots_no_batch', or
  'save_attention' (save attention's projections and output; recompute the norms and MLP)."""
  prefix_lm: bool = False
  """Decoder-only: positions flagged by `decoder_causal_attention` see each other bidirectionally."""
  bos_id: int = 0
  """The token a decoder reads before a sequence's first token: the start of every shifted
  target segment in training and of every decode (T5: 0; HF GPT-2: 50256 `<|endoftext|>`,
  LLaMA: 1 `<s>`). A decoder-only prompt is decoded after it."""
  eos_id: int = 1
  """The token that ends a generated sequence (T5: 1; GPT-2: 50256; LLaMA: 2)."""
  head: str = ""
  """'' : the pretraining head (LM, MLM, with the sentence head when configured). A finetuning
  head in its place (HF's *For<Head> models): 'sequence_classification' (encoder: on the pooler,
  or RoBERTa's dense + tanh head without one; decoder: on the last real token, as
  GPT2ForSequenceClassification and GPT-1), 'token_classification', 'question_answering'
  (start/end logits) or 'multiple_choice' (encoder, one score per choice on the pooler)."""
  num_labels: int = 2
  """Classes of a classification or tagging head (1 for regression)."""
  problem_type: str = ""
  """Sequence classification loss, as HF's: 'single_label_classification' (softmax cross
  entropy), 'multi_label_classification' (sigmoid cross entropy per label) or 'regression'
  (mean squared error). '': regression when num_labels == 1, else single-label."""
  classifier_dropout: float | None = None
  """Dropout before a finetuning head's classifier (None: dropout_rate, as HF)."""
  lm_loss_weight: float = 0.0
  """Decoder sequence classification: add this times the LM loss on the same tokens (GPT-1's
  auxiliary objective, lambda = 0.5). 0: the task loss alone (GPT2ForSequenceClassification)."""
  classifier_activation: str = "tanh"
  """Activation of an encoder's first-token classification head without a pooler (RoBERTa's
  head: 'tanh'; ELECTRA's: 'gelu_exact')."""
  adapter: AdapterConfig | None = None
  """Parameter-efficient finetuning (t5lite.models.adapters): LoRA branches on the targeted
  kernels. The PEFT recipe (TrainConfig.peft) sets it; None: the plain network."""
  moe: MoeConfig | None = None
  """Mixture-of-Experts (t5lite.models.moe.config): routed MLPs in some layers of each stack
  (Switch Transformers, top-k). None: every MLP dense."""
  electra: ElectraConfig | None = None
  """Encoder-only pretraining (t5lite.models.electra_config): ELECTRA's discriminator head in
  place of the MLM head, with a generator beside it when its generator_hidden_fraction > 0
  (family 'electra'). None: no discriminator head."""
  span_boundary: SpanBoundaryConfig | None = None
  """Encoder-only pretraining (t5lite.models.span_boundary_config): SpanBERT's span boundary
  objective beside the MLM head; needs span-masked batches. None: none."""

  def __post_init__(self):
    activation = ACTIVATION_ALIASES.get(self.mlp_activation, self.mlp_activation)
    object.__setattr__(self, "mlp_activation", activation)
    for field, allowed in (("architecture", ARCHITECTURES), ("mlp_activation", ACTIVATIONS),
                           ("norm", NORMS), ("position_encoding", POSITION_ENCODINGS),
                           ("remat_policy", REMAT_POLICIES), ("dtype", DTYPES),
                           ("attention_implementation", ATTENTION_IMPLEMENTATIONS),
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
    self._check_layer_options()
    if self.position_encoding == "rope" and self.d_kv % 2:
      raise ConfigError(f"rope needs an even d_kv, got {self.d_kv}")
    if not (math.isfinite(self.layer_norm_epsilon) and self.layer_norm_epsilon > 0):
      raise ConfigError(f"ModelConfig.layer_norm_epsilon must be a positive number, got "
                        f"{self.layer_norm_epsilon}")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ConfigError(f"ModelConfig.dropout_rate must be in [0, 1), got {self.dropout_rate}")
    self._check_head_options()
    if self.adapter is not None and not isinstance(self.adapter, AdapterConfig):
      raise ConfigError(f"ModelConfig.adapter must be an AdapterConfig or None, got "
                        f"{type(self.adapter).__name__}")
    if self.moe is not None:
      if not isinstance(self.moe, MoeConfig):
        raise ConfigError(f"ModelConfig.moe must be a MoeConfig or None, got "
                          f"{type(self.moe).__name__}")
      if self.scan_layers or self.shared_layer_groups:
        raise ConfigError("ModelConfig.moe: sparse and dense layers differ, so they cannot be "
                          "scanned or shared; set scan_layers=False and shared_layer_groups=0")

    if self.shared_encoder_decoder:
      shared_stacks.check(self)

  def _check_head_options(self):
    for field, allowed in (("head", HEADS), ("problem_type", PROBLEM_TYPES)):
      if getattr(self, field) not in allowed:
        raise ConfigError(f"ModelConfig.{field}={getattr(self, field)!r} is not one of {allowed}")
    if self.num_labels < 1:
      raise ConfigError(f"ModelConfig.num_labels must be >= 1, got {self.num_labels}")
    dropout = self.classifier_dropout
    if dropout is not None and not 0.0 <= dropout < 1.0:
      raise ConfigError(f"ModelConfig.classifier_dropout must be in [0, 1), got {dropout}")
    if not (math.isfinite(self.lm_loss_weight) and self.lm_loss_weight >= 0):
      raise ConfigError(f"ModelConfig.lm_loss_weight must be >= 0, got {self.lm_loss_weight}")
    if self.head and self.architecture == "encoder_decoder":
      raise ConfigError(f"ModelConfig.head={self.head!r}: finetuning heads are for encoder-only "
                        "and decoder-only models; an encoder-decoder model finetunes text to text")
    if self.architecture == "decoder_only" and self.head not in ("", "sequence_classification"):
      raise ConfigError(f"ModelConfig.head={self.head!r}: a decoder-only model has the "
                        "'sequence_classification' head only (GPT-2 / GPT-1)")
    if self.lm_loss_weight and not (self.architecture == "decoder_only" and self.head):
      raise ConfigError("ModelConfig.lm_loss_weight is GPT-1's auxiliary LM loss of a decoder-only "
                        "sequence classifier: set head='sequence_classification' there")
    if self.problem_type == "regression" and self.num_labels != 1:
      raise ConfigError(f"problem_type='regression' predicts one number: num_labels must be 1, "
                        f"got {self.num_labels}")
    if self.head and self.sentence_classes:
      raise ConfigError(f"ModelConfig.head={self.head!r} replaces the pretraining heads: set "
                        "sentence_classes=0 (the pooler stays, for the classifier)")
    if self.head == "multiple_choice" and not self.pooler:
      raise ConfigError("head='multiple_choice' scores each choice on the pooler: set pooler=True")
    if self.span_boundary is not None:
      if not isinstance(self.span_boundary, SpanBoundaryConfig):
        raise ConfigError(f"ModelConfig.span_boundary must be a SpanBoundaryConfig or None, got "
                          f"{type(self.span_boundary).__name__}")
      if self.architecture != "encoder_only" or self.head:
        raise ConfigError(f"ModelConfig.span_boundary is SpanBERT's encoder-only pretraining "
                          f"objective; this model has architecture={self.architecture!r}, "
                          f"head={self.head!r} (it needs 'encoder_only' and head='')")
    if self.classifier_activation not in ("tanh",) + ACTIVATIONS:
      raise ConfigError(f"ModelConfig.classifier_activation={self.classifier_activation!r} is "
                        f"not one of {('tanh',) + ACTIVATIONS}")
    self._check_electra_options()

  def _check_electra_options(self):
    electra = self.electra
    if electra is None:
      return
    if not isinstance(electra, ElectraConfig):
      raise ConfigError(f"ModelConfig.electra must be an ElectraConfig or None, got "
                        f"{type(electra).__name__}")
    clash = [f for f in ("head", "pooler", "sentence_classes", "span_boundary")
             if getattr(self, f)]
    if self.architecture != "encoder_only" or clash:
      unset = ", ".join(clash) if clash else "architecture='encoder_only'"
      raise ConfigError("ModelConfig.electra is ELECTRA's encoder-only pretraining head, which "
                        f"replaces the others: fix {unset}")
    fraction = electra.generator_hidden_fraction
    generator = electra.generator_width(self.d_model)
    if fraction and not 1 <= generator <= self.d_model:
      raise ConfigError(f"the ELECTRA generator's hidden size {generator} "
                        f"(ElectraConfig.generator_hidden_fraction={fraction} x d_model="
                        f"{self.d_model}) must be between 1 and the discriminator's hidden size "
                        f"{self.d_model}: a generator larger than the discriminator makes "
                        "detection too hard")

  @property
  def loss_problem_type(self) -> str:
    """problem_type, with '' resolved as HF does for integer labels."""
    if self.problem_type:
      return self.problem_type
    return "regression" if self.num_labels == 1 else "single_label_classification"

  def _check_layer_options(self):
    if self.norm_position not in NORM_POSITIONS:
      raise ConfigError(f"ModelConfig.norm_position={self.norm_position!r} is not one of "
                        f"{NORM_POSITIONS}")
    for field in ("num_key_value_heads", "embedding_size", "type_vocab_size",
                  "shared_layer_groups", "sentence_classes", "position_offset", "bos_id",
                  "eos_id"):
      if getattr(self, field) < 0:
        raise ConfigError(f"ModelConfig.{field} must be >= 0, got {getattr(self, field)}")
    if self.layers_per_group < 1:
      raise ConfigError(f"ModelConfig.layers_per_group must be >= 1, got {self.layers_per_group}")
    for field in ("bos_id", "eos_id"):
      if getattr(self, field) >= self.vocab_size:
        raise ConfigError(f"ModelConfig.{field}={getattr(self, field)} is not below "
                          f"vocab_size={self.vocab_size}")
    if self.init_std < 0:
      raise ConfigError(f"ModelConfig.init_std must be >= 0, got {self.init_std}")
    if self.num_heads % self.kv_heads:
      raise ConfigError(f"ModelConfig.num_key_value_heads={self.num_key_value_heads} must "
                        f"divide num_heads={self.num_heads}")
    if self.architecture != "encoder_only":
      for field in ("embedding_size", "type_vocab_size", "shared_layer_groups", "pooler",
                    "sentence_classes"):
        if getattr(self, field):
          raise ConfigError(f"ModelConfig.{field} is an encoder-only option; this model is "
                            f"{self.architecture!r} (set it to 0/False)")
    if self.shared_layer_groups:
      if self.num_encoder_layers % self.shared_layer_groups:
        raise ConfigError(f"ModelConfig.shared_layer_groups={self.shared_layer_groups} must "
                          f"divide num_encoder_layers={self.num_encoder_layers}")
      if self.scan_layers:
        raise ConfigError("shared layers run as a loop over one set of parameters per group: "
                          "set scan_layers=False with shared_layer_groups")
    if self.layers_per_group > 1 and not self.shared_layer_groups:
      raise ConfigError("ModelConfig.layers_per_group applies to shared layers: set "
                        "shared_layer_groups too")
    if self.position_offset and self.position_encoding != "learned":
      raise ConfigError("ModelConfig.position_offset shifts the 'learned' position table; this "
                        f"model has position_encoding={self.position_encoding!r}")
    if self.embedding_size and (self.scale_embeddings
                                or self.position_encoding.startswith("sinusoidal")):
      raise ConfigError("factorized embeddings (embedding_size) take learned, relative or rotary "
                        "positions and no scale_embeddings (sinusoids and the sqrt(d_model) "
                        "scale are of width d_model)")
    if self.sentence_classes and not self.pooler:
      raise ConfigError("ModelConfig.sentence_classes needs pooler=True (the classifier reads "
                        "the pooled first token)")

  @property
  def uses_dropout(self) -> bool:
    """Whether training applies any dropout (layers, a head's classifier, LoRA's input)."""
    return (self.dropout_rate > 0 or bool(self.classifier_dropout)
            or bool(self.adapter and self.adapter.lora_dropout))

  @property
  def kv_heads(self) -> int:
    """Heads of keys and values (num_key_value_heads, or num_heads without grouping)."""
    return self.num_key_value_heads or self.num_heads

  @property
  def embedding_width(self) -> int:
    """Width of the embedding tables (embedding_size, or d_model)."""
    return self.embedding_size or self.d_model

  @property
  def layer_repeats(self) -> int:
    """Layer applications per encoder layer slot (layers_per_group when layers are shared)."""
    return self.layers_per_group if self.shared_layer_groups else 1

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
    # adapter, moe, electra and span_boundary as nested dicts (None without them)
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values: dict[str, Any]) -> "ModelConfig":
    values = upgrade_legacy_keys(values)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
    for field, sub in (("adapter", AdapterConfig), ("moe", MoeConfig),
                       ("electra", ElectraConfig), ("span_boundary", SpanBoundaryConfig)):
      if isinstance(values.get(field), dict):
        values = dict(values, **{field: sub.from_dict(values[field])})
    return cls(**values)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "ModelConfig":
    return cls.from_dict(json.loads(text))
