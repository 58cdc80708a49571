"""The HF layout of ELECTRA (model_type 'electra'): one network per directory, either the
discriminator (`ElectraForPreTraining`) or the generator (`ElectraForMaskedLM`), and the
finetuning heads of a discriminator (ElectraFor{SequenceClassification,TokenClassification,
QuestionAnswering}).

ELECTRA is BERT's post-norm encoder with factorized embeddings (tables of width E =
embedding_size, normed, then projected to the hidden width H only when E != H; t5lite's
embedding_size is 0 then) and no pooler:

  t5lite                                  ELECTRA
  token_embedder/embedding                electra.embeddings.word_embeddings  (V, E)
  encoder/position_embedder, token_type_  electra.embeddings.{position,token_type}_embeddings
  encoder/embedding_norm                  electra.embeddings.LayerNorm
  encoder/embedding_projection            electra.embeddings_project  (E -> H, when E != H)
  encoder/layers_i/...                    electra.encoder.layer.i... (BERT's names)
  discriminator_predictions/dense, ...    discriminator_predictions.{dense,dense_prediction}
  mlm_transform, mlm_norm                 generator_predictions.{dense (H -> E),LayerNorm}
  logits_dense/bias                       generator_lm_head.bias (its weight: the word table)
  head/dense, head/classifier             classifier.dense, classifier.out_proj (GELU between)

A pretraining run holds both networks (t5lite.families.electra); `t5lite export hf` writes
them as DIR/discriminator and DIR/generator, each a directory of this layout.
"""
from __future__ import annotations

from typing import Mapping

from t5lite.errors import ConfigError
from t5lite.interop.hf.bert import (BERT_LAYER, ENCODER_NEEDS, FROM_HF_ACTIVATION, SIZES,
                                   TO_HF_ACTIVATION, check_heads, dense_entries,
                                   embedding_entries, encoder_config_keys, norm_entries,
                                   post_norm_layer)
from t5lite.interop.hf.heads import HeadSpec, encoder_needs
from t5lite.interop.hf.layout import Entry, HFLayout, legacy_norm_names, refuse, register
from t5lite.models.config import ModelConfig
from t5lite.models.electra_config import ElectraConfig

DISCRIMINATOR, GENERATOR = "ElectraForPreTraining", "ElectraForMaskedLM"
# ElectraForMultipleChoice summarizes with its own SequenceSummary: not t5lite's head.
HEADS = HeadSpec("Electra", (DISCRIMINATOR, GENERATOR),
                 heads=("sequence_classification", "token_classification",
                        "question_answering"), pooled=())
DEFAULTS = {"max_position_embeddings": 512, "embedding_size": 128, "type_vocab_size": 2}


@register
class ElectraLayout(HFLayout):
  """One ELECTRA network: discriminator, generator or a finetuned discriminator."""
  model_types = ("electra",)
  heads = HEADS
  size_fields = tuple(SIZES) + ("embedding_size", "type_vocab_size")

  def checkpoint_tensors(self, tensors):
    return legacy_norm_names(tensors)

  def _needs(self, config: ModelConfig) -> dict:
    needs = dict(ENCODER_NEEDS, position_offset=0, pooler=False, sentence_classes=0,
                 shared_layer_groups=0)
    if config.head:
      needs.update(encoder_needs(config, HEADS), tie_output_embedding=config.tie_output_embedding)
      if config.head == "sequence_classification":
        needs["classifier_activation"] = "gelu_exact"  # ElectraClassificationHead's GELU
    elif not config.electra:
      needs["mlp_activation"] = "gelu_exact"  # ElectraGeneratorPredictions' GELU, always
    return needs

  def config_to_hf(self, config: ModelConfig) -> dict:
    if config.electra and config.electra.pretrains_pair:
      raise ConfigError("this ELECTRA model holds a generator and a discriminator: HF keeps "
                        "each in its own directory; `t5lite export hf` writes DIR/discriminator "
                        "and DIR/generator (in Python: family_of(config).networks(params))")
    HEADS.check(config, "electra")
    refuse(config, "electra", self._needs(config))
    check_heads(config, "electra")
    if config.embedding_size == config.d_model:
      raise ConfigError(f"HF 'electra' projects its embeddings only when embedding_size != "
                        f"hidden_size; this model has embedding_size={config.embedding_size} = "
                        "d_model with a projection: set embedding_size=0 (no projection)")
    if not config.type_vocab_size:
      raise ConfigError("HF 'electra' always adds token-type embeddings; this model has "
                        "type_vocab_size=0: set type_vocab_size >= 1 (ELECTRA's is 2)")
    if config.mlp_activation not in TO_HF_ACTIVATION:
      raise ConfigError(f"HF 'electra' has no equivalent of mlp_activation="
                        f"{config.mlp_activation!r} (it has {sorted(TO_HF_ACTIVATION)})")
    pretraining = DISCRIMINATOR if config.electra else GENERATOR
    return {
        "architectures": [pretraining],
        "model_type": "electra",
        **encoder_config_keys(config),
        "embedding_size": config.embedding_width,
        "pad_token_id": 0,
        "classifier_dropout": config.classifier_dropout,
        **HEADS.config_to_hf(config),
    }

  def config_from_hf(self, hf: Mapping, tensors, **overrides) -> ModelConfig:
    sizes = self.sizes(hf, {**SIZES, "embedding_size": "embedding_size",
                            "type_vocab_size": "type_vocab_size"}, defaults=DEFAULTS)
    d, heads = sizes["d_model"], sizes["num_heads"]
    if d % heads:
      raise ConfigError(f"config.json: hidden_size={d} is not a multiple of "
                        f"num_attention_heads={heads}")
    if hf.get("tie_word_embeddings", True) is not True:
      raise ConfigError("config.json: tie_word_embeddings=false; t5lite reads ELECTRA models "
                        "whose generator head is the word embedding table (every published one)")
    if sizes["embedding_size"] == d:  # HF projects only when the widths differ
      sizes["embedding_size"] = 0
    head = HEADS.head_from_hf(hf, tensors)
    discriminator = not head and self._is_discriminator(hf, tensors)
    activation = self.choice(hf, "hidden_act", FROM_HF_ACTIVATION, "gelu")
    if not head and not discriminator and activation != "gelu_exact":
      raise ConfigError(f"config.json: hidden_act={hf['hidden_act']!r}; t5lite reads ELECTRA "
                        "generators with hidden_act 'gelu' (their MLM head applies exact GELU "
                        "always)")
    values = dict(
        architecture="encoder_only", family="electra", **sizes, d_kv=d // heads,
        mlp_activation=activation, norm="layer", norm_position="post", use_bias=True,
        scale_attention=True, layer_norm_epsilon=self.number(hf, "layer_norm_eps", 1e-12),
        position_encoding="learned", embedding_norm=True, tie_output_embedding=True,
        init_std=self.number(hf, "initializer_range", 0.02),
        dropout_rate=self.rate(hf, "hidden_dropout_prob", 0.1),
        electra=ElectraConfig() if discriminator else None)
    if head:
      values.update(HEADS.values_from_hf(hf, head), classifier_activation="gelu_exact")
    return ModelConfig(**{**values, **overrides})

  @staticmethod
  def _is_discriminator(hf: Mapping, tensors) -> bool:
    """ElectraForPreTraining (else ElectraForMaskedLM): architectures[0], else the tensors."""
    names = hf.get("architectures") or []
    if names:
      return names[0] == DISCRIMINATOR
    return tensors is None or "discriminator_predictions.dense.weight" in tensors

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    entries = embedding_entries("electra.embeddings")
    if config.embedding_size:
      entries += dense_entries(("encoder", "embedding_projection"), "electra.embeddings_project")
    for i in range(config.num_encoder_layers):
      entries += post_norm_layer(("encoder", f"layers_{i}"), f"electra.encoder.layer.{i}",
                                 BERT_LAYER)
    if config.head:
      return entries + HEADS.entries(config)
    if config.electra:
      return (entries + dense_entries(("discriminator_predictions", "dense"),
                                      "discriminator_predictions.dense")
              + dense_entries(("discriminator_predictions", "dense_prediction"),
                              "discriminator_predictions.dense_prediction"))
    return (entries + dense_entries(("mlm_transform",), "generator_predictions.dense")
            + norm_entries(("mlm_norm",), "generator_predictions.LayerNorm")
            + [Entry((("logits_dense", "bias"),), "generator_lm_head.bias", "vector")])
