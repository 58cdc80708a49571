"""Which kernel computes attention's core, softmax(query . key + bias) . value, chosen per
model by ModelConfig.attention_implementation:

  'xla'    two einsums around a float32 softmax, on every backend. The (B, H, Q, K) scores
           are written to device memory and read back (XLA does not fuse a matmul, a
           softmax and a matmul into one kernel); without dropout the softmax and second
           einsum are kernels/softmax_values.py (fewer passes over the scores on the CPU).
  'cudnn'  cuDNN's fused (flash) attention through jax.nn.dot_product_attention: the scores
           stay on chip. Needs a CUDA GPU and bfloat16 / float16 compute (refused otherwise,
           with the fix). T5's relative-position bias, padding, packed-segment, causal and
           prefix-LM masks all reach it as the one additive bias, in the compute dtype; the
           bias's gradient (T5's trained table) comes back from cuDNN's backward kernel.
           A call cuDNN cannot take runs the XLA path instead (`cudnn_refusal` names why):
           an odd query or key length (cuDNN's kernels with a bias need even lengths: a
           decoding step's single query, prefix tuning's extra keys), attention dropout while
           training (jax.nn.dot_product_attention has none), a head dim cuDNN does not take,
           and distillation reading the pre-softmax scores.
  'pallas' Pallas kernels for TPU. The program takes them where it runs on a TPU
           (jax.lax.platform_dependent: also a TPU program that `t5lite compile` builds on
           a CPU host) and XLA's path elsewhere; under a mesh they run per shard of batch
           and heads (shard_map), as the logical axis rules place them. A same-segment,
           optionally causal mask with T5's shared position table or none (every family's
           training pattern: the stacks pass it as an attention.SegmentBias) goes to
           t5lite's own kernel (kernels/shared_bias.py: masks built on chip, the table read once
           per head, its gradient summed over the batch in the kernel), for lengths up to
           512 x 512; any other bias (prefix LM, prompt tuning, longer rows) to jax's flash
           kernel (jax.experimental.pallas.ops.tpu: blocks of 128, the bias as one float32
           (B, H, Q, K) array and its gradient returned whole). Refused per call like cuDNN:
           dropout, the scores read, and a single query (a decoding step).
  'auto'   'cudnn' where it can run (a CUDA GPU, 16-bit compute), else 'xla': CPU, float32,
           and, until the Pallas kernels are measured on TPU hardware, TPU too.

Numbers: both kernels accumulate the softmax in float32, as the XLA path does; cuDNN rounds
the bias to the compute dtype (Pallas keeps it in float32), so its outputs and gradients agree
with XLA's to bfloat16's rounding (docs/models.md, "Attention implementations"). jax.nn.dot_product_attention does the fused
call; this module only decides when, because jax's own default (implementation=None) always
takes XLA's path.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5lite.errors import ConfigError
from t5lite.models.kernels import shared_bias
from t5lite.models.kernels.shared_bias import MASK_VALUE

FUSED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cuda_capability() -> tuple[int, int] | None:
  """The first device's CUDA compute capability, None off CUDA GPUs (CPU, TPU, ROCm)."""
  if jax.default_backend() != "gpu":
    return None
  capability = getattr(jax.devices()[0], "compute_capability", None)
  if not capability:
    return None
  major, minor = capability.split(".")[:2]
  return int(major), int(minor)


def resolve(choice: str, compute_dtype) -> str:
  """'xla', 'cudnn' or 'pallas' for a model's attention_implementation on this process's
  backend ('pallas' chooses per platform inside the program: `platform_attention`)."""
  if choice in ("xla", "pallas"):
    return choice
  fused = _cuda_capability() is not None and jnp.dtype(compute_dtype) in FUSED_DTYPES
  if choice == "cudnn" and not fused:
    where = (f"backend {jax.default_backend()}" if _cuda_capability() is None
             else f"dtype {jnp.dtype(compute_dtype).name}")
    raise ConfigError(f"attention_implementation='cudnn' needs a CUDA GPU and bfloat16 or "
                      f"float16 compute; this run has {where}: use 'auto' (cuDNN where it "
                      "runs, XLA elsewhere) or 'xla'")
  return "cudnn" if fused else "xla"


def cudnn_refusal(query: jax.Array, key: jax.Array, *, dropout: bool,
                  reads_scores: bool) -> str | None:
  """Why cuDNN cannot take this call (None: it can). query (B, Q, H, D), key (B, K, kvH, D)."""
  if reads_scores:
    return "the pre-softmax scores are read (distillation)"
  if dropout:
    return "attention dropout while training"
  if query.shape[1] % 2 or key.shape[1] % 2:
    return f"odd lengths (queries {query.shape[1]}, keys {key.shape[1]})"
  head_dim, capability = query.shape[-1], _cuda_capability() or (0, 0)
  largest = 256 if capability >= (9, 0) else 128
  if head_dim % 8 or head_dim > largest:
    return f"head dim {head_dim} (cuDNN: a multiple of 8 up to {largest})"
  return None


def fused_attention(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array,
                    implementation: str = "cudnn") -> jax.Array:
  """cuDNN's fused attention: query (B, Q, H, D), key and value (B, K, kvH, D) with H a
  multiple of kvH (grouped heads are read as they are, not repeated), bias (B|1, H|1, Q, K)
  added to the unscaled logits (a family's 1/sqrt(D) is already in the query). -> (B, Q, H, D).
  implementation='xla' runs jax's reference of the same call (the CPU tests of this wiring)."""
  dtype = query.dtype
  # float16 cannot hold the mask value (-1e10 would round to -inf, and a row of -inf is NaN);
  # cuDNN's own masks use -2**15 there. bfloat16 holds it.
  floor = -2.0 ** 15 if dtype == jnp.float16 else float(jnp.finfo(jnp.float32).min) / 2
  bias = jnp.maximum(bias, floor).astype(dtype)
  if bias.shape[1] == 1 and query.shape[2] > 1:
    # A bias shared over the batch was seen to run on an H100/H200; one shared over heads (a
    # mask without a position bias) was not, so it goes in per head.
    bias = jnp.broadcast_to(bias, (bias.shape[0], query.shape[2]) + bias.shape[2:])
  return jax.nn.dot_product_attention(query, key.astype(dtype), value.astype(dtype), bias=bias,
                                      scale=1.0, implementation=implementation)


PALLAS_BLOCK = 128  # the kernel's key blocks are multiples of this (its lane width)


def pallas_refusal(query: jax.Array, key: jax.Array, *, dropout: bool,
                   reads_scores: bool) -> str | None:
  """Why the Pallas kernel does not take this call (None: it does)."""
  del key  # any key length: padded to the kernel's blocks
  if reads_scores:
    return "the pre-softmax scores are read (distillation)"
  if dropout:
    return "attention dropout while training"
  if query.shape[1] == 1:
    return "a single query (a decoding step)"
  return None


def every_head(states: jax.Array, heads: int) -> jax.Array:
  """Grouped keys or values (B, K, kvH, D) -> (B, K, heads, D): head j reads group j // (heads
  / kvH), HF's repeat_kv order. Unchanged when they have every head already."""
  groups = states.shape[2]
  return states if groups == heads else jnp.repeat(states, heads // groups, axis=2)


def attention_logits(query: jax.Array, key: jax.Array, bias: jax.Array) -> jax.Array:
  """query (B, Q, H, D) . key (B, K, kvH, D) + bias -> (B, H, Q, K) float32 logits."""
  key = every_head(key, query.shape[2])
  return jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) + bias


def weighted_values(weights: jax.Array, value: jax.Array) -> jax.Array:
  """weights (B, H, Q, K) . value (B, K, kvH, D) -> (B, Q, H, D)."""
  return jnp.einsum("bhqk,bkhd->bqhd", weights, every_head(value, weights.shape[1]))


def reference_attention(query, key, value, bias):
  """XLA's path without dropout: softmax(query . key + bias) . value in float32, the output in
  the query's dtype; key and value may have fewer (grouped) heads."""
  weights = jax.nn.softmax(attention_logits(query, key, bias), axis=-1).astype(query.dtype)
  return weighted_values(weights, value)


def _padded(length: int, multiple: int) -> int:
  return -(-length // multiple) * multiple


def pallas_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                     bias: jax.Array) -> jax.Array:
  """Pallas's TPU flash attention on t5lite's layout: query (B, Q, H, D), key and value
  (B, K, kvH, D), bias (B|1, H|1, Q, K) added to unscaled logits -> (B, Q, H, D).

  The kernel's key blocks are multiples of 128 and its query blocks of 8: keys are padded to
  a multiple of 128 (their bias columns below any mask), queries to a multiple of 8 up to 128
  and of 128 beyond (their rows cut off after), so any lengths run. Under an active mesh
  (partitioning.activate) it runs per shard of batch and heads."""
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
  heads, length = query.shape[2], query.shape[1]
  key, value = every_head(key, heads), every_head(value, heads)
  q, k, v = (jnp.swapaxes(t, 1, 2) for t in (query, key, value))  # (B, H, L, D)
  ab = jnp.broadcast_to(bias.astype(jnp.float32), q.shape[:3] + (k.shape[2],))
  q_len = _padded(length, 8) if length <= PALLAS_BLOCK else _padded(length, PALLAS_BLOCK)
  k_len = _padded(k.shape[2], PALLAS_BLOCK)
  pad = lambda t, axis, to, value=0.0: jnp.pad(  # noqa: E731
      t, [(0, to - t.shape[axis]) if i == axis else (0, 0) for i in range(t.ndim)],
      constant_values=value)
  q = pad(q, 2, q_len)
  k, v = pad(k, 2, k_len), pad(v, 2, k_len)
  # Padded keys below every real key's bias, masked ones too: a row whose keys are all
  # masked (a padding row) still spreads its weight over its real keys, as XLA's softmax does.
  ab = pad(pad(ab, 3, k_len, 2 * MASK_VALUE), 2, q_len)
  bq, bk = min(q_len, PALLAS_BLOCK), PALLAS_BLOCK
  blocks = tpu_flash.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
                                block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk,
                                block_q_dkv=bq, block_k_major_dq=bk, block_k_dq=bk,
                                block_q_dq=bq)

  def attend(q, k, v, ab):
    return tpu_flash.flash_attention(q, k, v, ab=ab, sm_scale=1.0, block_sizes=blocks)

  attend = _per_shard(attend, [HEADS_FIRST] * 4)
  return jnp.swapaxes(attend(q, k, v, ab), 1, 2)[:, :length]


HEADS_FIRST = ("batch", "heads", None, None)  # (B, H, L, D): lengths and dims whole


def _per_shard(attend, logical_axes):
  """`attend` per shard of batch and heads under an active mesh (partitioning.activate), as
  the logical axis rules place them; itself without one. Its output is laid out as its
  first input."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return attend
  specs = tuple(nn.logical_to_mesh_axes(axes) for axes in logical_axes)
  return jax.shard_map(attend, in_specs=specs, out_specs=specs[0], check_vma=False)


def platform_attention(query, key, value, bias):
  """The Pallas kernel in a program that runs on a TPU, `reference_attention` elsewhere."""
  return jax.lax.platform_dependent(query, key, value, bias, tpu=pallas_attention,
                                    default=reference_attention)


def segment_refusal(query: jax.Array, key: jax.Array) -> str | None:
  """Why the shared-bias kernel does not take these lengths (None: it does)."""
  return shared_bias.segment_refusal(query.shape[1], key.shape[1])


def segment_attention(query, key, value, bias, heads: int):
  """t5lite's own Pallas TPU kernel (kernels/shared_bias.py) for a SegmentBias: the mask from
  its segment ids on chip, its position table read once per head and its gradient summed
  over the batch in the kernel. query (B, Q, H x D), key and value (B, K, H x D): heads side
  by side -> (B, Q, H x D)."""
  has_table = bias.table is not None

  def attend(q, k, v, query_segments, key_segments, *table):
    return shared_bias.attend(q, k, v, query_segments, key_segments,
                              table[0] if table else None, causal=bias.causal,
                              heads=q.shape[-1] // (query.shape[-1] // heads))

  rows = ("batch", None, "heads")  # (B, L, H x D): a shard holds whole heads
  axes = [rows] * 3 + [("batch", None)] * 2 + [(None, "heads", None, None)] * has_table
  table = (bias.table,) if has_table else ()
  return _per_shard(attend, axes)(query, key, value, bias.query_segments, bias.key_segments,
                                  *table)


def platform_segment_attention(query, key, value, bias, heads: int):
  """`segment_attention` in a program that runs on a TPU; elsewhere XLA's path on the dense
  bias. query (B, Q, H x D), key and value (B, K, H x D) -> (B, Q, H x D)."""
  def reference(q, k, v, bias):
    split = lambda t: t.reshape(t.shape[:2] + (heads, -1))  # noqa: E731
    out = reference_attention(split(q), split(k), split(v), bias.dense())
    return out.reshape(out.shape[:2] + (-1,))

  return jax.lax.platform_dependent(
      query, key, value, bias, tpu=functools.partial(segment_attention, heads=heads),
      default=reference)
