"""Position encodings against HF's T5 bucketing and rotary/sinusoidal properties."""
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.models.positions import apply_rope, relative_position_bucket, sinusoidal_embedding


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
