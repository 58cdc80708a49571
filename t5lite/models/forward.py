"""`logits`: one jitted fp32 forward pass of an encoder-decoder, the stable parity API."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from t5lite.models.config import ModelConfig
from t5lite.models.network import make_model
from t5lite.models.params import Params


@functools.lru_cache(maxsize=16)
def _jitted_logits(config: ModelConfig):
  model = make_model(config)

  @jax.jit
  def run(params, encoder_tokens, decoder_tokens):
    # All-ones segment ids: no padding mask derived from the tokens, as HF without a mask.
    return model.apply({"params": params}, encoder_tokens, decoder_tokens,
                       encoder_segment_ids=jnp.ones_like(encoder_tokens),
                       decoder_segment_ids=jnp.ones_like(decoder_tokens)).astype(jnp.float32)
  return run


def logits(config: ModelConfig, params: Params, encoder_input_tokens, decoder_input_tokens
           ) -> np.ndarray:
  """fp32 logits (B, T, V) of an encoder-decoder for token arrays (B, S) and (B, T).

  No dropout; the decoder is causal only and no padding mask comes from the tokens (0 is
  both pad and decoder start), like HF's T5 called without attention masks. 1-D inputs are
  treated as a batch of one and give (T, V).
  """
  if config.architecture != "encoder_decoder":
    raise ValueError(f"logits() is for encoder_decoder models, got {config.architecture!r}")
  enc = np.asarray(encoder_input_tokens, np.int32)
  dec = np.asarray(decoder_input_tokens, np.int32)
  single = enc.ndim == 1
  if single:
    enc, dec = enc[None], dec[None]
  if enc.ndim != 2 or dec.ndim != 2 or enc.shape[0] != dec.shape[0]:
    raise ValueError(f"expected (batch, length) token arrays with one batch size, got "
                     f"{enc.shape} and {dec.shape}")
  # fp32 end to end; 'highest' stops GPUs from using TF32 matmuls.
  with jax.default_matmul_precision("highest"):
    out = np.asarray(_jitted_logits(config.replace(dtype="float32"))(params, enc, dec))
  return out[0] if single else out
