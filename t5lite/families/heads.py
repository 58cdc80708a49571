"""Losses, metrics and predictions of the finetuning heads (ModelConfig.head), as HF computes
them, for the encoder-only and decoder-only families (which hand over to this module when
their config has a head).

  head / problem_type           loss (HF's)                                  'correct' counts
  sequence_classification
    single_label_classification cross entropy, mean over rows                argmax hits
    multi_label_classification  sigmoid cross entropy, mean over rows x labels  right labels / labels
    regression                  mean squared error over rows                 (none: 0)
  token_classification          cross entropy over labelled tokens (-100 ignored)  argmax hits
  question_answering            (start CE + end CE) / 2, mean over rows      exact (start, end)
  multiple_choice               cross entropy over the choices, mean over rows  argmax hits
  decoder + lm_loss_weight      task loss + lm_loss_weight x the LM's token mean (GPT-1)

Like every family's loss_fn, it returns sums: the loss summed over rows (tokens for tagging)
and `normalizer` = rows (tokens) with labels, so microbatches and eval batches add up. Rows
of padding (segment ids all 0, as the eval loop feeds to even out processes) weigh 0.
QA positions are taken as given (HF clamps out-of-range ones to an ignored index; the
converter refuses them instead).
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import optax

from t5lite.data.converters.heads import IGNORE, HeadFeatureConverter
from t5lite.families.base import token_loss_sums

Batch = Mapping[str, jax.Array]


def converter(config) -> HeadFeatureConverter:
  """The head's feature converter for this config (unpacked rows)."""
  return HeadFeatureConverter(config.head, config.num_labels, config.loss_problem_type,
                              decoder=config.architecture == "decoder_only",
                              lm_loss=bool(config.lm_loss_weight))


def row_weights(batch: Batch, prefix: str) -> jax.Array:
  """(B,) 1.0 for rows with any real token, 0.0 for rows of padding (eval's filler rows)."""
  segment_ids = batch[f"{prefix}_segment_ids"]
  real = jnp.any(segment_ids.reshape(segment_ids.shape[0], -1) > 0, axis=-1)  # (B,)
  return real.astype(jnp.float32)


def _nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Cross entropy of logits (..., C) at integer labels (...)."""
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  safe = jnp.clip(labels, 0, logits.shape[-1] - 1).astype(jnp.int32)
  return -jnp.take_along_axis(log_probs, safe[..., None], axis=-1)[..., 0]


def _hits(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


def _sums(loss_sum, count, correct) -> tuple[jax.Array, dict[str, jax.Array]]:
  return loss_sum, {"normalizer": count, "weight_sum": count, "correct": correct,
                    "z_loss": jnp.zeros((), jnp.float32)}


def loss_sums(config, logits, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """(loss sum, sums) of head logits on a batch; see the module docstring."""
  prefix = "decoder" if config.architecture == "decoder_only" else "encoder"
  rows = row_weights(batch, prefix)  # (B,)
  if config.head == "token_classification":
    labels = batch["token_labels"]  # (B, L)
    weights = (labels != IGNORE).astype(jnp.float32) * rows[:, None]
    return _sums(jnp.sum(_nll(logits, labels) * weights), jnp.sum(weights),
                 jnp.sum(_hits(logits, labels) * weights))
  if config.head == "question_answering":
    start, end = batch["start_positions"], batch["end_positions"]
    nll = (_nll(logits[..., 0], start) + _nll(logits[..., 1], end)) / 2  # (B,)
    hits = _hits(logits[..., 0], start) * _hits(logits[..., 1], end)
    return _sums(jnp.sum(nll * rows), jnp.sum(rows), jnp.sum(hits * rows))
  labels = batch["labels"]
  problem = config.loss_problem_type
  if problem == "regression":
    error = (logits[..., 0] - labels.astype(jnp.float32)) ** 2  # (B,)
    return _sums(jnp.sum(error * rows), jnp.sum(rows), jnp.zeros((), jnp.float32))
  if problem == "multi_label_classification":
    labels = labels.astype(jnp.float32)  # (B, C)
    per_label = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), labels)
    right = ((logits > 0) == (labels > 0.5)).astype(jnp.float32)
    return _sums(jnp.sum(jnp.mean(per_label, -1) * rows), jnp.sum(rows),
                 jnp.sum(jnp.mean(right, -1) * rows))
  return _sums(jnp.sum(_nll(logits, labels) * rows), jnp.sum(rows),
               jnp.sum(_hits(logits, labels) * rows))


def family_loss(family, params, batch: Batch, rng) -> tuple[jax.Array, dict[str, jax.Array]]:
  """A head family's loss_fn: the head's loss, plus GPT-1's auxiliary LM loss when
  config.lm_loss_weight > 0 (its token mean, scaled into this batch's sums)."""
  out = family.logits(params, batch, rng)
  config = family.config
  if not config.lm_loss_weight:
    return loss_sums(config, out, batch)
  classes, lm_logits = out
  loss_sum, sums = loss_sums(config, classes, batch)
  lm_sum, lm = token_loss_sums(lm_logits, batch["decoder_target_tokens"],
                               batch["decoder_loss_weights"], None, family.loss)
  scale = sums["normalizer"] / jnp.maximum(lm["weight_sum"], 1.0)
  loss_sum = loss_sum + config.lm_loss_weight * lm_sum * scale
  return loss_sum, dict(sums, lm_loss=lm_sum, lm_weight_sum=lm["weight_sum"])


def metrics(sums: Mapping[str, jax.Array], normalizer: jax.Array) -> dict[str, jax.Array]:
  """accuracy (per row; per token for tagging; per label for multi-label; exact spans for
  QA), and the auxiliary LM loss when there is one."""
  out = {"weight_sum": sums["weight_sum"],
         "accuracy": sums["correct"] / jnp.maximum(sums["weight_sum"], 1e-8)}
  if "lm_loss" in sums:
    out["lm_loss"] = sums["lm_loss"] / jnp.maximum(sums["lm_weight_sum"], 1e-8)
  return out


def head_logits(family, params, batch: Batch) -> jax.Array:
  """The head's logits on a batch (no dropout): what the evaluator postprocesses."""
  out = family.logits(params, batch, None)
  return out[0] if isinstance(out, tuple) else out
