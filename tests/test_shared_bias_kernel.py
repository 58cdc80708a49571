"""t5lite's Pallas TPU kernel for attention with a bias shared by the batch
(t5lite.models.kernels.shared_bias), run by Pallas's TPU interpreter on CPU: forward and the
gradients of query, key, value and the position table against XLA's path on the dense bias
the stacks build (attention.SegmentBias.dense), on odd lengths on and off the kernel's
128-blocks, packed rows, padding-only rows, causal and bidirectional, with and without a
table. Its use by whole models is in test_attention_kernels; its TPU compile and cost in
test_compile."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5lite.models import attention_kernels
from t5lite.models.kernels import shared_bias
from t5lite.models.attention import SegmentBias

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the TPU interpreter")


def _segments(rng, batch, length):
  """Rows of packed segments 1, 2, ... with trailing padding (0); the last row all padding."""
  rows = np.zeros((batch, length), np.int32)
  for row in range(batch - 1):
    cuts = np.sort(rng.choice(np.arange(1, length), size=2, replace=False))
    rows[row, :cuts[0]] = 1
    rows[row, cuts[0]:cuts[1]] = 2
  return rows


def _kernel(query, key, value, bias):
  """The kernel on t5lite's (B, L, heads, D) layout: heads side by side, grouped key and
  value heads repeated (as the attention layer does)."""
  heads = query.shape[2]
  flat = lambda t: attention_kernels.every_head(t, heads).reshape(t.shape[:2] + (-1,))  # noqa: E731
  out = attention_kernels.segment_attention(flat(query), flat(key), flat(value), bias, heads)
  return out.reshape(query.shape)


def _relative(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# (batch, queries, keys, heads, key/value heads, head dim, causal, table)
SHAPES = [(3, 37, 53, 2, 2, 16, False, True),   # cross-attention: lengths off the blocks
          (2, 130, 130, 3, 3, 8, True, True),   # causal, one past a block, T5's table
          (2, 128, 128, 2, 1, 32, True, False),  # causal on the block, grouped heads
          (3, 20, 200, 2, 2, 64, False, False),  # few queries over many keys, no table
          (2, 45, 45, 4, 4, 64, False, True),  # T5's head dim: two heads per grid step
          (2, 24, 24, 2, 1, 128, True, True)]  # a head of 128 lanes per step, grouped


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) +
                         ("-causal" if s[6] else "") + ("-table" if s[7] else ""))
def test_kernel_equals_xla_on_the_dense_bias(shape):
  from jax.experimental.pallas import tpu as pltpu
  batch, q_len, k_len, heads, kv_heads, dim, causal, has_table = shape
  rng = np.random.RandomState(sum(shape[:6]))
  keys = jax.random.split(jax.random.key(sum(shape[:6])), 5)
  query = jax.random.normal(keys[0], (batch, q_len, heads, dim))
  key, value = (jax.random.normal(k, (batch, k_len, kv_heads, dim)) for k in keys[1:3])
  table = jax.random.normal(keys[3], (1, heads, q_len, k_len)) if has_table else None
  query_segments = _segments(rng, batch, q_len)
  key_segments = query_segments if q_len == k_len else _segments(rng, batch, k_len)
  weights = jax.random.normal(keys[4], (batch, q_len, heads, dim))

  def loss(attend):
    def projected(query, key, value, table):
      bias = SegmentBias(query_segments, key_segments, table, causal)
      return jnp.sum(attend(query, key, value, bias) * weights)
    argnums = (0, 1, 2, 3) if has_table else (0, 1, 2)
    return jax.jit(jax.value_and_grad(projected, argnums=argnums))(query, key, value, table)

  with pltpu.force_tpu_interpret_mode():
    got, got_grads = loss(_kernel)
  want, want_grads = loss(lambda q, k, v, bias: attention_kernels.reference_attention(
      q, k, v, bias.dense()))
  assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
  for name, g, w in zip(("query", "key", "value", "table"), got_grads, want_grads):
    assert _relative(g, w) < 1e-5, name
    assert np.isfinite(np.asarray(g)).all(), name


def test_padding_rows_spread_their_weight_over_real_keys_as_xla_does():
  """A row of padding (segment 0) sees no key: like XLA's softmax of the dense bias, it
  averages the real keys' values, never the kernel's padded ones."""
  from jax.experimental.pallas import tpu as pltpu
  value = jnp.arange(1.0, 6.0)[None, :, None, None] * jnp.ones((1, 5, 1, 8))
  segments = jnp.zeros((1, 5), jnp.int32)
  with pltpu.force_tpu_interpret_mode():
    out = _kernel(jnp.ones((1, 5, 1, 8)), value, value, SegmentBias(segments, segments))
  np.testing.assert_allclose(np.asarray(out), 3.0, rtol=1e-6)  # the mean of 1..5


@pytest.mark.parametrize("queries, keys, refused", [(512, 512, False), (114, 512, False),
                                                    (513, 512, True), (1024, 1024, True)])
def test_lengths_above_one_block_are_refused_with_the_reason(queries, keys, refused):
  query = jnp.zeros((1, queries, 2, 64), jnp.bfloat16)
  key = jnp.zeros((1, keys, 2, 64), jnp.bfloat16)
  reason = attention_kernels.segment_refusal(query, key)
  assert (reason is not None) == refused
  if refused:
    assert f"queries {queries} x keys {keys}" in reason


def test_the_cost_counts_the_matrix_units_tiles_and_the_table_once_per_head():
  """What XLA's step-time estimate charges one call: flops with the head dim rounded up to
  the 128-wide tiles, one exponential per score, and bytes with the (H, Q, K) table once
  (read forward; read and its gradient written backward), not once per row."""
  cost = lambda backward: shared_bias._cost(  # noqa: E731
      (16, 32, 64), 512, 512, 2, has_table=True, backward=backward)
  forward, backward = cost(False), cost(True)
  scores = 16 * 32 * 512 * 512
  assert forward.flops == 2 * 2 * scores * 128 and backward.flops == 5 * 2 * scores * 128
  assert forward.transcendentals == backward.transcendentals == scores
  per_tensor = 16 * 32 * 512 * 64 * 2
  ids = 4 * 16 * 1024  # the two segment-id vectors, int32
  assert forward.bytes_accessed == 4 * per_tensor + 32 * 512 * 512 * 4 + ids
  assert backward.bytes_accessed == 7 * per_tensor + 2 * 32 * 512 * 512 * 4 + ids


@pytest.mark.parametrize("heads, dim, per_block", [(32, 64, 2), (4, 128, 1), (8, 256, 1),
                                                   (3, 64, 3), (4, 8, 4), (12, 96, 12)])
def test_a_grid_step_takes_whole_128_lane_blocks_of_heads(heads, dim, per_block):
  assert shared_bias.heads_per_block(heads, dim) == per_block
