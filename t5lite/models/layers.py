"""Building blocks: projections, embeddings, norms and MLPs, each parameter named by logical axes.

The model never names a mesh axis: partitioning rules map these logical names
(`embed`, `mlp`, `heads`, `kv`, `vocab`, ...) to mesh axes at the jit call site.
Initializers follow HF/Mesh-TF T5 (normal with fan-in scaled standard deviations).
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from t5lite.models.adapters import LORA_A, LORA_B, AdapterConfig, adapter_param
from t5lite.models.config import ModelConfig

# Activation axes used in constraints on activations.
BATCH_LENGTH_EMBED = ("batch", "length", "embed")
BATCH_LENGTH_MLP = ("batch", "length", "mlp")


def _gelu(x):
  # T5 v1.1 and HF's "gelu_new" use the tanh approximation.
  return jax.nn.gelu(x, approximate=True)


ACTIVATION_FNS = {
    "relu": jax.nn.relu,
    "gelu": _gelu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),  # BERT (HF's "gelu")
    "gated-gelu": _gelu,
    "swiglu": jax.nn.silu,
    "reglu": jax.nn.relu,
}


class Dense(nn.Module):
  """A linear map contracting the last len(in_shape) axes of x with a kernel (+ a bias).

  Example: in_shape=(512,), out_shape=(8, 64) maps x (B, L, 512) -> (B, L, 8, 64) with a
  (512, 8, 64) kernel whose axes are named e.g. ('embed', 'heads', 'kv'); use_bias adds an
  (8, 64) bias named by the output axes. An `adapter` that targets this Dense's path adds its
  LoRA branch (t5lite.models.adapters); its dropout runs when a 'dropout' rng is given.
  """
  in_shape: Sequence[int]
  out_shape: Sequence[int]
  axes: Sequence[str | None]
  stddev: float
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  use_bias: bool = False
  adapter: AdapterConfig | None = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape = tuple(self.in_shape) + tuple(self.out_shape)
    init = nn.with_logical_partitioning(nn.initializers.normal(self.stddev), tuple(self.axes))
    kernel = self.param("kernel", init, shape, self.param_dtype)
    # Named for remat policies that save some projections' outputs (transformer's
    # REMAT_POLICIES): the name is on the 2-D product, the layout a TPU saves it in cheaply.
    y = matmul_2d(x.astype(self.dtype), kernel.astype(self.dtype), len(self.in_shape),
                  name=self.name or "dense")
    if self.use_bias:
      out_axes = tuple(self.axes)[len(self.in_shape):]
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, out_axes),
                        tuple(self.out_shape), self.param_dtype)
      y = y + bias.astype(self.dtype)
    if self.adapter is not None and self.adapter.targets(self.path):
      y = y + self._lora(x).astype(y.dtype)
    return y

  def _lora(self, x: jax.Array) -> jax.Array:
    """s * B A dropout(x), in float32 (the adapters' dtype, as peft computes it). A and B may
    carry a leading row axis (one adapter per row of x, or per `copies` consecutive rows)."""
    adapter, n = self.adapter, len(self.in_shape)
    in_axes, out_axes = tuple(self.axes)[:n], tuple(self.axes)[n:]
    fan_in = math.prod(self.in_shape)
    bound = 1.0 / math.sqrt(fan_in)  # peft: kaiming_uniform(a=sqrt(5)) on A's (r, fan_in)
    a_init = lambda key, shape, dtype: jax.random.uniform(  # noqa: E731
        key, shape, dtype, -bound, bound)
    a = adapter_param(self, LORA_A, nn.with_logical_partitioning(a_init, in_axes + (None,)),
                      tuple(self.in_shape) + (adapter.r,))
    b = adapter_param(self, LORA_B, nn.with_logical_partitioning(nn.initializers.zeros,
                                                                  (None,) + out_axes),
                      (adapter.r,) + tuple(self.out_shape))
    x = x.astype(jnp.float32)
    if adapter.lora_dropout and self.has_rng("dropout"):
      x = nn.Dropout(adapter.lora_dropout, deterministic=False)(x)
    if a.ndim == n + 1:
      return matmul_2d(matmul_2d(x, a, n), b, 1) * adapter.scale
    rows = a.shape[0]  # one adapter per row: x (rows * copies, ..., in) -> (rows, -1, fan_in)
    xs = x.reshape(rows, -1, fan_in)
    h = jnp.einsum("bti,bir->btr", xs, a.reshape(rows, fan_in, adapter.r))
    y = jnp.einsum("btr,bro->bto", h, b.reshape(rows, adapter.r, -1))
    return y.reshape(*x.shape[:x.ndim - n], *self.out_shape) * adapter.scale


def dense(config: ModelConfig, in_shape: Sequence[int], out_shape: Sequence[int],
          axes: Sequence[str | None], stddev: float, name: str, *,
          use_bias: bool | None = None) -> Dense:
  """A Dense with the config's dtypes, bias setting (config.use_bias unless given) and
  initialization: `stddev` (T5's fan-in scaling), or config.init_std when that is set."""
  return Dense(tuple(in_shape), tuple(out_shape), tuple(axes),
               config.init_std or stddev, config.compute_dtype, config.storage_dtype,
               config.use_bias if use_bias is None else use_bias, config.adapter, name=name)


def matmul_2d(x: jax.Array, kernel: jax.Array, n: int, name: str | None = None,
              **dot_kwargs) -> jax.Array:
  """Contracts the last n axes of x with the first n of kernel, as ONE 2-D matrix product.

  (B, L, D) x (D, H, K) -> (B*L, D) @ (D, H*K) -> (B, L, H, K). The same numbers as the
  dot_general over the original axes, but the gradients are 2-D products too: the weight
  gradient x^T g contracts a single axis, which XLA:CPU's GEMM takes with transpose flags.
  Contracting (B, L) at once instead makes XLA:CPU materialize transposed copies of g, with
  the activation's backward recomputed inside the transposing loop: 2.6x slower MLP backward
  measured on the bench train config (T5 v1.1, d_model 256, 8 x 512 tokens).
  `name` names the 2-D product for remat policies (jax.ad_checkpoint.checkpoint_name); saved
  as (B*L, H*K), a TPU keeps it without the relayout that (B, L, H, 64) would need. dot_kwargs
  go to dot_general (e.g. preferred_element_type).
  """
  lead, in_shape, out_shape = x.shape[:x.ndim - n], kernel.shape[:n], kernel.shape[n:]
  matrix = (kernel.reshape(math.prod(in_shape), math.prod(out_shape)) if kernel.ndim == 2
            else _as_matrix(kernel, n, kernel.shape))
  y = jax.lax.dot_general(x.reshape(-1, math.prod(in_shape)), matrix,
                          (((1,), (0,)), ((), ())), **dot_kwargs)
  if name is not None:
    y = checkpoint_name(y, name)
  return y.reshape(*lead, *out_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _as_matrix(kernel: jax.Array, n: int, shape: tuple[int, ...]) -> jax.Array:
  """kernel (D, H, K) -> (D, H*K) (its first n axes as rows), whose gradient a TPU program
  computes as that 2-D matrix and reshapes after. Without the barrier XLA:TPU writes the
  weight gradient's matmul straight into the kernel's (D, H, 64) layout, whose 64-wide minor
  dim fills half of each 128-lane tile, at half the matrix unit's rate (T5's attention
  projections: 21% fewer estimated cycles for them with it, T5 1.1 xl on v5e). Other
  platforms reshape as before (free in a row-major layout)."""
  return kernel.reshape(math.prod(kernel.shape[:n]), -1)


def _as_matrix_fwd(kernel, n, shape):
  return _as_matrix(kernel, n, shape), None


def _as_matrix_bwd(n, shape, _, gradient):
  return (jax.lax.platform_dependent(
      gradient, tpu=lambda g: jax.lax.optimization_barrier(g).reshape(shape),
      default=lambda g: g.reshape(shape)),)


_as_matrix.defvjp(_as_matrix_fwd, _as_matrix_bwd)


class Embed(nn.Module):
  """Token embedding table (vocab, embed); `attend` is the tied output projection."""
  num_embeddings: int
  features: int
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  stddev: float = 1.0
  axes: tuple[str | None, str | None] = ("vocab", "embed")

  def setup(self):
    init = nn.with_logical_partitioning(nn.initializers.normal(self.stddev), self.axes)
    self.embedding = self.param("embedding", init, (self.num_embeddings, self.features),
                                self.param_dtype)

  def __call__(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)  # (B, L, D)

  def attend(self, x: jax.Array) -> jax.Array:
    """Tied output projection; logits accumulate and stay in float32 even for bf16 inputs."""
    return matmul_2d(x.astype(self.dtype), self.embedding.astype(self.dtype).T, 1,
                     preferred_element_type=jnp.float32)  # (B, L, V)


class Norm(nn.Module):
  """RMS norm (T5: scale only, no mean subtraction) or LayerNorm (scale and bias), in float32."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    features = (x.shape[-1],)
    x = x.astype(jnp.float32)
    if cfg.norm == "layer":
      x = x - jnp.mean(x, axis=-1, keepdims=True)
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + cfg.layer_norm_epsilon)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                       features, cfg.storage_dtype)
    x = x * scale.astype(jnp.float32)
    if cfg.norm == "layer":
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                        features, cfg.storage_dtype)
      x = x + bias.astype(jnp.float32)
    return x.astype(cfg.compute_dtype)


class Mlp(nn.Module):
  """Position-wise MLP: wo(act(wi(x))) or, gated, wo(act(wi_0(x)) * wi_1(x))."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    d, f = cfg.d_model, cfg.d_ff
    act = ACTIVATION_FNS[cfg.mlp_activation]
    if cfg.gated_mlp:
      h = act(dense(cfg, (d,), (f,), ("embed", "mlp"), d ** -0.5, "wi_0")(x))
      h = h * dense(cfg, (d,), (f,), ("embed", "mlp"), d ** -0.5, "wi_1")(x)
    else:
      h = act(dense(cfg, (d,), (f,), ("embed", "mlp"), d ** -0.5, "wi")(x))
    h = nn.with_logical_constraint(h, BATCH_LENGTH_MLP)  # (B, L, F)
    h = nn.Dropout(cfg.dropout_rate)(h, deterministic=self.deterministic)
    return dense(cfg, (f,), (d,), ("mlp", "embed"), f ** -0.5, "wo")(h)  # (B, L, D)
