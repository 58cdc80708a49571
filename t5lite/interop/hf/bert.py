"""The HF layouts of BERT (`BertForPreTraining`) and RoBERTa (`RobertaForMaskedLM`), and of
their finetuning heads (`BertForSequenceClassification`, ...: t5lite.interop.hf.heads).

Both are post-norm encoders with biases everywhere, exact-erf GELU ("gelu"), attention scaled
by 1/sqrt(d_head), word + position + token-type embeddings summed and normed, and an MLM head
(dense, activation, LayerNorm, the tied word embeddings, a vocabulary bias):

  t5lite                               BERT                                  RoBERTa
  token_embedder/embedding             bert.embeddings.word_embeddings       roberta.embeddings...
  encoder/layers_i/attention/query     bert.encoder.layer.i.attention.self.query
  encoder/layers_i/attention/out       ....attention.output.dense
  encoder/layers_i/post_attention_...  ....attention.output.LayerNorm
  encoder/layers_i/mlp/wi, wo          ....intermediate.dense, ....output.dense
  encoder/layers_i/post_mlp_...        ....output.LayerNorm
  pooler, sentence_classifier          bert.pooler.dense, cls.seq_relationship  (none)
  mlm_transform, mlm_norm              cls.predictions.transform.{dense,LayerNorm}  lm_head.{dense,layer_norm}
  logits_dense/bias                    cls.predictions.bias                  lm_head.bias

RoBERTa's positions start after its padding index (pad id 1): position_offset = 2, so a
table of max_position_embeddings = 514 serves 512 tokens.

A head model (config.head) has the backbone above, no MLM head, and hf_heads' tensors: BERT's
sequence and multiple-choice classifiers read `bert.pooler.dense`, RoBERTa's sequence
classifier its own `classifier.dense` + `classifier.out_proj` (t5lite: pooler=False, head/dense
and head/classifier), its multiple-choice one `roberta.pooler.dense`.
"""
from __future__ import annotations

from typing import Mapping

from t5lite.errors import ConfigError
from t5lite.interop.hf.heads import HeadSpec, encoder_needs
from t5lite.interop.hf.layout import Entry, HFLayout, legacy_norm_names, refuse, register
from t5lite.models.config import ModelConfig

# HF hidden_act -> our mlp_activation, and back.
FROM_HF_ACTIVATION = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
                      "relu": "relu"}
TO_HF_ACTIVATION = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}
SIZES = {"vocab_size": "vocab_size", "hidden_size": "d_model", "intermediate_size": "d_ff",
         "num_attention_heads": "num_heads", "num_hidden_layers": "num_encoder_layers",
         "max_position_embeddings": "max_position_embeddings"}
# Every option a BERT-like config must have, with the value HF's model has.
ENCODER_NEEDS = dict(architecture="encoder_only", norm="layer", norm_position="post",
                     use_bias=True, scale_attention=True, position_encoding="learned",
                     embedding_norm=True, num_key_value_heads=0, scale_logits=False,
                     scale_embeddings=False, tie_output_embedding=True)


def post_norm_layer(ours: tuple[str, ...], hf: str, names: Mapping[str, str]) -> list[Entry]:
  """The entries of one post-norm encoder layer; names maps our sublayer names (query, key,
  value, out, attention_norm, wi, wo, mlp_norm) to HF sub-names under `hf`."""
  entries = []
  for ours_name, n_in in (("query", 1), ("key", 1), ("value", 1), ("out", 2)):
    path, name = ours + ("attention", ours_name), f"{hf}.{names[ours_name]}"
    entries += [Entry((path + ("kernel",),), f"{name}.weight", "linear", n_in),
                Entry((path + ("bias",),), f"{name}.bias", "vector")]
  for ours_name, path in (("wi", ("mlp", "wi")), ("wo", ("mlp", "wo"))):
    name = f"{hf}.{names[ours_name]}"
    entries += [Entry((ours + path + ("kernel",),), f"{name}.weight", "linear"),
                Entry((ours + path + ("bias",),), f"{name}.bias", "vector")]
  for ours_name, norm in (("attention_norm", "post_attention_layer_norm"),
                          ("mlp_norm", "post_mlp_layer_norm")):
    entries += norm_entries(ours + (norm,), f"{hf}.{names[ours_name]}")
  return entries


def norm_entries(ours: tuple[str, ...], hf: str) -> list[Entry]:
  return [Entry((ours + ("scale",),), f"{hf}.weight"), Entry((ours + ("bias",),), f"{hf}.bias")]


def dense_entries(ours: tuple[str, ...], hf: str) -> list[Entry]:
  return [Entry((ours + ("kernel",),), f"{hf}.weight", "linear"),
          Entry((ours + ("bias",),), f"{hf}.bias", "vector")]


BERT_LAYER = dict(query="attention.self.query", key="attention.self.key",
                  value="attention.self.value", out="attention.output.dense",
                  attention_norm="attention.output.LayerNorm", wi="intermediate.dense",
                  wo="output.dense", mlp_norm="output.LayerNorm")


def encoder_config_keys(config: ModelConfig) -> dict:
  """The config.json keys every BERT-like layout (BERT, RoBERTa, ALBERT, ELECTRA) writes alike
  (mlp_activation checked against TO_HF_ACTIVATION by the caller)."""
  return {
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "num_hidden_layers": config.num_encoder_layers,
      "num_attention_heads": config.num_heads,
      "intermediate_size": config.d_ff,
      "hidden_act": TO_HF_ACTIVATION[config.mlp_activation],
      "hidden_dropout_prob": config.dropout_rate,
      "attention_probs_dropout_prob": config.dropout_rate,
      "max_position_embeddings": config.max_position_embeddings,
      "type_vocab_size": config.type_vocab_size,
      "initializer_range": config.init_std or 0.02,
      "layer_norm_eps": config.layer_norm_epsilon,
      "tie_word_embeddings": True,
  }


def embedding_entries(prefix: str) -> list[Entry]:
  """`<prefix>.{word,position,token_type}_embeddings` and `<prefix>.LayerNorm` (ALBERT's and
  ELECTRA's factorized tables; BERT's own, whose token types are optional, below)."""
  entries = [Entry((("token_embedder", "embedding"),), f"{prefix}.word_embeddings.weight"),
             Entry((("encoder", "position_embedder", "embedding"),),
                   f"{prefix}.position_embeddings.weight"),
             Entry((("encoder", "token_type_embedder", "embedding"),),
                   f"{prefix}.token_type_embeddings.weight")]
  return entries + norm_entries(("encoder", "embedding_norm"), f"{prefix}.LayerNorm")


def check_heads(config: ModelConfig, model_type: str) -> None:
  if config.num_heads * config.d_kv != config.d_model:
    raise ConfigError(f"HF {model_type!r} has heads of hidden_size / num_attention_heads; this "
                      f"model has num_heads={config.num_heads} x d_kv={config.d_kv} != "
                      f"d_model={config.d_model}, which cannot be exported to it")


class _BertLike(HFLayout):
  prefix = "bert"
  position_offset = 0
  size_fields = tuple(SIZES)
  heads: HeadSpec

  def needs(self, config: ModelConfig) -> dict:
    needs = dict(ENCODER_NEEDS, position_offset=self.position_offset, embedding_size=0,
                 shared_layer_groups=0)
    if config.head:  # no MLM decoder to tie: tying changes nothing
      needs.update(encoder_needs(config, self.heads),
                   tie_output_embedding=config.tie_output_embedding)
      if config.head == "sequence_classification" and not needs["pooler"]:
        needs["classifier_activation"] = "tanh"  # RobertaClassificationHead's
    return needs

  def head_config_to_hf(self, config: ModelConfig, pretraining: str) -> dict:
    """architectures (the head's class, else `pretraining`) and the head's keys."""
    return {"architectures": [pretraining], "classifier_dropout": config.classifier_dropout,
            **self.heads.config_to_hf(config)}

  def checkpoint_tensors(self, tensors):
    return legacy_norm_names(tensors)

  def config_to_hf(self, config: ModelConfig) -> dict:
    self.heads.check(config, self.model_types[0])
    refuse(config, self.model_types[0], self.needs(config))
    check_heads(config, self.model_types[0])
    if not config.type_vocab_size:
      raise ConfigError(f"HF {self.model_types[0]!r} always adds token-type embeddings; this "
                        "model has type_vocab_size=0: set it >= 1 (BERT's is 2, RoBERTa's 1)")
    if config.mlp_activation not in TO_HF_ACTIVATION:
      raise ConfigError(f"HF {self.model_types[0]!r} has no equivalent of mlp_activation="
                        f"{config.mlp_activation!r} (it has {sorted(TO_HF_ACTIVATION)})")
    return {"model_type": self.model_types[0], **encoder_config_keys(config)}

  def config_values(self, hf: Mapping) -> dict:
    sizes = self.sizes(hf, SIZES, defaults={"max_position_embeddings": 512})
    if sizes["d_model"] % sizes["num_heads"]:
      raise ConfigError(f"config.json: hidden_size={sizes['d_model']} is not a multiple of "
                        f"num_attention_heads={sizes['num_heads']}")
    types = hf.get("type_vocab_size", 2)
    if hf.get("tie_word_embeddings", True) is not True:
      raise ConfigError(f"config.json: tie_word_embeddings={hf['tie_word_embeddings']!r}; t5lite "
                        f"reads {self.model_types[0]} models whose MLM decoder is the word "
                        "embedding table (every published one)")
    return dict(
        architecture="encoder_only", **sizes, d_kv=sizes["d_model"] // sizes["num_heads"],
        mlp_activation=self.choice(hf, "hidden_act", FROM_HF_ACTIVATION, "gelu"),
        norm="layer", norm_position="post", use_bias=True, scale_attention=True,
        layer_norm_epsilon=self.number(hf, "layer_norm_eps", 1e-12),
        position_encoding="learned", position_offset=self.position_offset,
        type_vocab_size=self.sizes({"t": types}, {"t": "t"})["t"] if types else 0,
        embedding_norm=True, tie_output_embedding=True,
        init_std=self.number(hf, "initializer_range", 0.02),
        dropout_rate=self.rate(hf, "hidden_dropout_prob", 0.1))

  def embedding_entries(self) -> list[Entry]:
    p = f"{self.prefix}.embeddings"
    entries = [Entry((("token_embedder", "embedding"),), f"{p}.word_embeddings.weight"),
               Entry((("encoder", "position_embedder", "embedding"),),
                     f"{p}.position_embeddings.weight")]
    return entries + norm_entries(("encoder", "embedding_norm"), f"{p}.LayerNorm")

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    entries = self.embedding_entries()
    if config.type_vocab_size:
      entries.append(Entry((("encoder", "token_type_embedder", "embedding"),),
                           f"{self.prefix}.embeddings.token_type_embeddings.weight"))
    for i in range(config.num_encoder_layers):
      entries += post_norm_layer(("encoder", f"layers_{i}"),
                                 f"{self.prefix}.encoder.layer.{i}", BERT_LAYER)
    return entries + self.head_entries(config)


@register
class BertLayout(_BertLike):
  """BertForPreTraining (MLM head, pooler and the next-sentence head: pooler=True,
  sentence_classes=2), or BertForMaskedLM (MLM head only) for checkpoints without them."""
  model_types = ("bert",)
  heads = HeadSpec("Bert", ("BertForPreTraining", "BertForMaskedLM"))

  def needs(self, config):
    if config.head:
      return super().needs(config)
    head = config.pooler or config.sentence_classes  # BertForPreTraining, else BertForMaskedLM
    return dict(super().needs(config), pooler=bool(head), sentence_classes=2 if head else 0)

  def config_to_hf(self, config):
    architecture = "BertForPreTraining" if config.pooler else "BertForMaskedLM"
    hf = super().config_to_hf(config)
    return {**hf, **self.head_config_to_hf(config, architecture), "pad_token_id": 0}

  def config_from_hf(self, hf, tensors, **overrides):
    head = self.heads.head_from_hf(hf, tensors)
    if head:
      values = dict(self.config_values(hf), family="bert", **self.heads.values_from_hf(hf, head))
      return ModelConfig(**{**values, **overrides})
    # A checkpoint saved from BertForMaskedLM has neither pooler nor next-sentence head.
    heads = tensors is None or "cls.seq_relationship.weight" in tensors
    values = dict(self.config_values(hf), family="bert", pooler=heads,
                  sentence_classes=2 if heads else 0)
    return ModelConfig(**{**values, **overrides})

  def head_entries(self, config):
    if config.head:
      return self.heads.entries(config, "bert.pooler.dense")
    heads = (dense_entries(("pooler",), "bert.pooler.dense")
             + dense_entries(("sentence_classifier",), "cls.seq_relationship")
             if config.pooler else [])
    return (heads + dense_entries(("mlm_transform",), "cls.predictions.transform.dense")
            + norm_entries(("mlm_norm",), "cls.predictions.transform.LayerNorm")
            + [Entry((("logits_dense", "bias"),), "cls.predictions.bias", "vector")])


@register
class RobertaLayout(_BertLike):
  """RobertaForMaskedLM: MLM head only; positions offset by the padding index + 1."""
  model_types = ("roberta",)
  prefix = "roberta"
  position_offset = 2
  # RobertaForMultipleChoice drops out at hidden_dropout_prob, not classifier_dropout.
  heads = HeadSpec("Roberta", ("RobertaForMaskedLM",), pooled=("multiple_choice",),
                   hidden_dropout_heads=("multiple_choice",))

  def needs(self, config):
    if config.head:
      return super().needs(config)
    # RobertaLMHead applies exact GELU whatever hidden_act says.
    return dict(super().needs(config), pooler=False, sentence_classes=0,
                mlp_activation="gelu_exact")

  def config_to_hf(self, config):
    hf = super().config_to_hf(config)
    return {**hf, **self.head_config_to_hf(config, "RobertaForMaskedLM"),
            "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}

  def config_from_hf(self, hf, tensors, **overrides):
    pad = hf.get("pad_token_id", 1)
    if pad != 1:  # HF's position ids start at pad_token_id + 1
      raise ConfigError(f"config.json: pad_token_id={pad!r}; t5lite reads RoBERTa models whose "
                        "positions start at 2 (pad_token_id 1, as every published one)")
    head = self.heads.head_from_hf(hf, tensors)
    if not head and hf.get("hidden_act", "gelu") != "gelu":  # the MLM head is exact GELU
      raise ConfigError(f"config.json: hidden_act={hf['hidden_act']!r}; t5lite reads RoBERTa "
                        "models with hidden_act 'gelu' (its MLM head applies exact GELU always)")
    values = dict(self.config_values(hf), family="roberta",
                  **(self.heads.values_from_hf(hf, head) if head else {}))
    return ModelConfig(**{**values, **overrides})

  def head_entries(self, config):
    if config.head:
      return self.heads.entries(config, "roberta.pooler.dense")
    return (dense_entries(("mlm_transform",), "lm_head.dense")
            + norm_entries(("mlm_norm",), "lm_head.layer_norm")
            + [Entry((("logits_dense", "bias"),), "lm_head.bias", "vector")])
