"""Finetuning heads in HF layouts: which `*For<Head>` class a config is, and its tensors.

Every HF model type with heads names them alike: `<Stem>For<Head>` (BertForTokenClassification,
GPT2ForSequenceClassification, ...), with the head's tensors at the top level beside the
backbone (`bert.*`, `transformer.*`, `model.*`). One HeadSpec per model type says which heads
it has and how its config.json spells them; the per-model layouts (hf_bert, hf_albert, hf_gpt2,
hf_llama) call it for the architecture, the config fields and the weight names:

  t5lite (ModelConfig.head)  HF class suffix              tensors (ours -> HF)
  sequence_classification    ForSequenceClassification    pooler + head/classifier -> classifier
                             (encoder, no pooler: RoBERTa) head/dense -> classifier.dense,
                                                           head/classifier -> classifier.out_proj
                             (decoder)                    head/score/kernel -> score.weight
  token_classification       ForTokenClassification       head/classifier -> classifier
  question_answering         ForQuestionAnswering         head/qa_outputs -> qa_outputs
  multiple_choice            ForMultipleChoice            pooler + head/classifier -> classifier

config.json: `architectures` names the class; `id2label` / `label2id` carry num_labels (HF
keeps no num_labels key: it counts id2label, and 2 when there is none); `problem_type` when
set; the classifier's dropout under the model's key (BERT's `classifier_dropout`, null meaning
hidden_dropout_prob; ALBERT's `classifier_dropout_prob`). Example: a BERT config with
head='token_classification', num_labels=3 exports as

  {"architectures": ["BertForTokenClassification"], "id2label": {"0": "LABEL_0", ...},
   "label2id": {"LABEL_0": 0, ...}, "classifier_dropout": null, ...}

and imports back with head='token_classification', num_labels=3, pooler=False (HF's token
classifiers build their backbone without the pooler).

Options with no HF equivalent are refused on export, by name: GPT-1's lm_loss_weight, SpanBERT's
span boundary objective (ModelConfig.span_boundary).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from t5lite.errors import ConfigError
from t5lite.interop.hf.layout import Entry, HFLayout
from t5lite.models.config import PROBLEM_TYPES, ModelConfig

SUFFIXES = {"sequence_classification": "ForSequenceClassification",
            "token_classification": "ForTokenClassification",
            "question_answering": "ForQuestionAnswering",
            "multiple_choice": "ForMultipleChoice"}
ENCODER_HEADS = tuple(SUFFIXES)
DECODER_HEADS = ("sequence_classification",)
def _dense(ours: tuple[str, ...], hf: str) -> list[Entry]:
  return [Entry((ours + ("kernel",),), f"{hf}.weight", "linear"),
          Entry((ours + ("bias",),), f"{hf}.bias", "vector")]


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """The heads of one HF model type.

  stem: the class-name stem ('Bert' -> BertForSequenceClassification).
  pretraining: architectures that mean head '' (the first is not chosen here: the layout
    picks its pretraining class).
  heads: the t5lite heads this model type has in HF.
  pooled: heads whose HF backbone has the pooler (BERT's sequence classifier reads it;
    RoBERTa's builds its own dense head instead).
  dropout_key / dropout_default: the config.json key of the classifier's dropout and the value
    HF's config class gives it when absent (None: no key; the head has no classifier dropout).
  hidden_dropout_heads: heads whose HF dropout is hidden_dropout_prob whatever the config says
    (RoBERTa's multiple choice): a classifier_dropout other than dropout_rate is refused.
  decoder: a decoder-only model type (score on the last real token; pad_token_id written).
  """
  stem: str
  pretraining: tuple[str, ...]
  heads: tuple[str, ...] = ENCODER_HEADS
  pooled: tuple[str, ...] = ("sequence_classification", "multiple_choice")
  dropout_key: str | None = "classifier_dropout"
  dropout_default: float | None = None
  hidden_dropout_heads: tuple[str, ...] = ()
  decoder: bool = False

  def architecture(self, head: str) -> str:
    return self.stem + SUFFIXES[head]

  def supported(self) -> list[str]:
    return list(self.pretraining) + [self.architecture(h) for h in self.heads]

  # --- import --------------------------------------------------------------------------------

  def head_from_hf(self, hf: Mapping, tensors: Mapping[str, np.ndarray] | None) -> str:
    """The head config.json's architectures[0] names ('' for a pretraining class); without
    `architectures`, the one whose tensors are present ('' when none, or tensors is None)."""
    names = hf.get("architectures")
    if names is None or names == []:
      return self._head_from_tensors(tensors)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
      raise ConfigError(f"config.json: architectures={names!r} is not a list of class names")
    if names[0] in self.pretraining:
      return ""
    for head in self.heads:
      if names[0] == self.architecture(head):
        return head
    raise ConfigError(f"config.json: architectures[0]={names[0]!r} is not supported; t5lite "
                      f"reads {', '.join(self.supported())} (fix `architectures` if the "
                      "weights are one of those)")

  def _head_from_tensors(self, tensors) -> str:
    if tensors is None:
      return ""
    if self.decoder:
      return "sequence_classification" if "score.weight" in tensors else ""
    if "qa_outputs.weight" in tensors:
      return "question_answering"
    if "classifier.out_proj.weight" in tensors:
      return "sequence_classification"
    if "classifier.weight" in tensors:  # on a pooler: a sequence classifier (or multiple choice)
      pooled = any(".pooler." in name for name in tensors)
      return "sequence_classification" if pooled else "token_classification"
    return ""

  def values_from_hf(self, hf: Mapping, head: str) -> dict:
    """ModelConfig fields of a head model's config.json (head, num_labels, problem_type,
    classifier_dropout, and pooler for an encoder)."""
    num_labels = self._num_labels(hf)
    if head == "question_answering" and num_labels != 2:
      raise ConfigError(f"config.json: num_labels={num_labels} for {self.architecture(head)}; "
                        "t5lite's question-answering head has 2 outputs (start, end): set "
                        "id2label to 2 labels")
    problem = hf.get("problem_type")
    problem = "" if problem is None else problem
    if problem not in PROBLEM_TYPES:
      raise ConfigError(f"config.json: problem_type={problem!r} is not one of "
                        f"{[p for p in PROBLEM_TYPES if p]} (or null)")
    values = dict(head=head, num_labels=num_labels, problem_type=problem)
    if self.dropout_key and head not in self.hidden_dropout_heads:
      dropout = hf.get(self.dropout_key, self.dropout_default)
      if dropout is not None:
        dropout = HFLayout.rate(hf, self.dropout_key, dropout)
      values["classifier_dropout"] = dropout
    if not self.decoder:
      values.update(pooler=head in self.pooled, sentence_classes=0)
    return values

  @staticmethod
  def _num_labels(hf: Mapping) -> int:
    labels = hf.get("id2label")
    if labels is not None:
      if not isinstance(labels, Mapping) or not labels:
        raise ConfigError(f"config.json: id2label={labels!r} is not an object of label names")
      return len(labels)
    value = hf.get("num_labels", 2)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f"config.json: num_labels={value!r} is not a positive integer")
    return value

  # --- export --------------------------------------------------------------------------------

  def check(self, config: ModelConfig, model_type: str) -> None:
    """A ConfigError naming any head option of config that HF's `model_type` cannot express."""
    if config.lm_loss_weight:
      raise ConfigError(f"HF {model_type!r} has no equivalent of lm_loss_weight="
                        f"{config.lm_loss_weight} (GPT-1's auxiliary LM loss is t5lite's own); "
                        "set lm_loss_weight=0 to export the classifier")
    if config.span_boundary:
      raise ConfigError(f"HF {model_type!r} has no equivalent of span_boundary="
                        f"{config.span_boundary!r} (SpanBERT's span boundary head); set "
                        "span_boundary=None to export the model without it")
    if not config.head:
      return
    if config.head not in self.heads:
      raise ConfigError(f"HF {model_type!r} has no equivalent of head={config.head!r} (it has "
                        f"{list(self.heads)}); this model cannot be exported to that layout")
    if (config.loss_problem_type == "single_label_classification" and config.num_labels == 1
        and config.head == "sequence_classification"):
      raise ConfigError("HF refuses problem_type='single_label_classification' with "
                        "num_labels=1: set num_labels >= 2, or problem_type='regression'")
    if (config.head in self.hidden_dropout_heads and config.classifier_dropout is not None
        and config.classifier_dropout != config.dropout_rate):
      raise ConfigError(f"HF {self.architecture(config.head)} drops out at hidden_dropout_prob "
                        f"(= dropout_rate {config.dropout_rate}); it has no equivalent of "
                        f"classifier_dropout={config.classifier_dropout}: set it to None")

  def config_to_hf(self, config: ModelConfig) -> dict:
    """The head's config.json keys (architectures, labels, problem_type, dropout); {} for a
    pretraining config (the layout writes its own architectures)."""
    if not config.head:
      return {}
    labels = 2 if config.head == "question_answering" else config.num_labels
    out = {"architectures": [self.architecture(config.head)],
           "id2label": {str(i): f"LABEL_{i}" for i in range(labels)},
           "label2id": {f"LABEL_{i}": i for i in range(labels)}}
    if config.problem_type:
      out["problem_type"] = config.problem_type
    if self.dropout_key:
      dropout = config.classifier_dropout
      if dropout is None and self.dropout_default is not None:  # ALBERT's key has no null
        dropout = config.dropout_rate
      out[self.dropout_key] = dropout
    if self.decoder:
      # HF classifies the last token that is not pad_token_id. GPT-2's id 0 is "!", so the
      # pad is the end-of-text token, HF's usual choice (tokenizer.pad_token = eos_token).
      out["pad_token_id"] = config.eos_id
    return out

  # --- weights -------------------------------------------------------------------------------

  def entries(self, config: ModelConfig, pooler: str | None = None) -> list[Entry]:
    """The head's entries (and the pooler's, at HF name `pooler`, when config.pooler) of a
    head config; [] for a pretraining one."""
    if not config.head:
      return []
    if self.decoder:
      return [Entry((("head", "score", "kernel"),), "score.weight", "linear")]
    # Token classification and QA read no pooler (HF builds them without one): a finetuned
    # model that kept its pretrained pooler exports without it, losing nothing it computes.
    pooled = config.head in self.pooled
    entries = _dense(("pooler",), pooler) if config.pooler and pooler and pooled else []
    if config.head == "question_answering":
      return entries + _dense(("head", "qa_outputs"), "qa_outputs")
    if config.head == "sequence_classification" and not config.pooler:  # RoBERTa's head
      return (entries + _dense(("head", "dense"), "classifier.dense")
              + _dense(("head", "classifier"), "classifier.out_proj"))
    return entries + _dense(("head", "classifier"), "classifier")


def encoder_needs(config: ModelConfig, spec: HeadSpec) -> dict:
  """The pooler / sentence-head values HF's class for config.head has (head configs only).
  Token classification and QA read no pooler: a model with one exports without it."""
  if config.head in ("token_classification", "question_answering"):
    return dict(pooler=config.pooler, sentence_classes=0)
  return dict(pooler=config.head in spec.pooled, sentence_classes=0)
