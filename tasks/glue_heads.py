"""GLUE for BERT-style finetuning heads (HF's run_glue), from TFDS or local files.

The nine GLUE tasks in head form: `[CLS] sentence1 [SEP] sentence2 [SEP]` with the class id
(STS-B: the score) as `label`, no text targets (t5lite.data.converters.head_features):

  glue_mrpc_head: {"sentence1": "He left.", "sentence2": "He went.", "label": 1, "idx": 3}
    -> {"inputs": [CLS he left . SEP he went . SEP], "token_type_ids": [0 0 0 0 0 1 1 1 1],
        "label": 1, "idx": 3, "truncated_tokens": 0}

Tasks glue_{cola,sst2,mrpc,qqp,stsb,mnli,mnli_matched,mnli_mismatched,qnli,rte,wnli}_head:
sequence_classification heads with GLUE's classes in TFDS's label order (STS-B a regression,
num_labels 1), GLUE's metrics (CoLA Matthews; STS-B Pearson and Spearman; MRPC and QQP F1 and
accuracy; the others accuracy) on the argmax of the logits. Sentence order is HF's (MNLI:
premise first). Labeled splits only: train and validation (MNLI: validation_matched and
validation_mismatched; glue_mnli_{matched,mismatched}_head: validation); the test splits are
unlabeled. Data: tasks/glue.py's ($T5LITE_LOCAL_DATA_DIR/glue/<config>/<split>.jsonl, else
TFDS glue/<config>:2.0.0).

Vocabulary: the embedded stdlib WordPiece (tasks.embedded.MLM_VOCABULARY, built on first
use). register_head_tasks(vocabulary, suffix) registers every head task (these, SQuAD, NER,
the embedded ones) again with your own WordPiece, e.g. an imported BERT's:

  register_head_tasks(load_vocabulary("runs/bert_base"), "_bert")  # glue_cola_head_bert, ...
"""
from __future__ import annotations

from t5lite.data.converters import head_features as hf
from t5lite.data.registry import CACHE_POINT, TaskRegistry, add_task
from t5lite.errors import ConfigError

from . import conll_ner, embedded, embedded_heads, squad_heads
from .glue import GLUE, GLUE_VERSION, split_sources

# HF run_glue's task_to_keys: the sentence fields, in the order BERT reads them.
FIELDS = {"cola": ("sentence",), "sst2": ("sentence",), "mrpc": ("sentence1", "sentence2"),
          "qqp": ("question1", "question2"), "stsb": ("sentence1", "sentence2"),
          "mnli": ("premise", "hypothesis"), "mnli_matched": ("premise", "hypothesis"),
          "mnli_mismatched": ("premise", "hypothesis"), "qnli": ("question", "sentence"),
          "rte": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2")}
SPLITS = {"mnli": ("train", "validation_matched", "validation_mismatched"),
          "mnli_matched": ("validation",), "mnli_mismatched": ("validation",)}


def register(vocabulary=None, suffix: str = "") -> None:
  """Registers glue_<config>_head<suffix> for the nine GLUE tasks and the MNLI eval sets."""
  features = hf.head_output_features(vocabulary or embedded.MLM_VOCABULARY)
  for b in GLUE:
    if b.config not in FIELDS:
      continue  # ax: the unlabeled diagnostics set
    name = f"glue_{b.config}_head{suffix}"
    regression = b.labels is None
    num_labels = 1 if regression else len(b.labels)
    fields = FIELDS[b.config]
    add_task(name, split_sources(f"glue/{b.config}:{GLUE_VERSION}",
                                 SPLITS.get(b.config, ("train", "validation")), fields),
             features,
             (hf.encode_pair(name, fields, num_labels,
                             kind="regression" if regression else "single"),
              CACHE_POINT, hf.pair_inputs(name)),
             postprocess_fn=hf.regression_postprocess if regression else hf.class_postprocess,
             metric_fns=b.metric_fns, head="sequence_classification", num_labels=num_labels)


def register_head_tasks(vocabulary, suffix: str) -> list[str]:
  """Registers every head task (GLUE, SQuAD, CoNLL NER, the embedded ones) with `vocabulary`
  under names ending in `suffix`; returns the new names."""
  if not suffix or not isinstance(suffix, str):
    raise ConfigError("register_head_tasks: give a suffix (e.g. '_bert'): the default names "
                      "are taken by the tasks with the embedded WordPiece vocabulary")
  hf.special_ids(vocabulary, f"*_head{suffix}")  # fail now, not at the first example
  before = set(TaskRegistry.names())
  for module in (embedded_heads, squad_heads, conll_ner):
    module.register(vocabulary, suffix)
  register(vocabulary, suffix)
  return sorted(set(TaskRegistry.names()) - before)


register()
