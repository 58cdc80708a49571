"""Model families: one object per kind of model and how it trains (see base.py).

    family = family_of(model_config)          # the registered family of the config
    loss_sum, sums = family.loss_fn(params, batch, rng)

Importing this package registers the built-in families: encoder-decoder (T5), decoder-only
(causal / prefix LM) and encoder-only (MLM).
"""
from t5lite.families import decoder_only, encoder_decoder, encoder_only  # noqa: F401 (registers)
from t5lite.families import landmarks  # noqa: F401 (registers bert, roberta, albert, gpt2, llama)
from t5lite.families import electra  # noqa: F401 (registers electra)
from t5lite.families.base import Family, LossOptions, token_loss_sums
from t5lite.families.registry import family_of, get, names, register

__all__ = ["Family", "LossOptions", "family_of", "get", "names", "register", "token_loss_sums"]
