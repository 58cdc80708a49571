"""CoNLL-2003 named entities for a BERT-style token-classification head (HF's run_ner).

Each sentence's words become word pieces; the first piece of a word carries its IOB2 tag,
the other pieces and [CLS] / [SEP] carry -100 (t5lite.data.converters.head_features.encode_words;
word pieces as BERT's uncased vocabulary has them):

  {"id": "0", "tokens": ["EU", "rejects", "German", "call"], "ner_tags": [3, 0, 7, 0]}
    -> {"inputs": [CLS eu reject ##s german call SEP], "token_type_ids": [0 0 0 0 0 0 0],
        "token_labels": [-100 3 0 -100 7 0 -100], "id": "0", "truncated_tokens": 0}

conll2003_ner_head: a token_classification head over HF conll2003's 9 tags (LABELS, in its
order: 0 is O); metrics on the tags of the first pieces (words cut by truncation left out,
as HF): entity precision / recall / F1 (seqeval's default, t5lite.eval.metrics.entity_f1)
and token accuracy. Tags may be ids or names.

Data: $T5LITE_LOCAL_DATA_DIR/conll2003/<split>.jsonl (train, validation, test) with HF's
fields "tokens" and "ner_tags" (tasks/glue.py's local files), else the TFDS dataset
conll2003, whose tag field "ner" is read when "ner_tags" is absent. Vocabulary as
tasks/glue_heads.py (the embedded WordPiece; register_head_tasks for your own).
"""
from __future__ import annotations

from t5lite.data.converters import head_features as hf
from t5lite.data.registry import CACHE_POINT, add_task
from t5lite.eval import metrics

from . import embedded
from .glue import split_sources

DATASET = "conll2003"
LABELS = ("O", "B-PER", "I-PER", "B-ORG", "I-ORG", "B-LOC", "I-LOC", "B-MISC", "I-MISC")


def hf_field_names(ex: dict) -> dict:
  """TFDS's conll2003 calls the tags "ner"; HF (and local files) "ner_tags"."""
  if "ner_tags" not in ex and "ner" in ex:
    ex = {**ex, "ner_tags": ex["ner"]}
  return ex


def register(vocabulary=None, suffix: str = "") -> None:
  """Registers conll2003_ner_head<suffix>."""
  name = f"conll2003_ner_head{suffix}"
  add_task(name, split_sources(DATASET, ("train", "validation", "test")),
           hf.head_output_features(vocabulary or embedded.MLM_VOCABULARY),
           (hf_field_names, hf.encode_words(name, LABELS), CACHE_POINT, hf.tagging_inputs(name)),
           postprocess_fn=hf.tagging_postprocess(LABELS),
           metric_fns=(metrics.entity_f1, metrics.token_accuracy),
           head="token_classification", num_labels=len(LABELS))


register()
