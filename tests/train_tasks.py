"""Small tasks for trainer tests, on byte tokens; importing this module registers them.

Subprocess tests import it through the CLI's MIXTURE_OR_TASK_MODULE (with tests/ on
PYTHONPATH), so the trainer runs exactly as a user's `t5lite train` would.

  train_test_sc         T5 span corruption over synthetic word documents (train, validation)
  train_test_sc_scored  the same with a metric, for inference evals (sequence accuracy of the
                        decoded targets)
  train_test_copy       a text -> the same text (train, validation)
"""
import numpy as np

from t5lite.data import preprocessors as pp
from t5lite.data.pretraining import span_corruption_preprocessors
from t5lite.data.registry import CACHE_POINT, Feature, TaskRegistry, add_task
from t5lite.data.sources import FunctionSource
from t5lite.data.vocabularies import ByteVocabulary
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


def tiny_decoder_only():
  """A tiny causal LM over these tasks' byte vocabulary."""
  from t5lite.models import ModelConfig
  return ModelConfig(architecture="decoder_only", vocab_size=384, d_model=32, d_ff=64,
                     num_heads=4, d_kv=8, num_encoder_layers=0, num_decoder_layers=2,
                     position_encoding="rope", mlp_activation="swiglu")
