"""Attention implementations (t5lite.models.attention_kernels): the choice, the fallbacks, and
forward + gradients of the fused paths against the XLA path for every attention pattern
(relative bias, learned / rotary positions, grouped heads, causal, prefix LM, packed and
padded rows, a row of padding only).

cuDNN: on CPU the fused path's wiring (layout, grouped heads, the bias in the compute dtype,
scale 1) runs through jax.nn.dot_product_attention's own XLA reference, since cuDNN needs a
GPU; on a CUDA GPU (JAX_PLATFORMS=cuda) the same comparisons run cuDNN's kernel itself, in
bfloat16. Pallas: the TPU kernel itself runs on CPU in Pallas's TPU interpreter (padding to
its blocks, the bias and its gradient), and its shard_map under a mesh with jax's reference
in its place."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny
from t5lite.errors import ConfigError
from t5lite.models import attention_kernels, init_params, make_model
from t5lite.models.decoding import search as decoding

ON_GPU = jax.default_backend() == "gpu"

VARIANTS = {
    "t5_relative_bias": tiny(),
    "t5_v1_0": tiny(mlp_activation="relu", tie_output_embedding=True, scale_logits=True),
    "prefix_lm": tiny(architecture="decoder_only", prefix_lm=True),
    "llama_rope_gqa": tiny(architecture="decoder_only", family="llama", num_key_value_heads=2,
                           position_encoding="rope", mlp_activation="swiglu",
                           scale_attention=True),
    "bert_learned": tiny(architecture="encoder_only", family="bert", norm="layer",
                         norm_position="post", use_bias=True, scale_attention=True,
                         mlp_activation="gelu_exact", position_encoding="learned",
                         max_position_embeddings=64, type_vocab_size=2, embedding_norm=True),
    "gpt2_learned": tiny(architecture="decoder_only", family="gpt2", norm="layer", use_bias=True,
                         scale_attention=True, position_encoding="learned",
                         max_position_embeddings=64, mlp_activation="gelu",
                         tie_output_embedding=True),
}


# `make test-fast` compares a relative-bias encoder-decoder and a rotary, grouped-head decoder;
# the other patterns run in `make test`.
FAST = ("t5_relative_bias", "llama_rope_gqa")
VARIANT_PARAMS = [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
                  for name in sorted(VARIANTS)]


def packed_inputs(config, length=16, target_length=8, seed=0):
  """Three rows: two packed segments then padding; one segment then padding; padding only."""
  rng = np.random.RandomState(seed)

  def rows(n):
    cut = n // 2 - 1
    segments = np.array([[1] * cut + [2] * (n - cut - 2) + [0, 0],
                         [1] * (n - 3) + [0] * 3, [0] * n], np.int32)
    positions = np.zeros_like(segments)
    for row in range(3):
      for seg in (1, 2):
        where = segments[row] == seg
        positions[row, where] = np.arange(where.sum())
    tokens = np.where(segments > 0, rng.randint(3, config.vocab_size, segments.shape), 0)
    return tokens.astype(np.int32), segments, positions

  tokens, segments, positions = rows(length)
  if config.architecture == "encoder_decoder":
    targets, target_segments, target_positions = rows(target_length)
    return {"encoder_input_tokens": tokens, "encoder_segment_ids": segments,
            "encoder_positions": positions, "decoder_input_tokens": targets,
            "decoder_segment_ids": target_segments, "decoder_positions": target_positions}
  out = {"decoder_input_tokens": tokens, "decoder_segment_ids": segments,
         "decoder_positions": positions}
  if config.architecture == "encoder_only":
    out = {k.replace("decoder", "encoder"): v for k, v in out.items()}
    out["encoder_token_type_ids"] = (positions > 3).astype(np.int32)
  if config.prefix_lm:
    out["decoder_causal_attention"] = ((positions < 3) & (segments > 0)).astype(np.int32)
  return out


def output_and_gradients(config, params, inputs):
  """The model's output and the gradients of a fixed random projection of it."""
  model = make_model(config)

  def loss(p):
    out = model.apply({"params": p}, **inputs).astype(jnp.float32)
    weights = jax.random.normal(jax.random.key(7), out.shape)
    return jnp.sum(out * weights), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return np.asarray(out), jax.device_get(grads)


def relative_difference(a, b, floor=0.0) -> float:
  """||a - b|| / max(||b||, floor)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor, 1e-30))


@pytest.fixture
def fused_wiring_on_cpu(monkeypatch):
  """On CPU: the fused branch taken, with jax's XLA reference of the fused call in cuDNN's
  place; yields the list of (queries, keys) lengths each fused call saw."""
  calls = []

  def fused(query, key, value, bias, implementation="cudnn"):
    calls.append((query.shape[1], key.shape[1]))
    return unpatched(query, key, value, bias, implementation="xla")

  unpatched = attention_kernels.fused_attention
  monkeypatch.setattr(attention_kernels, "resolve", lambda choice, dtype: (
      "xla" if choice == "xla" else "cudnn"))
  monkeypatch.setattr(attention_kernels, "fused_attention", fused)
  yield calls


@pytest.fixture
def pallas_interpreted_on_cpu(monkeypatch):
  """On CPU: the Pallas kernels' branch taken, run by Pallas's TPU interpreter; yields the
  list of (kernel, queries, keys) each kernel call saw: 'segments' for t5lite's shared-bias
  kernel (a SegmentBias), 'dense' for jax's flash kernel (any other bias)."""
  from jax.experimental.pallas import tpu as pltpu
  calls = []

  def interpreted(kernel, attend):
    def call(query, key, value, bias, *heads):
      calls.append((kernel, query.shape[1], key.shape[1]))
      return attend(query, key, value, bias, *heads)
    return call

  monkeypatch.setattr(attention_kernels, "platform_attention",
                      interpreted("dense", attention_kernels.pallas_attention))
  monkeypatch.setattr(attention_kernels, "platform_segment_attention",
                      interpreted("segments", attention_kernels.segment_attention))
  with pltpu.force_tpu_interpret_mode():  # the whole test: gradients are traced after the call
    yield calls


# Fewer layers for the model-level tests: each layer's attention runs the same kernel
# (compiled, or in Pallas's interpreter, once per call site), so one layer of a stack covers
# it. The relative-bias encoder and prefix LM keep two layers: the first layer's bias is
# shared with the second, whose gradient flows back into it.
SMALLER = {"t5_relative_bias": dict(num_decoder_layers=1),
           "t5_v1_0": dict(num_decoder_layers=1),
           "prefix_lm": {},
           "llama_rope_gqa": dict(num_decoder_layers=1),
           "bert_learned": dict(num_encoder_layers=1),
           "gpt2_learned": dict(num_decoder_layers=1)}


def _compare(name, dtype, implementation="auto"):
  config = VARIANTS[name].replace(dtype=dtype, **SMALLER[name])
  params = init_params(config, 0)
  inputs = packed_inputs(config)
  fused_out, fused_grads = output_and_gradients(
      config.replace(attention_implementation=implementation), params, inputs)
  xla_out, xla_grads = output_and_gradients(
      config.replace(attention_implementation="xla"), params, inputs)
  assert np.isfinite(fused_out).all(), "the padding-only row must stay finite"
  # Each gradient against its own norm, floored at 1e-3 of the largest: a gradient that is
  # zero in exact arithmetic (a key projection's bias: softmax ignores what is added to every
  # key) is rounding on both sides.
  floor = 1e-3 * max(np.linalg.norm(np.asarray(x, np.float64))
                     for x in jax.tree_util.tree_leaves(xla_grads))
  grads = [(jax.tree_util.keystr(path), relative_difference(f, x, floor)) for (path, f), x in zip(
      jax.tree_util.tree_leaves_with_path(fused_grads), jax.tree_util.tree_leaves(xla_grads))]
  return relative_difference(fused_out, xla_out), grads


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in; on a GPU the cuDNN test runs instead")
@pytest.mark.parametrize("name", VARIANT_PARAMS)
def test_fused_path_equals_the_xla_path_forward_and_gradients(name, fused_wiring_on_cpu):
  out_diff, grads = _compare(name, "float32")
  assert fused_wiring_on_cpu, "the fused branch was never taken"
  assert out_diff < 1e-5
  for path, diff in grads:
    assert diff < 1e-4, (path, diff)


# Same-segment and causal masks (with T5's table or none) reach t5lite's shared-bias kernel:
# a relative-bias encoder-decoder (bidirectional, causal and cross-attention) and a rotary
# grouped-head decoder; a prefix LM's mask reaches jax's kernel as one dense bias (the padding
# test below draws arbitrary ones). The interpreter makes each 8-20 s on 2 cores.
PALLAS_KERNELS = {"t5_relative_bias": {"segments"}, "llama_rope_gqa": {"segments"},
                  "prefix_lm": {"dense"}}


@pytest.mark.skipif(ON_GPU, reason="the TPU interpreter on CPU")
@pytest.mark.parametrize("name", [*FAST, pytest.param("prefix_lm", marks=pytest.mark.slow)])
def test_pallas_kernel_equals_the_xla_path_forward_and_gradients(name,
                                                                  pallas_interpreted_on_cpu):
  out_diff, grads = _compare(name, "float32", implementation="pallas")
  assert {call[0] for call in pallas_interpreted_on_cpu} == PALLAS_KERNELS[name]
  assert out_diff < 1e-5
  for path, diff in grads:
    assert diff < 1e-4, (path, diff)


@pytest.mark.parametrize("name", ["t5_relative_bias", "prefix_lm"])
def test_pallas_kernels_run_per_shard_under_a_mesh(name, monkeypatch):
  """8 devices as data 2 x tensor 4 (heads): each kernel sees one shard of batch and heads
  (shard_map), and the model's output and gradients (T5's position table: summed over the
  batch's shards) equal the one-device run's. The kernels are references here (pallas's TPU
  interpreter blocks in callbacks across 8 CPU devices: the interpreted kernels are checked
  on one device above)."""
  from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
  from t5lite.models.kernels import shared_bias
  from t5lite.models.attention import SegmentBias
  from t5lite.runtime import partitioning
  shards = []

  def dense(q, k, v, ab=None, *, sm_scale, block_sizes):  # (B, H, L, D)
    shards.append((q.shape[0], q.shape[1], q.shape[2]))
    return tpu_flash.mha_reference(q, k, v, ab, sm_scale=sm_scale)

  def segments(q, k, v, query_segments, key_segments, table, *, causal, heads):  # (B, L, HD)
    shards.append((q.shape[0], heads, q.shape[1]))
    bias = SegmentBias(query_segments, key_segments, table, causal).dense()
    split = lambda t: t.reshape(t.shape[:2] + (heads, -1))  # noqa: E731
    return attention_kernels.reference_attention(split(q), split(k), split(v),
                                                 bias).reshape(q.shape)

  monkeypatch.setattr(tpu_flash, "flash_attention", dense)
  monkeypatch.setattr(shared_bias, "attend", segments)
  monkeypatch.setattr(attention_kernels, "platform_attention", attention_kernels.pallas_attention)
  monkeypatch.setattr(attention_kernels, "platform_segment_attention",
                      attention_kernels.segment_attention)
  config = VARIANTS[name].replace(attention_implementation="pallas", **SMALLER[name])
  params = init_params(config, 0)
  inputs = {k: np.concatenate([v, v[:1]]) for k, v in packed_inputs(config).items()}  # 4 rows
  alone = output_and_gradients(config, params, inputs)
  assert shards[0] == (4, 4, 16)  # (rows, heads, queries): all rows and heads
  shards.clear()
  mesh = partitioning.make_mesh(partitioning.MeshConfig(data=2, tensor=4))
  with partitioning.activate(mesh, partitioning.logical_axis_rules()):
    sharded = output_and_gradients(config, params, inputs)
  assert shards and all(shape[:2] == (2, 1) for shape in shards), shards  # rows / 2, heads / 4
  np.testing.assert_allclose(sharded[0], alone[0], rtol=1e-5, atol=1e-5)
  want = jax.tree_util.tree_leaves(alone[1])
  for (path, got), expected in zip(jax.tree_util.tree_leaves_with_path(sharded[1]), want):
    assert relative_difference(got, expected) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize("query_length, key_length, dropout, scores, why", [
    (16, 16, False, False, None), (520, 1000, False, False, None),
    (1, 16, False, False, "a single query"), (16, 16, True, False, "dropout"),
    (16, 16, False, True, "scores")])
def test_pallas_refusals_name_the_reason(query_length, key_length, dropout, scores, why):
  query = jnp.zeros((2, query_length, 4, 64), jnp.bfloat16)
  key = jnp.zeros((2, key_length, 4, 64), jnp.bfloat16)
  refusal = attention_kernels.pallas_refusal(query, key, dropout=dropout, reads_scores=scores)
  assert refusal is None if why is None else why in refusal


@pytest.mark.skipif(ON_GPU, reason="the TPU interpreter on CPU")
@pytest.mark.parametrize("shape", [(2, 128, 256, 2, 64), (3, 37, 53, 5, 64), (1, 200, 131, 2, 32)])
def test_pallas_kernel_pads_any_lengths_to_its_blocks(shape, pallas_interpreted_on_cpu):
  """Odd lengths on and off the kernel's 128-blocks, a bias with masked pairs and a row of
  masked keys: output and the gradients of query, key, value and bias equal XLA's."""
  batch, q_len, k_len, heads, dim = shape
  keys = jax.random.split(jax.random.key(sum(shape)), 5)
  query = jax.random.normal(keys[0], (batch, q_len, heads, dim))
  key, value = (jax.random.normal(k, (batch, k_len, heads, dim)) for k in keys[1:3])
  bias = jax.random.normal(keys[3], (batch, heads, q_len, k_len))
  masked = jax.random.bernoulli(keys[4], 0.3, (batch, 1, q_len, k_len)).at[:, :, 0].set(True)
  bias = jnp.where(masked, attention_kernels.MASK_VALUE, bias)
  weights = jax.random.normal(jax.random.key(1), (batch, q_len, heads, dim))

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * weights), argnums=(0, 1, 2, 3)))
  value_p, grads_p = loss(attention_kernels.pallas_attention)(query, key, value, bias)
  value_x, grads_x = loss(attention_kernels.reference_attention)(query, key, value, bias)
  assert abs(float(value_p) - float(value_x)) <= 1e-4 * abs(float(value_x))
  for got, want in zip(grads_p, grads_x):
    assert relative_difference(got, want) < 1e-4


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's kernel needs a CUDA GPU (JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cudnn_equals_xla_in_bfloat16_on_a_gpu(name):
  out_diff, grads = _compare(name, "bfloat16")
  # Both sides compute in bfloat16 (8 bits of mantissa): they differ by its rounding.
  assert out_diff < 2e-2
  for path, diff in grads:
    assert diff < 5e-2, (path, diff)


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in")
@pytest.mark.parametrize("name", ["t5_relative_bias", "llama_rope_gqa"])
def test_decoding_with_the_fused_path_gives_the_xla_paths_tokens(name, fused_wiring_on_cpu):
  """Greedy decoding: the encoder or prefill is fused (6 tokens: an encoder's input, or BOS
  and a prompt of 5 over 6 + 6 cache slots); the single-query steps fall back (odd length)."""
  config = VARIANTS[name].replace(**SMALLER[name])
  params = init_params(config, 1)
  width = 6 if config.has_encoder else 5
  prompts = np.random.RandomState(2).randint(3, 128, (2, width)).astype(np.int32)
  prompts[1, 4:] = 0
  decode = functools.partial(decoding.generate, params=params, encoder_input_tokens=prompts,
                             max_decode_length=6)
  fused = decode(config.replace(attention_implementation="auto"))
  assert any(q == 6 for q, _ in fused_wiring_on_cpu), fused_wiring_on_cpu
  assert all(q % 2 == 0 for q, _ in fused_wiring_on_cpu), "odd lengths must fall back"
  np.testing.assert_array_equal(fused, decode(config.replace(attention_implementation="xla")))


@pytest.mark.skipif(ON_GPU, reason="the TPU interpreter on CPU")
def test_decoding_with_the_pallas_kernels_gives_the_xla_paths_tokens(pallas_interpreted_on_cpu):
  """T5 greedy decoding under 'pallas': the encoder's and the first step's cross-attention
  run t5lite's kernel in the interpreter; each decoding step's single query falls back. (The
  XLA path's decode is the program of the fused-path test's t5 case: the same model, params,
  prompts and length.)"""
  config = VARIANTS["t5_relative_bias"].replace(**SMALLER["t5_relative_bias"])
  params = init_params(config, 1)
  prompts = np.random.RandomState(2).randint(3, 128, (2, 6)).astype(np.int32)
  prompts[1, 4:] = 0
  decode = functools.partial(decoding.generate, params=params, encoder_input_tokens=prompts,
                             max_decode_length=6)
  tokens = decode(config.replace(attention_implementation="pallas"))
  assert ("segments", 6, 6) in pallas_interpreted_on_cpu, pallas_interpreted_on_cpu
  np.testing.assert_array_equal(tokens, decode(config.replace(attention_implementation="xla")))


def test_auto_is_xla_off_gpus_and_cudnn_is_refused_there_with_the_fix():
  if ON_GPU:
    pytest.skip("off-GPU behaviour")
  assert attention_kernels.resolve("auto", jnp.bfloat16) == "xla"
  assert attention_kernels.resolve("xla", jnp.bfloat16) == "xla"
  with pytest.raises(ConfigError, match="'cudnn' needs a CUDA GPU.*backend cpu.*'auto'"):
    attention_kernels.resolve("cudnn", jnp.bfloat16)
  with pytest.raises(ConfigError, match="attention_implementation='flash' is not one of"):
    tiny(attention_implementation="flash")


@pytest.mark.parametrize("query_length, key_length, head_dim, dropout, scores, why", [
    (16, 16, 64, False, False, None),
    (1, 32, 64, False, False, "odd lengths"),
    (16, 19, 64, False, False, "odd lengths"),
    (16, 16, 12, False, False, "head dim 12"),
    (16, 16, 64, True, False, "dropout"),
    (16, 16, 64, False, True, "scores"),
])
def test_cudnn_refusals_name_the_reason(query_length, key_length, head_dim, dropout, scores,
                                        why):
  query = jnp.zeros((2, query_length, 4, head_dim), jnp.bfloat16)
  key = jnp.zeros((2, key_length, 2, head_dim), jnp.bfloat16)
  refusal = attention_kernels.cudnn_refusal(query, key, dropout=dropout, reads_scores=scores)
  assert refusal is None if why is None else why in refusal


def test_float16_bias_keeps_padding_rows_finite(fused_wiring_on_cpu):
  """The mask value -1e10 does not fit float16: the fused call clips it to -2**15."""
  query = jnp.ones((1, 4, 2, 8), jnp.float16)
  bias = jnp.full((1, 1, 4, 4), -1e10, jnp.float32)  # every key masked for every query
  out = attention_kernels.fused_attention(query, query, query, bias)
  assert np.isfinite(np.asarray(out, np.float32)).all()
