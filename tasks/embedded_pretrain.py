"""BERT-line pretraining tasks on the embedded stdlib corpus, one per landmark recipe.

All read the stdlib docstrings (t5lite_tasks.embedded: its sources, its WordPiece vocabulary
of 4000 ids, [PAD] 0 [UNK] 1 [CLS] 2 [SEP] 3 [MASK] 4, nothing downloaded) and mask 15% of
the non-special tokens with new masks every epoch (t5lite.data.objectives.masking); the sentence
tasks split documents into sentences with pysbd (t5lite.data.objectives.sentence_pairs):

  stdlib_bert_pretrain      BERT: `[CLS] A [SEP] B [SEP]` pairs, B the next sentences or (50%)
                            a random other document's (sentence_label 1), token-level
                            80/10/10 masking (objectives.mlm)
  stdlib_albert_pretrain    ALBERT: the same pairs with sentence order prediction (50%
                            swapped, sentence_label 1) and n-gram masking (n <= 3 words)
  stdlib_roberta_pretrain   RoBERTa: FULL-SENTENCES (sentences packed across documents,
                            [SEP] between documents), one segment, token-level masking
  stdlib_spanbert_pretrain  SpanBERT: `[CLS] piece [SEP]` single segments of the full inputs
                            length, span masking with the span boundary features
  stdlib_electra_pretrain   ELECTRA: `[CLS] piece [SEP]` pieces, 15% of the tokens masked, 85%
                            of those [MASK] and 15% unchanged (no random tokens: the
                            generator's samples are the replacements)

Example (stdlib_bert_pretrain, inputs 128): {"inputs": [2 ... 4 ... 3 ... 3], "targets":
[2 ... 3 ... 3], "weights", "token_type_ids": [0 ... 0 1 ... 1], "sentence_label": 0,
"truncated_tokens": 0}. The pair tasks need unpacked rows (TrainConfig.pack = False, as
gin/runs/stdlib_bert_pretrain.gin sets); the converter passes token types, sentence labels
and span features on to the model (EncoderOnlyFeatureConverter).
"""
from __future__ import annotations

from t5lite.data import preprocessors as pp
from t5lite.data.objectives.chains import mlm_preprocessors
from t5lite.data.objectives.masking import masking_step
from t5lite.data.registry import CACHE_POINT, TaskRegistry, add_task
from t5lite.data.objectives.sentence_pairs import (full_sentences_preprocessors,
                                        sentence_pair_preprocessors, tokenize_sentences)
from t5lite.families.electra import MASK_RATE, MASK_TOKEN_RATE

from .embedded import MLM_FEATURES, SOURCES

# Sentence splitting (pysbd) and tokenizing sentence by sentence come before the cache
# point: `t5lite cache` stores the documents' sentences.
_SENTENCES = [pp.rekey({"targets": "text"}), tokenize_sentences, CACHE_POINT]


def register() -> None:
  """Registers the four tasks (idempotent)."""
  if "stdlib_bert_pretrain" in TaskRegistry.names():
    return
  add_task("stdlib_bert_pretrain", SOURCES, MLM_FEATURES,
           [*_SENTENCES, *sentence_pair_preprocessors("nsp"), masking_step("token")])
  add_task("stdlib_albert_pretrain", SOURCES, MLM_FEATURES,
           [*_SENTENCES, *sentence_pair_preprocessors("sop"), masking_step("ngram")])
  add_task("stdlib_roberta_pretrain", SOURCES, MLM_FEATURES,
           [*_SENTENCES, *full_sentences_preprocessors(), masking_step("token")])
  add_task("stdlib_spanbert_pretrain", SOURCES, MLM_FEATURES,
           [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT,
            *mlm_preprocessors(kind="span", add_cls_sep=True)])
  add_task("stdlib_electra_pretrain", SOURCES, MLM_FEATURES,
           [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT,
            *mlm_preprocessors(kind="token", add_cls_sep=True, mask_rate=MASK_RATE,
                                     random_rate=0.0, keep_rate=1.0 - MASK_TOKEN_RATE)])


register()
