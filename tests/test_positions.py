"""Position encodings against HF's T5 bucketing and rotary/sinusoidal properties."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.models.positions import (add_position_bias, apply_rope, relative_position_bucket,
                                     sinusoidal_embedding)


@pytest.mark.parity
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (64, 256)])
def test_buckets_equal_hf(bidirectional, num_buckets, max_distance):
  import torch
  from transformers.models.t5.modeling_t5 import T5Attention
  offsets = np.arange(-400, 401, dtype=np.int32)
  ours = relative_position_bucket(jnp.asarray(offsets), bidirectional=bidirectional,
                                  num_buckets=num_buckets, max_distance=max_distance)
  hf = T5Attention._relative_position_bucket(torch.tensor(offsets, dtype=torch.long),
                                             bidirectional=bidirectional,
                                             num_buckets=num_buckets, max_distance=max_distance)
  np.testing.assert_array_equal(np.asarray(ours), hf.numpy())


def test_bucket_docstring_example():
  out = relative_position_bucket(jnp.array([-1, 0, 1, 200]), bidirectional=True,
                                 num_buckets=32, max_distance=128)
  np.testing.assert_array_equal(np.asarray(out), [1, 0, 17, 31])


def test_rope_scores_depend_only_on_the_offset():
  rng = np.random.RandomState(0)
  q, k = rng.randn(1, 1, 2, 16).astype(np.float32), rng.randn(1, 1, 2, 16).astype(np.float32)
  def score(pq, pk):
    rq = apply_rope(jnp.asarray(q), jnp.array([[pq]]), 10000.0)
    rk = apply_rope(jnp.asarray(k), jnp.array([[pk]]), 10000.0)
    return np.asarray(jnp.sum(rq * rk, axis=-1))
  np.testing.assert_allclose(score(3, 1), score(103, 101), rtol=1e-4, atol=1e-5)
  assert np.abs(score(3, 1) - score(3, 2)).max() > 1e-3
  np.testing.assert_allclose(score(0, 0), np.sum(q * k, axis=-1), rtol=1e-5)  # no rotation at 0


def test_sinusoidal_embedding_values():
  emb = np.asarray(sinusoidal_embedding(jnp.array([[0, 1]]), 6))
  assert emb.shape == (1, 2, 6)
  np.testing.assert_allclose(emb[0, 0], [0, 0, 0, 1, 1, 1], atol=1e-7)
  np.testing.assert_allclose(emb[0, 1, :3], np.sin([1.0, 0.01, 1e-4]), rtol=1e-5)


@pytest.mark.parametrize("rows,bias_heads,table_rows", [(8, 1, 1), (7, 1, 1), (3, 4, 1), (1, 1, 1),
                                                        (5, 1, 5)])
def test_position_bias_sum_and_its_gradients_equal_the_plain_sum(rows, bias_heads, table_rows):
  """The batch sum of the shared table's gradient is written as adds on CPU: the same order
  as XLA's reduction, so bitwise the same gradients; a per-row table (decoding) is as is."""
  rng = np.random.default_rng(rows)
  bias = jnp.asarray(rng.standard_normal((rows, bias_heads, 5, 6)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((table_rows, 4, 5, 6)), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((rows, 4, 5, 6)), jnp.float32)
  ours = lambda b, t: jnp.sum(jnp.tanh(add_position_bias(b, t)) * weights)
  plain = lambda b, t: jnp.sum(jnp.tanh(b + t) * weights)
  np.testing.assert_array_equal(add_position_bias(bias, table), bias + table)
  for got, expected in zip(jax.jit(jax.grad(ours, (0, 1)))(bias, table),
                           jax.jit(jax.grad(plain, (0, 1)))(bias, table)):
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_position_bias_gradient_is_a_reduction_in_programs_for_other_platforms():
  """A TPU or GPU program (e.g. `t5lite compile` on a CPU host) keeps the plain reduction,
  which a sharded batch turns into a local sum and one all-reduce."""
  grad = jax.grad(lambda t: jnp.sum(add_position_bias(jnp.zeros((8, 1, 4, 4)), t) ** 2))
  table = jnp.ones((1, 2, 4, 4))
  for platform, reduces in (("cpu", False), ("cuda", True)):
    text = jax.jit(grad).trace(table).lower(lowering_platforms=(platform,)).as_text()
    assert ("stablehlo.reduce" in text) == reduces, platform
