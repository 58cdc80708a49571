"""The three model families: EncoderDecoder (T5), DecoderOnly (causal / prefix LM), EncoderOnly (MLM).

Inputs use T5X's feature names. Segment ids are 1-based per packed example, 0 = padding;
positions restart at 0 per segment. When segment ids are omitted, the encoder masks
padding (token id 0) as T5X does, and the decoder is causal only; pass all-ones segment
ids to get HF's behaviour without an attention mask.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from t5lite.models.config import ModelConfig
from t5lite.models.layers import ACTIVATION_FNS, Embed, Norm, dense
from t5lite.models.transformer import Decoder, Encoder, LogitsHead, default_positions


def _encoder_defaults(tokens, segment_ids, positions):
  """Missing encoder segment ids mask padding (token 0), as T5X does; positions 0..L-1."""
  segment_ids = (tokens > 0).astype(jnp.int32) if segment_ids is None else segment_ids
  return segment_ids, default_positions(tokens) if positions is None else positions


def _decoder_defaults(tokens, segment_ids, positions):
  """Missing decoder segment ids make one segment (causal masking covers padding)."""
  segment_ids = jnp.ones_like(tokens, dtype=jnp.int32) if segment_ids is None else segment_ids
  return segment_ids, default_positions(tokens) if positions is None else positions


class _Model(nn.Module):
  """Base of the three networks. Each says which batch features its __call__ takes (INPUTS,
  T5X's names) and the smallest inputs that fix every parameter shape (dummy_inputs: length
  1, since no parameter depends on the length)."""
  INPUTS = ()
  config: ModelConfig
  deterministic: bool = True
  """False enables dropout (then apply needs a 'dropout' rng)."""
  cache_length: int = 0
  """> 0: the decoder runs incrementally over a 'cache' collection of this many positions
  (t5lite.models.decoding); params are the same."""

  def _embedder(self) -> Embed:
    cfg = self.config
    return Embed(cfg.vocab_size, cfg.embedding_width, cfg.compute_dtype, cfg.storage_dtype,
                 cfg.init_std or 1.0)

  def _encode(self, tokens, segment_ids, positions, token_type_ids=None):
    return self.encoder(tokens, *_encoder_defaults(tokens, segment_ids, positions),
                        token_type_ids)


class EncoderDecoder(_Model):
  """T5: encoder over inputs, decoder over shifted targets. Returns logits (B, T, V)."""
  INPUTS = ("encoder_input_tokens", "decoder_input_tokens", "encoder_segment_ids",
            "decoder_segment_ids", "encoder_positions", "decoder_positions")

  @staticmethod
  def dummy_inputs(config):
    tokens = jnp.ones((1, 1), jnp.int32)
    return {"encoder_input_tokens": tokens, "decoder_input_tokens": tokens}

  def setup(self):
    self.token_embedder = self._embedder()
    self.encoder = Encoder(self.config, self.token_embedder, self.deterministic)
    self.decoder = Decoder(self.config, self.token_embedder, self.deterministic,
                           self.cache_length)

  def encode(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None):
    return self._encode(encoder_input_tokens, encoder_segment_ids, encoder_positions)

  def decode(self, encoded, encoder_segment_ids, decoder_input_tokens,
             decoder_segment_ids=None, decoder_positions=None):
    segment_ids, positions = _decoder_defaults(decoder_input_tokens, decoder_segment_ids,
                                               decoder_positions)
    return self.decoder(decoder_input_tokens, segment_ids, positions, encoded, encoder_segment_ids)

  def __call__(self, encoder_input_tokens, decoder_input_tokens, encoder_segment_ids=None,
               decoder_segment_ids=None, encoder_positions=None, decoder_positions=None):
    encoder_segment_ids, encoder_positions = _encoder_defaults(
        encoder_input_tokens, encoder_segment_ids, encoder_positions)
    encoded = self.encode(encoder_input_tokens, encoder_segment_ids, encoder_positions)
    return self.decode(encoded, encoder_segment_ids, decoder_input_tokens,
                       decoder_segment_ids, decoder_positions)


class DecoderOnly(_Model):
  """GPT-style LM; with config.prefix_lm, `decoder_causal_attention` (1 on the prefix)
  makes the prefix bidirectional. Returns logits (B, L, V), or (B, 1, V) at logits_at (B,)."""
  INPUTS = ("decoder_input_tokens", "decoder_segment_ids", "decoder_positions",
            "decoder_causal_attention")

  @staticmethod
  def dummy_inputs(config):
    tokens = jnp.ones((1, 1), jnp.int32)
    extra = {"decoder_causal_attention": tokens} if config.prefix_lm else {}
    return {"decoder_input_tokens": tokens, **extra}

  def setup(self):
    self.token_embedder = self._embedder()
    self.decoder = Decoder(self.config, self.token_embedder, self.deterministic,
                           self.cache_length)

  def __call__(self, decoder_input_tokens, decoder_segment_ids=None, decoder_positions=None,
               decoder_causal_attention=None, logits_at=None):
    # Decoding steps after a prefix-LM prompt are plain causal: no decoder_causal_attention.
    if self.config.prefix_lm and decoder_causal_attention is None and not self.cache_length:
      raise ValueError("a prefix_lm model needs decoder_causal_attention (1 on prefix positions)")
    if not self.config.prefix_lm and decoder_causal_attention is not None:
      raise ValueError("decoder_causal_attention was given but the config has prefix_lm=False")
    segment_ids, positions = _decoder_defaults(decoder_input_tokens, decoder_segment_ids,
                                               decoder_positions)
    return self.decoder(decoder_input_tokens, segment_ids, positions,
                        causal_attention=decoder_causal_attention, logits_at=logits_at)


class EncoderOnly(_Model):
  """BERT-style encoder with an MLM head (dense to the embedding width, the config's
  activation, norm, vocab projection with a bias when config.use_bias) and, optionally, a
  pooler (dense + tanh on the first token) with a sentence classifier (NSP / SOP)."""
  INPUTS = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions",
            "encoder_token_type_ids")

  @staticmethod
  def dummy_inputs(config):
    tokens = jnp.ones((1, 1), jnp.int32)
    return {"encoder_input_tokens": tokens,
            **({"encoder_token_type_ids": tokens} if config.type_vocab_size else {}),
            **({"with_sentence_logits": True} if config.pooler else {})}

  def setup(self):
    cfg = self.config
    self.token_embedder = self._embedder()
    self.encoder = Encoder(cfg, self.token_embedder, self.deterministic)
    e = cfg.embedding_width
    self.mlm_transform = dense(cfg, (cfg.d_model,), (e,), ("embed", "mlp"),
                               cfg.d_model ** -0.5, "mlm_transform")
    self.mlm_norm = Norm(cfg)
    self.logits_dense = LogitsHead(cfg, self.token_embedder, bias=cfg.use_bias)
    if cfg.pooler:
      d = cfg.d_model
      self.pooler = dense(cfg, (d,), (d,), ("embed", "mlp"), d ** -0.5, "pooler", use_bias=True)
    if cfg.sentence_classes:
      self.sentence_classifier = dense(cfg, (cfg.d_model,), (cfg.sentence_classes,),
                                       ("embed", "classes"), cfg.d_model ** -0.5,
                                       "sentence_classifier", use_bias=True)

  def __call__(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
               encoder_token_type_ids=None, with_sentence_logits=False):
    """MLM logits (B, L, V) in float32; with_sentence_logits: also the pooled output's
    (B, sentence_classes) float32 logits, or the pooled states (B, D) without a classifier."""
    x = self.hidden_states(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                           encoder_token_type_ids)  # (B, L, D)
    logits = self.mlm_logits(x)
    return (logits, self.sentence_logits(x)) if with_sentence_logits else logits

  def hidden_states(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
                    encoder_token_type_ids=None):
    """The encoder's final states (B, L, D), which the heads read."""
    return self._encode(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                        encoder_token_type_ids)

  def mlm_logits(self, x):
    """The MLM head on states (B, K, D) of any K positions: float32 logits (B, K, V)."""
    act = ACTIVATION_FNS[self.config.mlp_activation]
    return self.logits_dense(self.mlm_norm(act(self.mlm_transform(x))))

  def sentence_logits(self, x):
    """The pooler (and the sentence classifier) on the first token of states (B, L, D)."""
    cfg = self.config
    if not cfg.pooler:
      raise ValueError("with_sentence_logits needs a config with pooler=True")
    pooled = jnp.tanh(self.pooler(x[:, 0]))  # (B, D)
    if cfg.sentence_classes:
      pooled = self.sentence_classifier(pooled).astype(jnp.float32)  # (B, C)
    return pooled


MODEL_CLASSES = {
    "encoder_decoder": EncoderDecoder,
    "decoder_only": DecoderOnly,
    "encoder_only": EncoderOnly,
}

def make_model(config: ModelConfig, *, enable_dropout: bool = False,
               cache_length: int = 0) -> nn.Module:
  """The Flax module for a config; params depend on neither enable_dropout nor cache_length
  (> 0: incremental decoding with a key/value cache of that many positions)."""
  kwargs = dict(cache_length=cache_length) if cache_length else {}
  return MODEL_CLASSES[config.architecture](config, deterministic=not enable_dropout, **kwargs)
