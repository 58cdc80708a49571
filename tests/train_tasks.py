"""Small tasks for trainer tests, on byte tokens; importing this module registers them.

Subprocess tests import it through the CLI's MIXTURE_OR_TASK_MODULE (with tests/ on
PYTHONPATH), so the trainer runs exactly as a user's `t5lite train` would.

  train_test_sc         T5 span corruption over synthetic word documents (train, validation)
  train_test_sc_scored  the same with a metric, for inference evals (sequence accuracy of the
                        decoded targets)
  train_test_copy       a text -> the same text (train, validation)
  train_test_lm         causal LM over the same documents: `targets` pieces, no EOS
                        (decoder-only models)
  train_test_prefix_lm  prefix LM: each piece split into inputs and targets, EOS on both
                        (decoder-only models with prefix_lm)
  train_test_mlm        BERT MLM, <extra_id_0> as the mask (encoder-only models)
  train_test_classify   sequence classification head: is the first word beta, gamma, delta or
                        zeta (label 1: its first byte tells, which a tiny model learns fast);
                        byte tokens after a 2 ("[CLS]"), accuracy (head='sequence_classification',
                        num_labels=2)

Their model configs are in helpers/__init__.py (tiny, tiny_decoder_only, tiny_encoder_only).
"""
import numpy as np

from t5lite.data import preprocessors as pp
from t5lite.data.objectives.chains import (causal_lm_preprocessors, mlm_preprocessors,
                                     prefix_lm_preprocessors, span_corruption_preprocessors)
from t5lite.data.registry import CACHE_POINT, Feature, TaskRegistry, add_task
from t5lite.data.sources.readers import FunctionSource
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.eval import metrics

VOCAB = ByteVocabulary(extra_ids=100)  # 359 ids; models use vocab_size 384
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "the", "a"]


def documents(n: int, seed: int) -> list[dict]:
  rng = np.random.RandomState(seed)
  return [{"text": " ".join(rng.choice(WORDS, rng.randint(5, 30)))} for _ in range(n)]


def _train_docs():
  return documents(256, 0)


def _validation_docs():
  return documents(64, 1)


SOURCES = {"train": FunctionSource(_train_docs), "validation": FunctionSource(_validation_docs)}


def _classify(ex):
  """A document -> a head example: [CLS]-like 2, then its bytes; label: the first word is
  one of FIRST_WORDS."""
  text = ex["text"].decode() if isinstance(ex["text"], bytes) else str(ex["text"])
  tokens = np.concatenate([[2], VOCAB.encode(text)]).astype(np.int32)
  return {"inputs": tokens, "token_type_ids": np.zeros_like(tokens),
          "label": np.int32(text.split()[0] in FIRST_WORDS), "idx": np.int32(len(text))}


FIRST_WORDS = ("beta", "gamma", "delta", "zeta")

if "train_test_sc" not in TaskRegistry.names():
  add_task("train_test_sc", SOURCES, FEATURES,
           [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT,
            *span_corruption_preprocessors()])
  add_task("train_test_sc_scored", SOURCES, FEATURES,
           [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT,
            *span_corruption_preprocessors()],
           metric_fns=[metrics.sequence_accuracy])
  add_task("train_test_copy", SOURCES, FEATURES,
           [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, CACHE_POINT,
            pp.append_eos_after_trim])
  add_task("train_test_lm", SOURCES, {"targets": Feature(VOCAB, add_eos=False)},
           [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT, *causal_lm_preprocessors()])
  add_task("train_test_prefix_lm", SOURCES, FEATURES,
           [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT, *prefix_lm_preprocessors()])
  add_task("train_test_classify", SOURCES, {"inputs": Feature(VOCAB, add_eos=False)},
           [_classify], metric_fns=[metrics.accuracy], head="sequence_classification",
           num_labels=2)
  add_task("train_test_mlm", SOURCES, FEATURES,
           [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT,
            *mlm_preprocessors(mask_id=VOCAB.extra_id(0))])

