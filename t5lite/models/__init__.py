"""Pure Flax (linen) models: T5 encoder-decoder, decoder-only and encoder-only families."""
from t5lite.models.config import ModelConfig
from t5lite.models.losses import token_accuracy, weighted_cross_entropy
from t5lite.models.network import DecoderOnly, EncoderDecoder, EncoderOnly, make_model
from t5lite.models.params import (abstract_params, count_params, init_params,
                                  param_logical_axes)

__all__ = [
    "ModelConfig", "EncoderDecoder", "DecoderOnly", "EncoderOnly", "make_model",
    "init_params", "abstract_params", "param_logical_axes", "count_params",
    "weighted_cross_entropy", "token_accuracy",
]
