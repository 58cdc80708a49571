"""A Pallas TPU attention kernel for a bias shared by the batch: T5's relative-position table
(1, H, Q, K), with the padding, packed-segment and causal masks computed inside the kernel
from segment ids instead of read from memory.

    out = attend(q, k, v, query_segments, key_segments, table, causal=True, heads=32)

(q, k, v: (B, L, heads x head dim), the heads side by side as the projections write them.)

Why a kernel of our own: jax's TPU flash attention (jax.experimental.pallas.ops.tpu) takes
a bias only as a whole (B, H, Q, K) float32 array and returns its gradient that size, so a
T5 step with it still reads and writes score-sized tensors in every layer (537 MB each way
per T5 1.1 xl layer at 16 rows per chip), the traffic a fused kernel exists to remove; and
splash attention takes masks but no bias. Here:

  - the grid is (head blocks, batch) with the batch innermost, and each step holds the heads
    of one 128-lane block (two of T5's 64-wide heads) of one row with their whole query and
    key lengths in VMEM (no online softmax: T5's lengths fit). The table's block index does
    not change along the batch, so Pallas fetches each head's (Q, K) table once, not once
    per row;
  - the backward kernel recomputes the softmax (no residual beyond the inputs) and
    accumulates the table's gradient over the batch in its output block, written once per
    head: H x Q x K x 4 bytes, not B times that;
  - masks cost two int32 vectors per row; a padded key sits below every masked one, so a
    row whose keys are all masked spreads its weight over its real keys, as XLA's softmax
    of the dense bias does.

Lengths are padded to multiples of 128 (the TPU's lane width) and cut after; the whole
(Q, K) block must fit in VMEM, so calls above MAX_SCORES elements are refused
(`segment_refusal`; the caller then takes the dense-bias kernel). Each pallas_call carries
its cost (flops, exponentials, bytes) so XLA's step-time estimate (`t5lite compile`) counts
the kernel, which XLA cannot see into. On CPU the kernel runs in Pallas's TPU interpreter
(the tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# The additive bias of a masked pair (every attention path's): large enough to zero a softmax
# weight, small enough to stay finite in float32 sums.
MASK_VALUE = -1e10
LANES = 128
# One (Q, K) float32 score block is 1 MiB here; the backward kernel holds about eight such
# buffers a head (scores, probabilities, their gradients, the table double-buffered, its
# gradient), about 16 MiB for a block of two heads: inside the limit below, which every TPU
# generation's VMEM holds.
MAX_SCORES = 512 * 512
VMEM_LIMIT = 48 * 1024 * 1024


def _pallas():
  """jax's Pallas and its TPU backend, imported on first use: at module level they would add
  about 0.1 s to every t5lite import (every CLI start) for TPU programs and tests only."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu
  return pl, pltpu


def padded(length: int) -> int:
  return -(-length // LANES) * LANES


def segment_refusal(query_length: int, key_length: int) -> str | None:
  """Why these lengths do not fit the kernel's one-block-per-row design (None: they do)."""
  if padded(query_length) * padded(key_length) > MAX_SCORES:
    return (f"queries {query_length} x keys {key_length} above the shared-bias kernel's "
            f"{MAX_SCORES} scores per block")
  return None


def _dot(a, b, contract):
  """a . b over dims `contract` (a_dim, b_dim), float32 accumulation (the MXU's)."""
  return jax.lax.dot_general(a, b, ((contract[:1], contract[1:]), ((), ())),
                             preferred_element_type=jnp.float32)


def _logits(q, k, table, q_seg, k_seg, *, causal: bool, key_length: int):
  """(Q, D) . (K, D) + mask bias (+ table): the float32 logits of one head of one row, the
  same sum as XLA's path (the mask's bias plus the table, added to the scores)."""
  s = _dot(q, k, (1, 1))
  mask = (q_seg == k_seg) & (k_seg > 0)  # (Q, 1) against (1, K)
  cols = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
  if causal:
    mask = mask & (cols <= jax.lax.broadcasted_iota(jnp.int32, s.shape, 0))
  bias = jnp.where(mask, 0.0, MASK_VALUE)
  if table is not None:
    bias = bias + table
  return s + jnp.where(cols < key_length, bias, 2 * MASK_VALUE)


def _softmax(logits):
  weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  return weights / jnp.sum(weights, axis=-1, keepdims=True)


def _forward_kernel(*refs, causal, key_length, has_table, dim):
  q_ref, k_ref, v_ref, qs_ref, ks_ref = refs[:5]
  out_ref = refs[-1]
  for head in range(q_ref.shape[-1] // dim):  # the block's heads, side by side in its lanes
    lanes = slice(head * dim, (head + 1) * dim)
    table = refs[5][0, head] if has_table else None
    probs = _softmax(_logits(q_ref[0, :, lanes], k_ref[0, :, lanes], table, qs_ref[0],
                             ks_ref[0], causal=causal, key_length=key_length))
    value = v_ref[0, :, lanes]
    out_ref[0, :, lanes] = _dot(probs.astype(value.dtype), value, (1, 0)).astype(out_ref.dtype)


def _backward_kernel(*refs, causal, key_length, has_table, dim):
  q_ref, k_ref, v_ref, qs_ref, ks_ref = refs[:5]
  do_ref, dq_ref, dk_ref, dv_ref = refs[5 + has_table:9 + has_table]
  if has_table:  # summed over the batch, the grid's innermost axis, in the resident block
    dtable_ref, (pl, _) = refs[-1], _pallas()

    @pl.when(pl.program_id(1) == 0)
    def _():
      dtable_ref[...] = jnp.zeros_like(dtable_ref)

  for head in range(q_ref.shape[-1] // dim):
    lanes = slice(head * dim, (head + 1) * dim)
    q, k, v, do = (ref[0, :, lanes] for ref in (q_ref, k_ref, v_ref, do_ref))
    table = refs[5][0, head] if has_table else None
    probs = _softmax(_logits(q, k, table, qs_ref[0], ks_ref[0], causal=causal,
                             key_length=key_length))
    dv_ref[0, :, lanes] = _dot(probs.astype(v.dtype), do, (0, 0)).astype(dv_ref.dtype)
    d_weights = _dot(do, v, (1, 1))
    d_logits = probs * (d_weights - jnp.sum(probs * d_weights, axis=-1, keepdims=True))
    dq_ref[0, :, lanes] = _dot(d_logits.astype(q.dtype), k, (1, 0)).astype(dq_ref.dtype)
    dk_ref[0, :, lanes] = _dot(d_logits.astype(q.dtype), q, (0, 0)).astype(dk_ref.dtype)
    if has_table:
      dtable_ref[0, head] += d_logits


def heads_per_block(heads: int, dim: int) -> int:
  """How many heads one grid step takes: its block of q, k and v is (length, heads x dim)
  of the (B, L, H x D) arrays, and the TPU reads blocks whose lane width is a multiple of
  128 (or the whole row): one head of 128 or more, 128 / dim heads of a smaller dim (two of
  T5's 64), all heads where those do not tile the row."""
  if dim % LANES == 0:
    return 1
  if LANES % dim == 0 and heads % (LANES // dim) == 0:
    return LANES // dim
  return heads


def _specs(batch_heads_dim, q_len, k_len, has_table):
  """Block specs of q, k, v, the two segment-id arrays and the table on the (head blocks,
  batch) grid: some heads of one row, whole lengths; the table's block follows the heads."""
  pl, _ = _pallas()
  _, heads, dim = batch_heads_dim
  width = heads_per_block(heads, dim)
  q_spec = pl.BlockSpec((1, q_len, width * dim), lambda h, b: (b, 0, h))
  k_spec = pl.BlockSpec((1, k_len, width * dim), lambda h, b: (b, 0, h))
  specs = [q_spec, k_spec, k_spec,
           pl.BlockSpec((1, q_len, 1), lambda h, b: (b, 0, 0)),
           pl.BlockSpec((1, 1, k_len), lambda h, b: (b, 0, 0))]
  if has_table:
    specs.append(pl.BlockSpec((1, width, q_len, k_len), lambda h, b: (0, h, 0, 0)))
  return specs


def _cost(batch_heads_dim, q_len, k_len, itemsize, *, has_table: bool, backward: bool):
  """flops, exponentials and HBM bytes of one call: what XLA's estimate charges the kernel.
  Every matmul here has the head dim as one of its sides, and the TPU's matrix units work in
  tiles of 128: a head dim of 64 leaves half of each idle, so the flops are counted with
  the head dim rounded up to 128 (the unit's time, not only the useful work)."""
  batch, heads, dim = batch_heads_dim
  matmuls = 5 if backward else 2  # forward: scores, weights . values; backward adds three
  pl, _ = _pallas()
  per_tensor = batch * heads * dim * itemsize
  tensors = (q_len * (3 if backward else 2) + k_len * (4 if backward else 2)) * per_tensor
  table_bytes = heads * q_len * k_len * 4 * (2 if backward else 1) if has_table else 0
  return pl.CostEstimate(flops=2 * matmuls * batch * heads * q_len * k_len * padded(dim),
                         transcendentals=batch * heads * q_len * k_len,
                         bytes_accessed=tensors + table_bytes + 4 * batch * (q_len + k_len))


def _params(table):
  """Both grid axes parallel, but the batch's in order where a table's gradient is summed
  along it (the backward kernel with a table)."""
  _, pltpu = _pallas()
  return pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel" if table is None else "arbitrary"),
      vmem_limit_bytes=VMEM_LIMIT)


def _forward(q, k, v, q_seg, k_seg, table, causal, key_length, heads):
  has_table, (pl, _) = table is not None, _pallas()
  shape = (q.shape[0], heads, q.shape[2] // heads)
  kernel = functools.partial(_forward_kernel, causal=causal, key_length=key_length,
                             has_table=has_table, dim=shape[2])
  specs = _specs(shape, q.shape[1], k.shape[1], has_table)
  return pl.pallas_call(
      kernel, grid=(heads // heads_per_block(*shape[1:]), q.shape[0]), in_specs=specs,
      out_specs=specs[0], out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(None), name="segment_attention_fwd",
      cost_estimate=_cost(shape, q.shape[1], k.shape[1], q.dtype.itemsize,
                          has_table=has_table, backward=False),
  )(q, k, v, q_seg, k_seg, *((table,) if has_table else ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attend(q, k, v, q_seg, k_seg, table, causal, key_length, heads):
  return _forward(q, k, v, q_seg, k_seg, table, causal, key_length, heads)


def _attend_fwd(q, k, v, q_seg, k_seg, table, causal, key_length, heads):
  return (_forward(q, k, v, q_seg, k_seg, table, causal, key_length, heads),
          (q, k, v, q_seg, k_seg, table))


def _attend_bwd(causal, key_length, heads, residuals, d_out):
  q, k, v, q_seg, k_seg, table = residuals
  has_table, (pl, _) = table is not None, _pallas()
  shape = (q.shape[0], heads, q.shape[2] // heads)
  kernel = functools.partial(_backward_kernel, causal=causal, key_length=key_length,
                             has_table=has_table, dim=shape[2])
  specs = _specs(shape, q.shape[1], k.shape[1], has_table)
  out_specs = specs[:3] + specs[5:]  # dq, dk, dv (and the table's gradient) as their inputs
  out_shape = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (q, k, v)]
  if has_table:
    out_shape.append(jax.ShapeDtypeStruct(table.shape, jnp.float32))
  grads = pl.pallas_call(
      kernel, grid=(heads // heads_per_block(*shape[1:]), q.shape[0]),
      in_specs=specs + specs[:1], out_specs=out_specs, out_shape=out_shape,
      compiler_params=_params(table), name="segment_attention_bwd",
      cost_estimate=_cost(shape, q.shape[1], k.shape[1], q.dtype.itemsize,
                          has_table=has_table, backward=True),
  )(q, k, v, q_seg, k_seg, *((table,) if has_table else ()), d_out)
  return grads[0], grads[1], grads[2], None, None, grads[3] if has_table else None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _pad_to(t, axis, length, value=0):
  widths = [(0, 0)] * t.ndim
  widths[axis] = (0, length - t.shape[axis])
  return jnp.pad(t, widths, constant_values=value)


def attend(q, k, v, q_seg, k_seg, table, *, causal: bool, heads: int):
  """The kernel on queries (B, Q, H x D) and keys and values (B, K, H x D), the heads side by
  side, with (B, Q), (B, K) segment ids and a (1, H, Q, K) table or None -> (B, Q, H x D).
  Lengths are padded to 128 and cut after."""
  q_len, k_len = q.shape[1], k.shape[1]
  q_pad, k_pad = padded(q_len), padded(k_len)
  q, k, v = _pad_to(q, 1, q_pad), _pad_to(k, 1, k_pad), _pad_to(v, 1, k_pad)
  # Padded queries see nothing (segment -1 matches no key): their rows are cut off after.
  q_seg = _pad_to(q_seg.astype(jnp.int32), 1, q_pad, -1)[:, :, None]
  k_seg = _pad_to(k_seg.astype(jnp.int32), 1, k_pad)[:, None, :]
  if table is not None:
    table = _pad_to(_pad_to(table.astype(jnp.float32), 2, q_pad), 3, k_pad)
  return _attend(q, k, v, q_seg, k_seg, table, causal, k_len, heads)[:, :q_len]
