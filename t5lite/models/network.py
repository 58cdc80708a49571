"""The three model families: EncoderDecoder (T5), DecoderOnly (causal / prefix LM), EncoderOnly (MLM).

Inputs use T5X's feature names. Segment ids are 1-based per packed example, 0 = padding;
positions restart at 0 per segment. When segment ids are omitted, the encoder masks
padding (token id 0) as T5X does, and the decoder is causal only; pass all-ones segment
ids to get HF's behaviour without an attention mask.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from t5lite.models import adapters, shared_stacks
from t5lite.models.config import ModelConfig
from t5lite.models.heads import (DecoderClassifier, EncoderHead, ReplacedTokenHead,
                                 SpanBoundaryHead, pool)
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
  (t5lite.models.decoding.search); params are the same."""

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
  makes the prefix bidirectional. Returns logits (B, L, V), or (B, 1, V) at logits_at (B,).
  With config.head='sequence_classification' it returns the classifier's logits (B, C) on
  each row's last real token, or (class logits, LM logits) when config.lm_loss_weight > 0."""
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
    if self.config.head:
      self.head = DecoderClassifier(self.config)

  def __call__(self, decoder_input_tokens, decoder_segment_ids=None, decoder_positions=None,
               decoder_causal_attention=None, logits_at=None, prefill=False):
    """prefill: a decoding prefill (cache_length > 0) whose prompt starts at position 0; prompt
    tuning's soft tokens go before it (t5lite.models.transformer.Decoder)."""
    # Decoding steps after a prefix-LM prompt are plain causal: no decoder_causal_attention.
    if self.config.prefix_lm and decoder_causal_attention is None and not self.cache_length:
      raise ValueError("a prefix_lm model needs decoder_causal_attention (1 on prefix positions)")
    if not self.config.prefix_lm and decoder_causal_attention is not None:
      raise ValueError("decoder_causal_attention was given but the config has prefix_lm=False")
    segment_ids, positions = _decoder_defaults(decoder_input_tokens, decoder_segment_ids,
                                               decoder_positions)
    if not self.config.head:
      return self.decoder(decoder_input_tokens, segment_ids, positions,
                          causal_attention=decoder_causal_attention, logits_at=logits_at,
                          prefill=prefill)
    output = "both" if self.config.lm_loss_weight else "states"
    out = self.decoder(decoder_input_tokens, segment_ids, positions,
                       causal_attention=decoder_causal_attention, output=output)
    logits, states = out if output == "both" else (None, out)
    classes = self.head(states, segment_ids)  # (B, C)
    return classes if logits is None else (classes, logits)


class EncoderOnly(_Model):
  """BERT-style encoder. Pretraining (config.head ''): an MLM head (dense to the embedding
  width, the config's activation, norm, vocab projection with a bias when config.use_bias),
  or ELECTRA's replaced-token head (config.electra), optionally a pooler (dense + tanh on the first token) with a sentence classifier (NSP /
  SOP) and SpanBERT's span boundary head. Finetuning (config.head set): the pooler when
  configured and the head (t5lite.models.heads.EncoderHead) instead of the MLM head; a
  multiple-choice batch has inputs (B, choices, L)."""
  INPUTS = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions",
            "encoder_token_type_ids")

  @staticmethod
  def dummy_inputs(config):
    tokens = jnp.ones((1, 1), jnp.int32)
    return {"encoder_input_tokens": tokens,
            **({"encoder_token_type_ids": tokens} if config.type_vocab_size else {}),
            **({"with_sentence_logits": True} if config.pooler and not config.head else {})}

  def setup(self):
    cfg = self.config
    self.token_embedder = self._embedder()
    self.encoder = Encoder(cfg, self.token_embedder, self.deterministic)
    if cfg.pooler:
      d = cfg.d_model
      self.pooler = dense(cfg, (d,), (d,), ("embed", "mlp"), d ** -0.5, "pooler", use_bias=True)
    if cfg.head:
      self.head = EncoderHead(cfg, self.deterministic)
      return
    if cfg.electra:
      self.discriminator_predictions = ReplacedTokenHead(cfg)
      return
    e = cfg.embedding_width
    self.mlm_transform = dense(cfg, (cfg.d_model,), (e,), ("embed", "mlp"),
                               cfg.d_model ** -0.5, "mlm_transform")
    self.mlm_norm = Norm(cfg)
    self.logits_dense = LogitsHead(cfg, self.token_embedder, bias=cfg.use_bias)
    if cfg.sentence_classes:
      self.sentence_classifier = dense(cfg, (cfg.d_model,), (cfg.sentence_classes,),
                                       ("embed", "classes"), cfg.d_model ** -0.5,
                                       "sentence_classifier", use_bias=True)
    if cfg.span_boundary:
      self.span_boundary = SpanBoundaryHead(cfg)

  def __call__(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
               encoder_token_type_ids=None, with_sentence_logits=False):
    """Pretraining: MLM logits (B, L, V) in float32; with_sentence_logits: also the pooled
    output's (B, sentence_classes) float32 logits, or the pooled states (B, D) without a
    classifier. ELECTRA's discriminator (config.electra): one float32 logit
    per token (B, L). Finetuning: the head's float32 logits (t5lite.models.heads)."""
    if self.config.head:
      return self.head_logits(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                              encoder_token_type_ids)
    x = self.hidden_states(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                           encoder_token_type_ids)  # (B, L, D)
    if self.config.electra:
      return self.discriminator_predictions(x)
    if self.is_initializing() and self.config.span_boundary:
      self.span_boundary_states(x, x, jnp.zeros(x.shape[:2], jnp.int32))
    logits = self.mlm_logits(x)
    return (logits, self.sentence_logits(x)) if with_sentence_logits else logits

  def head_logits(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
                  encoder_token_type_ids=None):
    """The finetuning head's float32 logits; multiple choice flattens (B, C, L) inputs to
    (B * C, L) rows and returns (B, C)."""
    inputs = (encoder_input_tokens, encoder_segment_ids, encoder_positions,
              encoder_token_type_ids)
    choices = self.config.head == "multiple_choice" and encoder_input_tokens.ndim == 3
    if choices:
      shape = encoder_input_tokens.shape  # (B, C, L)
      inputs = tuple(None if x is None else x.reshape(-1, shape[-1]) for x in inputs)
    # Under prompt tuning a classifier reads the first state, the soft prompt's (as peft's
    # inputs_embeds give HF's pooler); token and span heads read the tokens' states.
    full = self._encode(*inputs)  # (B', n + L, D)
    pooled = pool(self.config, self.pooler, full) if self.config.pooler else None
    per_token = self.config.head in ("token_classification", "question_answering")
    logits = self.head(full[:, adapters.prompt_tokens(self.config):] if per_token else full,
                       pooled)
    return logits.reshape(shape[:2]) if choices else logits

  def hidden_states(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None,
                    encoder_token_type_ids=None):
    """The encoder's final states (B, L, D) of the tokens (a soft prompt's left out)."""
    x = self._encode(encoder_input_tokens, encoder_segment_ids, encoder_positions,
                     encoder_token_type_ids)
    return x[:, adapters.prompt_tokens(self.config):]

  def mlm_logits(self, x):
    """The MLM head on states (B, K, D) of any K positions: float32 logits (B, K, V)."""
    act = ACTIVATION_FNS[self.config.mlp_activation]
    return self.logits_dense(self.mlm_norm(act(self.mlm_transform(x))))

  def span_boundary_states(self, left, right, offset):
    """SpanBERT's span boundary representation (B, K, D) of span tokens from the boundary
    states left / right (B, K, D) and their 1-based offsets in the span (B, K)."""
    return self.span_boundary(left, right, offset)

  def span_boundary_logits(self, left, right, offset):
    """The span boundary objective's float32 logits (B, K, V), through the MLM output
    projection (tied embeddings and bias), as SpanBERT shares its decoder."""
    return self.logits_dense(self.span_boundary_states(left, right, offset))

  def sentence_logits(self, x):
    """The pooler (and the sentence classifier) on the first token of states (B, L, D)."""
    cfg = self.config
    if not cfg.pooler:
      raise ValueError("with_sentence_logits needs a config with pooler=True")
    pooled = pool(cfg, self.pooler, x)  # (B, D)
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
  model_class = MODEL_CLASSES[config.architecture]
  if config.shared_encoder_decoder:
    model_class = _SharedEncoderDecoder
  return model_class(config, deterministic=not enable_dropout, **kwargs)


# The decoder's shared params are the encoder's, renamed on the way in (shared_stacks), and
# dropped on the way out of init. mutable=True, not init=True: with init=True Flax takes any
# call with a mutable collection (decoding's cache) for an init and skips the renaming.
_SharedEncoderDecoder = nn.map_variables(
    EncoderDecoder, "params", shared_stacks.tie, shared_stacks.untie, mutable=True,
    methods=["__call__", "encode", "decode"])
