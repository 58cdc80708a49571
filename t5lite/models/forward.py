"""`logits` and `sentence_logits`: one jitted fp32 forward pass of any model, the parity API
that compares every family with HF transformers."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from t5lite.models.config import ModelConfig
from t5lite.models.network import make_model
from t5lite.models.params import Params


@functools.lru_cache(maxsize=16)
def _jitted(config: ModelConfig, sentence: bool):
  model = make_model(config)

  @jax.jit
  def run(params, tokens, decoder_tokens, token_types):
    # All-ones segment ids: no padding mask derived from the tokens, as HF without a mask.
    ones = jnp.ones_like(tokens)
    if config.architecture == "encoder_decoder":
      out = model.apply({"params": params}, tokens, decoder_tokens, encoder_segment_ids=ones,
                        decoder_segment_ids=jnp.ones_like(decoder_tokens))
    elif config.architecture == "decoder_only":
      out = model.apply({"params": params}, tokens, decoder_segment_ids=ones)
      out = out[0] if isinstance(out, tuple) else out  # a classifier with GPT-1's LM loss
    else:
      out = model.apply({"params": params}, tokens, encoder_segment_ids=ones,
                        encoder_token_type_ids=token_types, with_sentence_logits=sentence)
      out = out[1] if sentence else out
    return out.astype(jnp.float32)
  return run


def _tokens(x) -> np.ndarray | None:
  if x is None:
    return None
  x = np.asarray(x, np.int32)
  return x[None] if x.ndim == 1 else x


def _run(config: ModelConfig, params: Params, input_ids, decoder_input_ids, token_type_ids,
         sentence: bool) -> np.ndarray:
  if config.electra and config.electra.pretrains_pair:
    raise ValueError("this ELECTRA config holds two networks (ElectraConfig."
                     "generator_hidden_fraction > 0): "
                     "take each one's (name, config, params) from "
                     "t5lite.families.family_of(config).networks(params) and call logits on it")
  single = np.ndim(input_ids) == 1
  tokens = _tokens(input_ids)
  decoder = _tokens(decoder_input_ids)
  types = _tokens(token_type_ids)
  if config.architecture == "encoder_decoder" and decoder is None:
    raise ValueError("an encoder-decoder model needs decoder_input_ids (its decoder's tokens)")
  if config.architecture != "encoder_decoder" and decoder is not None:
    raise ValueError(f"decoder_input_ids are for encoder-decoder models; this one is "
                     f"{config.architecture!r}")
  if types is not None and not config.type_vocab_size:
    raise ValueError("token_type_ids were given but the config has no token-type embeddings "
                     "(type_vocab_size=0)")
  for name, other in (("decoder_input_ids", decoder), ("token_type_ids", types)):
    # Multiple choice: (batch, choices, length).
    ndim = 3 if config.head == "multiple_choice" and tokens.ndim == 3 else 2
    if other is not None and (tokens.ndim != ndim or other.ndim != ndim
                              or other.shape[0] != tokens.shape[0]):
      raise ValueError(f"expected (batch, length) token arrays with one batch size, got "
                       f"{tokens.shape} and {name} {other.shape}")
  if types is not None and types.shape != tokens.shape:
    raise ValueError(f"token_type_ids {types.shape} must match input_ids {tokens.shape}")
  # fp32 end to end; 'highest' stops GPUs from using TF32 matmuls.
  with jax.default_matmul_precision("highest"):
    out = np.asarray(_jitted(config.replace(dtype="float32"), sentence)(
        params, tokens, decoder, types))
  return out[0] if single else out


def logits(config: ModelConfig, params: Params, input_ids=None, decoder_input_ids=None,
           token_type_ids=None, *, encoder_input_tokens=None,
           decoder_input_tokens=None) -> np.ndarray:
  """fp32 token logits of any family: (B, T, V) of an encoder-decoder for input_ids (B, S)
  and decoder_input_ids (B, T); (B, L, V) of a decoder-only LM or of an encoder's MLM head
  for input_ids (B, L) (token_type_ids (B, L) for models with token-type embeddings).

  No dropout, no padding mask from the tokens (as HF called without attention masks; for
  T5, 0 is both pad and decoder start); decoders are causal. 1-D inputs are a batch of one
  and give (T, V). encoder_input_tokens / decoder_input_tokens are the encoder-decoder's
  names (T5X's) for input_ids / decoder_input_ids.
  """
  input_ids = encoder_input_tokens if input_ids is None else input_ids
  decoder_input_ids = decoder_input_tokens if decoder_input_ids is None else decoder_input_ids
  if input_ids is None:
    raise ValueError("logits needs input_ids (or encoder_input_tokens)")
  return _run(config, params, input_ids, decoder_input_ids, token_type_ids, False)


def sentence_logits(config: ModelConfig, params: Params, input_ids,
                    token_type_ids=None) -> np.ndarray:
  """fp32 logits (B, sentence_classes) of an encoder-only model's sentence head (BERT's
  next-sentence, ALBERT's sentence-order prediction) over its pooled first token; the pooled
  states (B, D) when it has a pooler but no classifier."""
  if config.architecture != "encoder_only" or not config.pooler:
    raise ValueError("sentence_logits needs an encoder-only config with pooler=True")
  return _run(config, params, input_ids, None, token_type_ids, True)
