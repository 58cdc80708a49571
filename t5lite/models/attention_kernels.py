"""Which kernel computes attention's core, softmax(query . key + bias) . value, chosen per
model by ModelConfig.attention_implementation:

  'xla'    two einsums around a float32 softmax, on every backend. The (B, H, Q, K) scores
           are written to device memory and read back (XLA does not fuse a matmul, a
           softmax and a matmul into one kernel).
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
  'auto'   'cudnn' where it can run (a CUDA GPU, 16-bit compute), else 'xla': CPU, TPU,
           float32, and `t5lite compile` from a CPU host.

Numbers: the fused kernel rounds the bias to the compute dtype and accumulates its softmax in
float32, as the XLA path does; outputs and gradients agree with XLA's to bfloat16 rounding
(docs/models.md, "Attention implementations"). jax.nn.dot_product_attention does the fused
call; this module only decides when, because jax's own default (implementation=None) always
takes XLA's path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from t5lite.errors import ConfigError

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
  """'xla' or 'cudnn' for a model's attention_implementation on this process's backend."""
  if choice == "xla":
    return "xla"
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
  return jax.nn.dot_product_attention(query, key.astype(dtype), value.astype(dtype), bias=bias,
                                      scale=1.0, implementation=implementation)
