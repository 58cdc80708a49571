"""softmax(logits) . value with fewer passes over the weights: the XLA path's attention core
on the CPU.

The (B, H, Q, K) weights and their gradient are the attention's largest arrays (32 MiB a
layer for 8 rows of 512 tokens and 4 heads), and on the CPU each pass over them costs about as
much as a matmul. Autodiff of `softmax(s) . v` makes two passes that are not needed:

- the forward divides every exponential by its row's sum; dividing the (B, Q, H, D) output
  instead gives the same product (`(e / z) . v = (e . v) / z`), and the backward folds 1 / z
  into the output's gradient the same way;
- the backward's row sum `sum_k(p * dp)` reads the weights and their gradient once more;
  FlashAttention's identity gives it from the output, `sum_k(p * dp) = sum_d(o * do)`, K / D
  times less to read (8x for 512 keys of 64-wide heads).

XLA does not find either rewrite, and jax has no such core (jax.nn.dot_product_attention's
XLA path is plain autodiff), hence this custom gradient. In T5's train step on a 2-core AMD
EPYC it made the step about 3% faster (docs/cpu.md). Programs for other platforms (a TPU
program compiled on a CPU host too) keep autodiff's softmax, chosen with
jax.lax.platform_dependent, so their memory and cost figures stay as measured (on a TPU the
custom gradient changes what the backward keeps: a v5e preset's step took 11.7 GiB a chip
instead of 12.9; unmeasured beyond that). The two agree to float32 rounding
(tests/test_softmax_values.py), not bitwise.

Attention dropout drops the normalized weights, so the layer calls this only without it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Module-level so that a test can take the other platforms' branch on the CPU.
platform_dependent = jax.lax.platform_dependent


def softmax_values(logits: jax.Array, value: jax.Array) -> jax.Array:
  """softmax(logits, axis=-1) in float32, then . value in value's dtype: logits (B, H, Q, K),
  value (B, K, H, D) -> (B, Q, H, D). The factored core on the CPU, autodiff's elsewhere."""
  return platform_dependent(logits, value, cpu=_fewer_passes, default=_autodiff)


def _autodiff(logits, value):
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(value.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, value)


@jax.custom_vjp
def _fewer_passes(logits, value):
  return _forward(logits, value)[0]


def _forward(logits, value):
  """(e . v) / z with e = exp(s - max): the exponentials are kept undivided."""
  logits = logits.astype(jnp.float32)
  exps = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  inverse_sums = jnp.swapaxes(1.0 / jnp.sum(exps, axis=-1, keepdims=True), 1, 2)  # (B, Q, H, 1)
  out = (jnp.einsum("bhqk,bkhd->bqhd", exps.astype(value.dtype), value,
                    preferred_element_type=jnp.float32) * inverse_sums).astype(value.dtype)
  return out, (exps, inverse_sums, value, out)


def _backward(residuals, d_out):
  exps, inverse_sums, value, out = residuals  # the weights are exps * inverse_sums
  d_scaled = d_out.astype(jnp.float32) * inverse_sums  # (B, Q, H, D)
  d_value = jnp.einsum("bhqk,bqhd->bkhd", exps.astype(value.dtype),
                       d_scaled.astype(value.dtype))
  # The weights' gradient over the row's sum, d_out . value^T / z, less its row sum
  # sum_k(weights * d_weights) / z taken from the output.
  d_exps = jnp.einsum("bqhd,bkhd->bhqk", d_scaled.astype(value.dtype), value,
                      preferred_element_type=jnp.float32)
  row_sums = jnp.einsum("bqhd,bqhd->bhq", d_scaled, out.astype(jnp.float32))[..., None]
  return exps * (d_exps - row_sums), d_value


_fewer_passes.defvjp(_forward, _backward)
