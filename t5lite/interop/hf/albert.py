"""The HF layout of ALBERT (`AlbertForPreTraining`, model_type 'albert').

ALBERT is BERT's post-norm encoder (biases, LayerNorm, attention scaled by 1/sqrt(d_head))
with three changes: factorized embeddings (tables of width E = embedding_size, normed, then
projected to the hidden width H), cross-layer sharing (num_hidden_layers slots run
num_hidden_groups parameter sets of inner_group_num layers each; slot i uses group
int(i / (num_hidden_layers / num_hidden_groups)), t5lite's i * groups // layers when groups
divide the layers) and a sentence-order (SOP) head on the pooler. Tanh GELU ('gelu_new').

  t5lite                                    ALBERT
  token_embedder/embedding                  albert.embeddings.word_embeddings  (V, E)
  encoder/position_embedder/embedding       albert.embeddings.position_embeddings
  encoder/token_type_embedder/embedding     albert.embeddings.token_type_embeddings
  encoder/embedding_norm                    albert.embeddings.LayerNorm  (E)
  encoder/embedding_projection              albert.encoder.embedding_hidden_mapping_in (E->H)
  encoder/groups_g_k/attention/query...     albert.encoder.albert_layer_groups.g.albert_layers.k
                                              .attention.{query,key,value}
  encoder/groups_g_k/attention/out          ...attention.dense
  encoder/groups_g_k/post_attention_...     ...attention.LayerNorm
  encoder/groups_g_k/mlp/wi, wo             ...ffn, ...ffn_output
  encoder/groups_g_k/post_mlp_layer_norm    ...full_layer_layer_norm
  pooler, sentence_classifier               albert.pooler, sop_classifier.classifier
  mlm_transform, mlm_norm                   predictions.dense (H->E), predictions.LayerNorm
  logits_dense/bias                         predictions.bias

The MLM decoder is tied: predictions.decoder.weight is the word embedding table and its bias
predictions.bias; transformers 5 drops both copies on save, older files may hold them (unread).

An unshared t5lite model (shared_layer_groups=0, layers_i) exports as num_hidden_groups =
num_hidden_layers with one layer per group: slot i then runs group i, the same network.

Finetuning heads (config.head; t5lite.interop.hf.heads): AlbertFor{SequenceClassification,
TokenClassification,QuestionAnswering,MultipleChoice} have the backbone, no MLM or SOP head,
and `classifier` (on `albert.pooler` for sequence classification and multiple choice; HF's
token and QA models are built without the pooler) or `qa_outputs`. Their dropout is
`classifier_dropout_prob` (AlbertConfig's default 0.1), t5lite's classifier_dropout.
"""
from __future__ import annotations

from typing import Mapping

from t5lite.errors import ConfigError
from t5lite.interop.hf.bert import (ENCODER_NEEDS, FROM_HF_ACTIVATION, SIZES, TO_HF_ACTIVATION,
                                   check_heads, dense_entries, embedding_entries, norm_entries,
                                   post_norm_layer)
from t5lite.interop.hf.heads import HeadSpec, encoder_needs
from t5lite.interop.hf.layout import Entry, HFLayout, legacy_norm_names, refuse, register
from t5lite.models.config import ModelConfig

ALBERT_LAYER = dict(query="attention.query", key="attention.key", value="attention.value",
                    out="attention.dense", attention_norm="attention.LayerNorm", wi="ffn",
                    wo="ffn_output", mlp_norm="full_layer_layer_norm")
GROUP_SIZES = {"embedding_size": "embedding_size", "num_hidden_groups": "shared_layer_groups",
               "inner_group_num": "layers_per_group", "type_vocab_size": "type_vocab_size"}
# AlbertConfig's own defaults, used as transformers does when a hand-written config.json
# omits them (the big sizes have none worth guessing: AlbertConfig's are xxlarge's).
DEFAULTS = {"max_position_embeddings": 512, "embedding_size": 128, "num_hidden_groups": 1,
            "inner_group_num": 1, "type_vocab_size": 2}
# albert-base-v2 and its sizes name AlbertForMaskedLM, with AlbertForPreTraining's tensors.
HEADS = HeadSpec("Albert", ("AlbertForPreTraining", "AlbertForMaskedLM"),
                 dropout_key="classifier_dropout_prob", dropout_default=0.1)


@register
class AlbertLayout(HFLayout):
  """AlbertForPreTraining: MLM head at the embedding width, pooler and the SOP head."""
  model_types = ("albert",)
  heads = HEADS
  size_fields = tuple(SIZES) + tuple(GROUP_SIZES)

  def checkpoint_tensors(self, tensors):
    return legacy_norm_names(tensors)

  def config_to_hf(self, config: ModelConfig) -> dict:
    HEADS.check(config, "albert")
    needs = dict(ENCODER_NEEDS, position_offset=0, pooler=True, sentence_classes=2)
    if config.head:  # no MLM decoder to tie: tying changes nothing
      needs.update(encoder_needs(config, HEADS), tie_output_embedding=config.tie_output_embedding)
    refuse(config, "albert", needs)
    check_heads(config, "albert")
    # HF always projects E -> H (embedding_hidden_mapping_in) and always adds token types;
    # t5lite projects when embedding_size is set, and adds types only when asked.
    if not config.embedding_size:
      raise ConfigError("HF 'albert' projects its embeddings (embedding_size) to hidden_size; "
                        "this model has embedding_size=0 (no projection): set embedding_size "
                        "(ALBERT's is 128), or export it as 'bert'")
    if not config.type_vocab_size:
      raise ConfigError("HF 'albert' always adds token-type embeddings; this model has "
                        "type_vocab_size=0: set type_vocab_size >= 1 (ALBERT's is 2)")
    if config.mlp_activation not in TO_HF_ACTIVATION:
      raise ConfigError(f"HF 'albert' has no equivalent of mlp_activation="
                        f"{config.mlp_activation!r} (it has {sorted(TO_HF_ACTIVATION)})")
    groups, inner = self._groups(config)
    return {
        "architectures": ["AlbertForPreTraining"],
        "model_type": "albert",
        "vocab_size": config.vocab_size,
        "embedding_size": config.embedding_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.num_encoder_layers,
        "num_hidden_groups": groups,
        "inner_group_num": inner,
        "num_attention_heads": config.num_heads,
        "intermediate_size": config.d_ff,
        "hidden_act": TO_HF_ACTIVATION[config.mlp_activation],
        "hidden_dropout_prob": config.dropout_rate,
        "attention_probs_dropout_prob": config.dropout_rate,
        "classifier_dropout_prob": (config.dropout_rate if config.classifier_dropout is None
                                    else config.classifier_dropout),
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.init_std or 0.02,
        "layer_norm_eps": config.layer_norm_epsilon,
        "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3,
        "tie_word_embeddings": True,
        **HEADS.config_to_hf(config),
    }

  def config_from_hf(self, hf: Mapping, tensors, **overrides) -> ModelConfig:
    sizes = self.sizes(hf, {**SIZES, **GROUP_SIZES}, defaults=DEFAULTS)
    d, heads, layers, groups = (sizes["d_model"], sizes["num_heads"],
                                sizes["num_encoder_layers"], sizes["shared_layer_groups"])
    if d % heads:
      raise ConfigError(f"config.json: hidden_size={d} is not a multiple of "
                        f"num_attention_heads={heads}")
    if layers % groups:  # t5lite's i * groups // layers is HF's group index only then
      raise ConfigError(f"config.json: num_hidden_groups={groups} does not divide "
                        f"num_hidden_layers={layers}; t5lite shares layers in equal groups")
    if hf.get("tie_word_embeddings", True) is not True:
      raise ConfigError("config.json: tie_word_embeddings=false; t5lite reads ALBERT models "
                        "whose MLM decoder is the word embedding table (every published one)")
    values = dict(
        architecture="encoder_only", family="albert", **sizes, d_kv=d // heads,
        mlp_activation=self.choice(hf, "hidden_act", FROM_HF_ACTIVATION, "gelu_new"),
        norm="layer", norm_position="post", use_bias=True, scale_attention=True,
        layer_norm_epsilon=self.number(hf, "layer_norm_eps", 1e-12),
        position_encoding="learned", embedding_norm=True, tie_output_embedding=True,
        pooler=True, sentence_classes=2,
        init_std=self.number(hf, "initializer_range", 0.02),
        dropout_rate=self.rate(hf, "hidden_dropout_prob", 0.0))
    head = HEADS.head_from_hf(hf, tensors)
    if head:
      values.update(HEADS.values_from_hf(hf, head))
    return ModelConfig(**{**values, **overrides})

  @staticmethod
  def _groups(config: ModelConfig) -> tuple[int, int]:
    """(num_hidden_groups, inner_group_num); an unshared model is one layer per group."""
    if config.shared_layer_groups:
      return config.shared_layer_groups, config.layers_per_group
    return config.num_encoder_layers, 1

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    entries = embedding_entries("albert.embeddings")
    entries += dense_entries(("encoder", "embedding_projection"),
                             "albert.encoder.embedding_hidden_mapping_in")
    groups, inner = self._groups(config)
    for g in range(groups):
      for k in range(inner):
        ours = f"groups_{g}_{k}" if config.shared_layer_groups else f"layers_{g}"
        entries += post_norm_layer(
            ("encoder", ours),
            f"albert.encoder.albert_layer_groups.{g}.albert_layers.{k}", ALBERT_LAYER)
    if config.head:
      return entries + HEADS.entries(config, "albert.pooler")
    return (entries + dense_entries(("pooler",), "albert.pooler")
            + dense_entries(("sentence_classifier",), "sop_classifier.classifier")
            + dense_entries(("mlm_transform",), "predictions.dense")
            + norm_entries(("mlm_norm",), "predictions.LayerNorm")
            + [Entry((("logits_dense", "bias"),), "predictions.bias", "vector")])
