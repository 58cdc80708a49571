"""Finetuning heads and SpanBERT's span boundary head: small modules on a stack's final states.

Each is HF's head of the same name, parameter for parameter (t5lite.interop.hf.* maps them):

  head (ModelConfig.head)   reads                         params (under the model's `head/`)
  sequence_classification   pooler(first token)           classifier            BertFor..., AlbertFor...
                            first token, no pooler        dense, classifier     RobertaClassificationHead
                            last real token (decoder)     score (no bias)       GPT2For...(GPT-1's too)
  token_classification      every token                   classifier            *ForTokenClassification
  question_answering        every token                   qa_outputs (2: start, end)
  multiple_choice           pooler(first token) per choice  classifier (1)      *ForMultipleChoice

Dropout sits where HF puts it (classifier_dropout, else dropout_rate): before the classifier
(and, in RoBERTa's head, before its dense too); QA heads have none. The pooler (dense + tanh
over the first token, BERT's) is the model's own `pooler` param, shared with pretraining, so a
finetuned model starts from the pretrained one.

    states (B, L, D) --EncoderHead--> (B, C) | (B, L, C) | (B, L, 2)
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite.models.config import ModelConfig
from t5lite.models.layers import ACTIVATION_FNS, Embed, Norm, dense


def classifier_dropout_rate(config: ModelConfig) -> float:
  return config.dropout_rate if config.classifier_dropout is None else config.classifier_dropout


def pool(config: ModelConfig, pooler: nn.Module, states: jax.Array) -> jax.Array:
  """BERT's pooler: dense + tanh over the first token's state. (B, L, D) -> (B, D)."""
  del config
  return jnp.tanh(pooler(states[:, 0]))


class EncoderHead(nn.Module):
  """The finetuning head of an encoder (ModelConfig.head); float32 logits."""
  config: ModelConfig
  deterministic: bool = True

  def _drop(self, x):
    return nn.Dropout(classifier_dropout_rate(self.config))(x, deterministic=self.deterministic)

  def _dense(self, out: int, name: str, axes=("embed", "classes")):
    d = self.config.d_model
    return dense(self.config, (d,), (out,), axes, d ** -0.5, name, use_bias=True)

  @nn.compact
  def __call__(self, states: jax.Array, pooled: jax.Array | None) -> jax.Array:
    """states (B, L, D); pooled (B, D) from the model's pooler, or None without one."""
    cfg = self.config
    if cfg.head == "question_answering":
      return self._dense(2, "qa_outputs")(states).astype(jnp.float32)  # (B, L, 2)
    if cfg.head == "token_classification":
      return self._dense(cfg.num_labels, "classifier")(self._drop(states)).astype(jnp.float32)
    if cfg.head == "multiple_choice":
      return self._dense(1, "classifier")(self._drop(pooled))[:, 0].astype(jnp.float32)
    # sequence_classification
    if pooled is not None:
      return self._dense(cfg.num_labels, "classifier")(self._drop(pooled)).astype(jnp.float32)
    # RoBERTa's head: dropout, dense, tanh, dropout, out projection on the first token
    # (ELECTRA's: GELU for tanh).
    x = self._drop(states[:, 0])
    act = (jnp.tanh if cfg.classifier_activation == "tanh"
           else ACTIVATION_FNS[cfg.classifier_activation])
    x = act(self._dense(cfg.d_model, "dense", ("embed", "mlp"))(x))
    return self._dense(cfg.num_labels, "classifier")(self._drop(x)).astype(jnp.float32)


def last_real_token(segment_ids: jax.Array) -> jax.Array:
  """Index of each row's last non-padding position, (B, L) -> (B,): the token a decoder's
  classifier reads (GPT-2's last non-pad token; GPT-1's [EXTRACT], which ends the input).
  A row of padding only gives 0. Example: [[1, 1, 1, 0]] -> [2]."""
  positions = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
  return jnp.max(jnp.where(segment_ids > 0, positions, 0), axis=-1)


class DecoderClassifier(nn.Module):
  """GPT2ForSequenceClassification's `score` (no bias) on the last real token's state."""
  config: ModelConfig

  @nn.compact
  def __call__(self, states: jax.Array, segment_ids: jax.Array) -> jax.Array:
    cfg = self.config
    last = last_real_token(segment_ids)  # (B,)
    x = jnp.take_along_axis(states, last[:, None, None], axis=1)[:, 0]  # (B, D)
    score = dense(cfg, (cfg.d_model,), (cfg.num_labels,), ("embed", "classes"),
                  cfg.d_model ** -0.5, "score", use_bias=False)
    return score(x).astype(jnp.float32)  # (B, C)


class ReplacedTokenHead(nn.Module):
  """ELECTRA's discriminator head (HF ElectraDiscriminatorPredictions): dense, the config's
  activation, dense to one float32 logit per token, > 0 meaning "replaced". (B, L, D) -> (B, L)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, states: jax.Array) -> jax.Array:
    cfg = self.config
    d = cfg.d_model
    x = dense(cfg, (d,), (d,), ("embed", "mlp"), d ** -0.5, "dense", use_bias=True)(states)
    x = ACTIVATION_FNS[cfg.mlp_activation](x)
    logit = dense(cfg, (d,), (1,), ("mlp", None), d ** -0.5, "dense_prediction",
                  use_bias=True)(x)
    return logit[..., 0].astype(jnp.float32)


class SpanBoundaryHead(nn.Module):
  """SpanBERT's span boundary objective: each masked span token's representation from the
  states just outside its span and its 1-based position in the span,

      h = Norm(GELU(W2 Norm(GELU(W1 [x_{s-1}; x_{e+1}; p_i]))))      (B, K, D)

  which the model's MLM output projection (tied embeddings + bias) turns into logits. The
  position embedding has width d_model (the paper's is a free choice). Offsets are 1-based;
  0 (outside any span) reads row 0, whose result carries no loss weight."""
  config: ModelConfig

  @nn.compact
  def __call__(self, left: jax.Array, right: jax.Array, offset: jax.Array) -> jax.Array:
    cfg = self.config
    d = cfg.d_model
    longest = cfg.span_boundary.max_span_length
    table = Embed(longest + 1, d, cfg.compute_dtype, cfg.storage_dtype,
                  cfg.init_std or 1.0, (None, "embed"), name="position_embedder")
    offset = jnp.clip(offset, 0, longest)
    x = jnp.concatenate([left, right, table(offset).astype(left.dtype)], axis=-1)  # (B, K, 3D)
    act = ACTIVATION_FNS["gelu_exact"]
    x = dense(cfg, (3 * d,), (d,), (None, "mlp"), (3 * d) ** -0.5, "dense_0", use_bias=True)(x)
    x = Norm(cfg, name="norm_0")(act(x))
    x = dense(cfg, (d,), (d,), ("embed", "mlp"), d ** -0.5, "dense_1", use_bias=True)(x)
    return Norm(cfg, name="norm_1")(act(x))
