"""t5lite: a JAX/Flax pretraining stack for text-to-text Transformers.

Stable API: ModelConfig, load_hf, save_hf, logits, sentence_logits, generate.
"""
from t5lite.interop.hf.checkpoints import load_hf, save_hf
from t5lite.models import ModelConfig, count_params, init_params, make_model
from t5lite.models.decoding.search import generate
from t5lite.models.forward import logits, sentence_logits

__version__ = "0.1.0"
__all__ = ["ModelConfig", "make_model", "init_params", "count_params", "logits", "generate",
           "load_hf", "save_hf", "sentence_logits"]
