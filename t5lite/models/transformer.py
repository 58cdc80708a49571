"""Transformer layers and stacks (pre-norm, T5 style), unrolled or scanned, with optional remat.

An Encoder stack attends bidirectionally within segments; a Decoder stack is causal (or
prefix-LM) and, in an encoder-decoder model, cross-attends to the encoder's output.

With cache_length > 0 a Decoder runs incrementally (t5lite.models.decoding): each call takes
the next tokens at their `positions`, self-attention keys/values live in a 'cache' variable
collection of cache_length slots, and cross-attention projects the encoder output once.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite.models.attention import (MultiHeadAttention, cache_mask, causal_mask, mask_to_bias,
                                     prefix_lm_mask, segment_mask)
from t5lite.models.config import ModelConfig
from t5lite.models.layers import BATCH_LENGTH_EMBED, Embed, Mlp, Norm, matmul_2d
from t5lite.models.positions import (LearnedPositionEmbedding, RelativePositionBias,
                                     sinusoidal_embedding)

CROSS_ATTENTION = "encoder_decoder_attention"
"""Name of a decoder layer's cross-attention module (and of its params)."""

REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class EncoderLayer(nn.Module):
  """Self-attention + MLP, each pre-normed with a residual. Also the decoder-only layer."""
  config: ModelConfig
  deterministic: bool = True
  cache_length: int = 0
  """> 0: incremental decoding with a self-attention cache of this many slots."""

  @nn.compact
  def __call__(self, x, bias, positions):
    cfg = self.config
    drop = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
    y = Norm(cfg, name="pre_attention_layer_norm")(x)
    y = MultiHeadAttention(cfg, self.deterministic, cache="self" if self.cache_length else None,
                           cache_length=self.cache_length, name="attention")(
                               y, y, bias, positions, positions)
    x = x + drop(y)
    y = Mlp(cfg, self.deterministic, name="mlp")(Norm(cfg, name="pre_mlp_layer_norm")(x))
    x = nn.with_logical_constraint(x + drop(y), BATCH_LENGTH_EMBED)
    return x, None  # (carry, per-layer output) as nn.scan expects


class DecoderLayer(nn.Module):
  """Causal self-attention, cross-attention to the encoder output, MLP."""
  config: ModelConfig
  deterministic: bool = True
  cache_length: int = 0
  """> 0: incremental decoding (self-attention cache, cross-attention K/V projected once)."""

  @nn.compact
  def __call__(self, x, self_bias, positions, encoded, cross_bias):
    cfg = self.config
    drop = lambda y: nn.Dropout(cfg.dropout_rate)(y, deterministic=self.deterministic)
    y = Norm(cfg, name="pre_self_attention_layer_norm")(x)
    decoding = self.cache_length > 0
    y = MultiHeadAttention(cfg, self.deterministic, cache="self" if decoding else None,
                           cache_length=self.cache_length, name="self_attention")(
                               y, y, self_bias, positions, positions)
    x = x + drop(y)
    y = Norm(cfg, name="pre_cross_attention_layer_norm")(x)
    # No rotary in cross-attention: query and key positions live in different sequences.
    y = MultiHeadAttention(cfg, self.deterministic, rotary=False,
                           cache="cross" if decoding else None,
                           name=CROSS_ATTENTION)(y, encoded, cross_bias)
    x = x + drop(y)
    y = Mlp(cfg, self.deterministic, name="mlp")(Norm(cfg, name="pre_mlp_layer_norm")(x))
    x = nn.with_logical_constraint(x + drop(y), BATCH_LENGTH_EMBED)
    return x, None


def run_layers(layer_cls: type[nn.Module], cfg: ModelConfig, deterministic: bool,
               num_layers: int, x: jax.Array, *args, cache_length: int = 0) -> jax.Array:
  """Applies num_layers layers to x: a Python loop (params layers_0..N-1) or one nn.scan
  (params under `layers`, stacked on a leading axis named 'layers'). Call inside a compact
  method: the layers become children of the calling module. cache_length > 0 (decoding)
  needs unscanned layers: decoding.py converts scanned params before it decodes."""
  if cache_length:
    if cfg.scan_layers:
      raise ValueError("incremental decoding runs unscanned layers (see unscan_params)")
    for i in range(num_layers):
      x, _ = layer_cls(cfg, deterministic, cache_length, name=f"layers_{i}")(x, *args)
    return x
  if cfg.remat_policy != "none":
    layer_cls = nn.remat(layer_cls, policy=REMAT_POLICIES[cfg.remat_policy],
                         prevent_cse=not cfg.scan_layers)  # scan already prevents CSE
  if cfg.scan_layers:
    scanned = nn.scan(layer_cls, variable_axes={"params": 0},
                      split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast,
                      length=num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = scanned(cfg, deterministic, name="layers")(x, *args)
    return x
  for i in range(num_layers):
    x, _ = layer_cls(cfg, deterministic, name=f"layers_{i}")(x, *args)
  return x


def default_positions(tokens: jax.Array) -> jax.Array:
  return jnp.broadcast_to(jnp.arange(tokens.shape[-1], dtype=jnp.int32), tokens.shape)


class _Stack(nn.Module):
  """Shared by Encoder and Decoder: embeddings, absolute positions, final norm."""
  config: ModelConfig
  embedder: Embed
  deterministic: bool = True
  cache_length: int = 0
  """Decoder only: > 0 runs it incrementally over a cache of this many positions."""

  def embed(self, tokens, positions):
    cfg = self.config
    x = self.embedder(tokens)  # (B, L, D)
    if cfg.position_encoding == "sinusoidal":
      x = x + sinusoidal_embedding(positions, cfg.d_model).astype(x.dtype)
    elif cfg.position_encoding == "learned":
      x = x + LearnedPositionEmbedding(cfg, name="position_embedder")(positions)
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=self.deterministic)
    return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)

  def finish(self, x, norm_name):
    x = Norm(self.config, name=norm_name)(x)
    return nn.Dropout(self.config.dropout_rate)(x, deterministic=self.deterministic)


class Encoder(_Stack):
  """tokens, segment ids, positions (B, L) -> normed hidden states (B, L, D)."""

  @nn.compact
  def __call__(self, tokens, segment_ids, positions):
    cfg = self.config
    x = self.embed(tokens, positions)
    bias = mask_to_bias(segment_mask(segment_ids, segment_ids))  # (B, 1, L, L)
    if cfg.position_encoding == "relative_bias":
      length = tokens.shape[1]
      bias = bias + RelativePositionBias(cfg, bidirectional=True, name="relpos_bias")(length, length)
    x = run_layers(EncoderLayer, cfg, self.deterministic, cfg.num_encoder_layers, x, bias, positions)
    return self.finish(x, "encoder_norm")


class Decoder(_Stack):
  """Causal (or prefix-LM) decoder; cross-attends when `encoded` is given. Returns logits."""

  @nn.compact
  def __call__(self, tokens, segment_ids, positions, encoded=None, encoder_segment_ids=None,
               causal_attention=None, logits_at=None):
    """logits_at (B,) int, optional: logits of only that position per row, (B, 1, V) (a
    decoding prefill needs just each prompt's last one)."""
    cfg = self.config
    length = tokens.shape[1]
    x = self.embed(tokens, positions)
    if self.cache_length:  # keys are cache slots; no packing while decoding
      self_bias = mask_to_bias(cache_mask(positions, self.cache_length, causal_attention))
      key_length, query_offset = self.cache_length, positions[:, 0]  # (B, 1, L, T), (B,)
    else:
      mask = causal_mask(length) if causal_attention is None else prefix_lm_mask(causal_attention)
      self_bias = mask_to_bias(mask & segment_mask(segment_ids, segment_ids))  # (B, 1, L, L)
      key_length, query_offset = length, 0
    if cfg.position_encoding == "relative_bias":
      self_bias = self_bias + RelativePositionBias(cfg, bidirectional=False, name="relpos_bias")(
          length, key_length, query_offset)
    layers = dict(cache_length=self.cache_length)
    if encoded is None:
      x = run_layers(EncoderLayer, cfg, self.deterministic, cfg.num_decoder_layers, x,
                     self_bias, positions, **layers)
    else:
      cross_bias = mask_to_bias(segment_mask(segment_ids, encoder_segment_ids))  # (B, 1, L, S)
      x = run_layers(DecoderLayer, cfg, self.deterministic, cfg.num_decoder_layers, x,
                     self_bias, positions, encoded, cross_bias, **layers)
    x = self.finish(x, "decoder_norm")
    if logits_at is not None:
      x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # (B, 1, D)
    return LogitsHead(cfg, self.embedder, name="logits_dense")(x)


class LogitsHead(nn.Module):
  """Final hidden states (B, L, D) -> float32 logits (B, L, V): tied (embedding.T) or its own
  kernel. The loss needs float32 logits; bf16 rounding of a 32k-way softmax costs ~0.02 nats.

  Used as name='logits_dense', so an untied kernel lives at .../logits_dense/kernel (D, V).
  """
  config: ModelConfig
  embedder: Embed

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    if cfg.scale_logits:
      x = x * cfg.d_model ** -0.5
    if cfg.tie_output_embedding:
      logits = self.embedder.attend(x)
    else:
      init = nn.with_logical_partitioning(nn.initializers.normal(cfg.d_model ** -0.5),
                                          ("embed", "vocab"))
      kernel = self.param("kernel", init, (cfg.d_model, cfg.vocab_size), cfg.storage_dtype)
      logits = matmul_2d(x.astype(cfg.compute_dtype), kernel.astype(cfg.compute_dtype), 1,
                         preferred_element_type=jnp.float32)  # (B, L, V)
    return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))
