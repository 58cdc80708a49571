"""The XLA path's attention core (t5lite/models/kernels/softmax_values.py) against a float64
numpy re-derivation of softmax(logits) . value and its gradients, on odd shapes, masked keys
and a fully masked row, for the CPU's factored program and the other platforms' plain one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.models.attention_kernels import MASK_VALUE
from t5lite.models.kernels import softmax_values as module

SHAPES = [(3, 2, 7, 13, 5), (2, 4, 1, 9, 8), (1, 3, 16, 16, 4)]  # (B, H, Q, K, D)


def _inputs(shape, seed=0):
  b, h, q, k, d = shape
  rng = np.random.default_rng(seed)
  logits = rng.normal(scale=3.0, size=(b, h, q, k))
  logits[..., k // 2] = MASK_VALUE  # a masked key in every row
  logits[0, 0, 0, :] = MASK_VALUE  # a row with every key masked: uniform weights
  return logits, rng.normal(size=(b, k, h, d)), rng.normal(size=(b, q, h, d))


def _numpy_reference(logits, value, d_out):
  """(out, d_logits, d_value) in float64: p = softmax(s), o = p . v, dp = do . v^T,
  ds = p * (dp - sum_k(p * dp))."""
  exps = np.exp(logits - logits.max(-1, keepdims=True))
  weights = exps / exps.sum(-1, keepdims=True)
  out = np.einsum("bhqk,bkhd->bqhd", weights, value)
  d_weights = np.einsum("bqhd,bkhd->bhqk", d_out, value)
  d_logits = weights * (d_weights - (weights * d_weights).sum(-1, keepdims=True))
  return out, d_logits, np.einsum("bhqk,bqhd->bkhd", weights, d_out)


def _ours(logits, value, d_out, dtype=jnp.float32):
  # A new function each call: jit's cache must not serve one branch's program for the other.
  out, vjp = jax.vjp(jax.jit(lambda *args: module.softmax_values(*args)),
                     jnp.asarray(logits, jnp.float32), jnp.asarray(value, dtype))
  d_logits, d_value = vjp(jnp.asarray(d_out, dtype))
  return [np.asarray(x, np.float64) for x in (out, d_logits, d_value)]


@pytest.fixture(params=["cpu", "other platforms"])
def branch(request, monkeypatch):
  """On the CPU by default; 'other platforms' takes platform_dependent's default branch (what
  a GPU or TPU program computes) on the CPU."""
  if request.param != "cpu":
    monkeypatch.setattr(module, "platform_dependent",
                        lambda *args, cpu, default: default(*args))
  return request.param


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_equal_the_float64_re_derivation(shape, branch):
  logits, value, d_out = _inputs(shape)
  for ours, expected, name in zip(_ours(logits, value, d_out), _numpy_reference(
      logits, value, d_out), ("out", "d_logits", "d_value")):
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=2e-5 * np.abs(expected).max(),
                               err_msg=f"{name} ({branch})")


def test_bfloat16_values_agree_to_bfloat16_rounding(branch):
  logits, value, d_out = _inputs((2, 3, 11, 17, 8), seed=1)
  for ours, expected in zip(_ours(logits, value, d_out, jnp.bfloat16),
                            _numpy_reference(logits, value, d_out)):
    np.testing.assert_allclose(ours, expected, rtol=0, atol=2e-2 * np.abs(expected).max())


def test_the_cpu_program_reduces_the_weights_only_in_the_forward():
  """The softmax's max and sum: two reductions over (B, H, Q, K) arrays in the CPU program,
  where autodiff's backward adds a third."""
  logits, value, d_out = _inputs((3, 2, 7, 13, 5))
  def loss(logits, value):
    return jnp.sum(module.softmax_values(logits, value) * d_out)
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
      jnp.asarray(logits, jnp.float32), jnp.asarray(value, jnp.float32)).as_text()
  reduces = [line for line in text.splitlines()
             if "stablehlo.reduce" in line and "tensor<3x2x7x13xf32>" in line]
  assert len(reduces) == 2, reduces
