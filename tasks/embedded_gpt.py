"""The embedded sentence-pair task in GPT-1's form, for decoder-only classifiers.

  stdlib_sentence_pair_gpt1   stdlib_sentence_pair_head's pairs (is B the sentence after A
      in the same docstring, 1, or one from another module's, 0?) as
      [START] A [DELIM] B [EXTRACT] (t5lite.data.converters.gpt_inputs) in the embedded byte-level
      BPE (stdlib_lm's) with the three tokens added (ids 4000, 4001, 4002); accuracy and F1.

Train it with a decoder-only model with head='sequence_classification', num_labels=2 and
lm_loss_weight=0.5 (GPT-1's recipe), from a stdlib_lm checkpoint: gin/runs/gpt1_finetune.gin.
A model of vocab_size 4096 (llama_style/tiny.gin) already has rows for the added ids.
"""
from __future__ import annotations

import functools

from t5lite.data.converters import head_features as hf
from t5lite.data.converters.gpt_inputs import gpt1_inputs, gpt1_vocabulary
from t5lite.data.registry import CACHE_POINT, TaskRegistry, add_task
from t5lite.eval import metrics

from . import embedded, embedded_heads
from .vocab import LazyVocabulary


def load_gpt1_vocabulary():
  """stdlib_lm's byte-level BPE with [START], [DELIM] and [EXTRACT] appended."""
  return gpt1_vocabulary(embedded.load_lm_vocabulary())


GPT1_VOCABULARY = LazyVocabulary(load=load_gpt1_vocabulary,
                                 description="the embedded byte-level BPE + GPT-1's tokens")
NAME = "stdlib_sentence_pair_gpt1"

if NAME not in TaskRegistry.names():
  add_task(NAME, {s: functools.partial(embedded_heads.pair_examples, s)
                  for s in ("train", "validation")},
           hf.head_output_features(GPT1_VOCABULARY),
           (hf.encode_pair(NAME, ("sentence1", "sentence2"), 2), CACHE_POINT, gpt1_inputs(NAME)),
           postprocess_fn=hf.class_postprocess,
           metric_fns=(metrics.accuracy, metrics.f1_score_with_invalid),
           head="sequence_classification", num_labels=2)
