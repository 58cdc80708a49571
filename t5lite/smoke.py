"""`t5lite smoke`: forward/backward steps of a gin-configured model on embedded text.

A quick check of any model file, without a task or a run config: it builds the model from
gin, tokenizes real English text that every Python install ships (standard library
docstrings and reference topics) as UTF-8 bytes (ByT5 layout: pad 0, eos 1, unk 2, byte b -> b + 3), takes a few
AdamW steps with the model's loss, and fails unless the loss falls. One objective per
family: encoder-decoder continues a text window, decoder-only models the window,
encoder-only fills in masked bytes.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5lite.data.stdlib_corpus import stdlib_documents
from t5lite.models import ModelConfig, init_params, make_model, model_inputs
from t5lite.models.losses import weighted_cross_entropy

BYTE_OFFSET = 3  # ids 0, 1, 2 are pad, eos, unk


def embedded_text() -> str:
  """The embedded corpus (t5lite.data.stdlib_corpus) as one text, documents by blank lines."""
  return "\n\n".join(d["text"] for d in stdlib_documents())


def make_batch(config: ModelConfig, tokens: np.ndarray, rng: np.random.Generator,
               batch_size: int, length: int) -> dict[str, np.ndarray]:
  """One batch in T5X feature names from random windows of 2*length byte tokens."""
  starts = rng.integers(0, len(tokens) - 2 * length, batch_size)
  windows = np.stack([tokens[s:s + 2 * length] for s in starts])  # (B, 2L)
  shift = lambda t: np.pad(t[:, :-1], ((0, 0), (1, 0)))  # BOS = 0
  if config.architecture == "encoder_decoder":
    inputs, targets = windows[:, :length], windows[:, length:]
    return {"encoder_input_tokens": inputs, "decoder_input_tokens": shift(targets),
            "decoder_target_tokens": targets, "decoder_loss_weights": np.ones_like(targets)}
  if config.architecture == "decoder_only":
    batch = {"decoder_input_tokens": shift(windows), "decoder_target_tokens": windows,
             "decoder_loss_weights": np.ones_like(windows)}
    if config.prefix_lm:  # the first half is the bidirectional prefix, loss on the rest
      prefix = np.zeros_like(windows)
      prefix[:, :length] = 1
      batch["decoder_causal_attention"] = prefix
      batch["decoder_loss_weights"] = 1 - prefix
    return batch
  masked = rng.random(windows.shape) < 0.15
  return {"encoder_input_tokens": np.where(masked, 2, windows), "mlm_target_tokens": windows,
          "mlm_loss_weights": masked.astype(np.int32)}


def _targets_and_weights(config: ModelConfig, batch):
  if config.architecture == "encoder_only":
    return batch["mlm_target_tokens"], batch["mlm_loss_weights"]
  return batch["decoder_target_tokens"], batch["decoder_loss_weights"]


def run(config: ModelConfig, *, steps: int = 30, batch_size: int = 8, length: int = 64,
        learning_rate: float = 3e-3, seed: int = 0, log=print) -> list[float]:
  """Takes `steps` AdamW steps; returns the per-step losses."""
  if config.vocab_size < 256 + BYTE_OFFSET:
    raise ValueError(f"smoke feeds bytes: vocab_size must be >= 259, got {config.vocab_size}")
  tokens = np.frombuffer(embedded_text().encode("utf-8"), np.uint8).astype(np.int32) + BYTE_OFFSET
  model = make_model(config, enable_dropout=True)
  optimizer = optax.adamw(learning_rate)
  params = init_params(config, seed)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch, rng):
    def loss_fn(p):
      logits = model.apply({"params": p}, **model_inputs(config, batch), rngs={"dropout": rng})
      targets, weights = _targets_and_weights(config, batch)
      return weighted_cross_entropy(logits, targets, weights)["loss"]
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  losses, start = [], time.time()
  log(f"smoke: {config.architecture} model, {sum(x.size for x in jax.tree_util.tree_leaves(params)):,}"
      f" params, {len(tokens):,} tokens of embedded text, batch {batch_size} x {length}")
  for i in range(steps):
    batch = {k: jnp.asarray(v) for k, v in make_batch(config, tokens, rng, batch_size, length).items()}
    params, opt_state, loss = step(params, opt_state, batch, jax.random.fold_in(jax.random.key(seed), i))
    losses.append(float(loss))
    if i % 5 == 0 or i == steps - 1:
      log(f"step {i + 1:4d}  loss {losses[-1]:.4f}  ({time.time() - start:.1f}s)")
  return losses
