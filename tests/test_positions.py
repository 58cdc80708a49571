"""Position encodings against HF's T5 bucketing and rotary/sinusoidal properties."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny
from t5lite.models.positions import (RelativePositionBias, add_position_bias, apply_rope,
                                     relative_position_bucket, sinusoidal_embedding)


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


def _bias_and_table_gradient(bidirectional, query, key, offset, weights):
  config = tiny(num_heads=3, relative_attention_num_buckets=8, relative_attention_max_distance=12)
  module = RelativePositionBias(config, bidirectional)
  table = nn.meta.unbox(module.init(jax.random.key(0), query, key, offset))["params"][
      "rel_embedding"]
  bias_of = lambda table: module.apply({"params": {"rel_embedding": table}}, query, key, offset)
  grad = jax.jit(jax.grad(lambda table: jnp.sum(bias_of(table) * weights)))(table)
  return np.asarray(table), np.asarray(bias_of(table)), np.asarray(grad)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("offset", [0, 5, np.array([0, 3, 9])], ids=["none", "5", "per_row"])
def test_relative_bias_and_its_table_gradient_equal_a_numpy_rederivation(bidirectional, offset):
  """bias[b, h, q, k] = table[bucket(k - q - offset), h]; the table's gradient sums the bias
  gradient per (bucket, head) (on the CPU one scatter per head), for odd shapes (3 heads,
  7 queries, 11 keys) and per-row offsets (incremental decoding)."""
  query, key = 7, 11
  rows = np.ndim(offset) and len(offset)
  weights = np.random.default_rng(1).standard_normal((max(rows, 1), 3, query, key))
  table, bias, grad = _bias_and_table_gradient(bidirectional, query, key,
                                               jnp.asarray(offset, jnp.int32),
                                               jnp.asarray(weights, jnp.float32))
  offsets = np.broadcast_to(np.asarray(offset), (max(rows, 1),))
  expected_bias = np.zeros(bias.shape)
  expected_grad = np.zeros(table.shape)
  for row, shift in enumerate(offsets):
    relative = np.arange(key)[None, :] - (np.arange(query)[:, None] + shift)
    buckets = np.asarray(relative_position_bucket(
        jnp.asarray(relative), bidirectional=bidirectional, num_buckets=8, max_distance=12))
    expected_bias[row] = np.moveaxis(table[buckets], -1, 0)
    np.add.at(expected_grad, buckets.reshape(-1),
              weights[row].reshape(3, -1).T.astype(np.float32).astype(np.float64))
  np.testing.assert_array_equal(bias, expected_bias.astype(np.float32))
  np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_relative_bias_table_gradient_is_one_scatter_in_programs_for_other_platforms():
  """On the CPU the table's gradient is one flat scatter-add per head; a TPU or GPU program
  keeps the gather's own gradient, one scatter over the whole table."""
  config = tiny(num_heads=3)
  module = RelativePositionBias(config, True)
  table = nn.meta.unbox(module.init(jax.random.key(0), 5, 5))["params"]["rel_embedding"]
  grad = jax.grad(lambda t: jnp.sum(module.apply({"params": {"rel_embedding": t}}, 5, 5) ** 2))
  for platform, scatters in (("cpu", 3), ("cuda", 1)):
    text = jax.jit(grad).trace(table).lower(lowering_platforms=(platform,)).as_text()
    assert text.count('"stablehlo.scatter"') + text.count("stablehlo.scatter(") == scatters, (
        platform)
