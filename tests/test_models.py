"""Model behaviour: shapes, masks and packing, scan vs unrolled, causality, dropout, sizes."""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from helpers import jitted_apply, tiny
from t5lite.models import (abstract_params, count_params, init_params, make_model,
                           param_logical_axes)
from t5lite.models.params import scan_params, unscan_params


def one_layer(**changes):
  """tiny() with one layer a stack: what these checks test is not depth (a stack of layers is
  what the scan comparison and the mesh constraints test, and they make one)."""
  return tiny(**{"num_encoder_layers": 1, "num_decoder_layers": 1, **changes})


VARIANTS = {
    "t5_v1_1": one_layer(),
    "t5_v1_0": one_layer(mlp_activation="relu", tie_output_embedding=True, scale_logits=True),
    "enc_dec_sinusoidal_reglu": one_layer(position_encoding="sinusoidal", mlp_activation="reglu"),
    "enc_dec_rope_layernorm": one_layer(position_encoding="rope", norm="layer"),
    "decoder_only_rope_swiglu": one_layer(architecture="decoder_only", position_encoding="rope",
                                          mlp_activation="swiglu"),
    "decoder_only_prefix_lm": one_layer(architecture="decoder_only", prefix_lm=True),
    "encoder_only_learned": one_layer(architecture="encoder_only", position_encoding="learned",
                                      norm="layer", mlp_activation="gelu",
                                      tie_output_embedding=True, scale_logits=True,
                                      max_position_embeddings=64),
    "bert_post_norm": one_layer(architecture="encoder_only", family="bert", norm="layer",
                                norm_position="post", use_bias=True, scale_attention=True,
                                mlp_activation="gelu_exact", position_encoding="learned",
                                max_position_embeddings=64, type_vocab_size=2, embedding_norm=True,
                                embedding_size=16, tie_output_embedding=True, pooler=True,
                                sentence_classes=2),
    "gpt2_style": one_layer(architecture="decoder_only", family="gpt2", norm="layer",
                            use_bias=True, scale_attention=True, position_encoding="learned",
                            max_position_embeddings=64, mlp_activation="gelu",
                            tie_output_embedding=True),
    "llama_style_gqa": one_layer(architecture="decoder_only", family="llama", num_heads=4,
                                 num_key_value_heads=2, position_encoding="rope",
                                 mlp_activation="swiglu", scale_attention=True),
    "vaswani_post_norm": one_layer(norm="layer", norm_position="post", use_bias=True,
                                   scale_attention=True, mlp_activation="relu",
                                   position_encoding="sinusoidal_interleaved",
                                   scale_embeddings=True, tie_output_embedding=True),
}

# The other encoder-decoder options (T5 v1.0's ReLU and tied logits, sinusoidal + ReGLU, RoPE
# + LayerNorm) of the per-variant checks run in `make test`; `make test-fast` keeps a variant
# per family.
FAST_VARIANTS = ("t5_v1_1", "decoder_only_rope_swiglu", "decoder_only_prefix_lm",
                 "encoder_only_learned", "bert_post_norm")
VARIANT_PARAMS = [name if name in FAST_VARIANTS else pytest.param(name, marks=pytest.mark.slow)
                  for name in sorted(VARIANTS)]


def params_for(config, seed):
  """init_params with an "rbg" key: the same initializers, drawn by XLA's RngBitGenerator,
  whose init compiles in about a third of threefry's time (the values are not the point)."""
  return init_params(config, jax.random.key(seed, impl="rbg"))


def inputs_for(config, tokens, segments=None, positions=None, targets=None,
               target_segments=None, target_positions=None, prefix=None):
  """Model inputs for any family from (B, L) arrays; decoder-only/encoder-only use `tokens`."""
  if config.architecture == "encoder_decoder":
    out = {"encoder_input_tokens": tokens, "decoder_input_tokens": targets,
           "encoder_segment_ids": segments, "decoder_segment_ids": target_segments,
           "encoder_positions": positions, "decoder_positions": target_positions}
  elif config.architecture == "decoder_only":
    out = {"decoder_input_tokens": tokens, "decoder_segment_ids": segments,
           "decoder_positions": positions, "decoder_causal_attention": prefix}
  else:
    out = {"encoder_input_tokens": tokens, "encoder_segment_ids": segments,
           "encoder_positions": positions}
  return {k: v for k, v in out.items() if v is not None}


def random_tokens(shape, seed=0, low=3):
  return np.random.RandomState(seed).randint(low, 128, shape).astype(np.int32)


def _pack(a, b, pad):
  """Rows [a | b | pad zeros] with segment ids and restarting positions."""
  tokens = np.concatenate([a, b, np.zeros(pad, np.int32)])[None]
  segments = np.array([[1] * len(a) + [2] * len(b) + [0] * pad], np.int32)
  positions = np.array([list(range(len(a))) + list(range(len(b))) + [0] * pad], np.int32)
  return tokens, segments, positions


@pytest.mark.parametrize("name", VARIANT_PARAMS)
def test_packed_segments_and_padding_never_leak(name):
  """Each packed segment's output equals running it alone (with no segment ids: the default
  every other caller takes); pad values change nothing; the logits have the model's shape and
  are finite. The segments differ in length (5 and 4 inputs, 3 and 6 targets), as packed rows
  do."""
  config = VARIANTS[name]
  apply = jitted_apply(config)
  params = params_for(config, 1)
  a, b = random_tokens((5,), 1), random_tokens((4,), 2)
  ta, tb = random_tokens((3,), 3), random_tokens((6,), 4)
  tokens, segments, positions = _pack(a, b, 3)
  targets, target_segments, target_positions = _pack(ta, tb, 2)
  # Prefix LM: each packed segment has its own prefix (first 2 tokens of a, first 3 of b).
  prefix = np.array([[1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0]], np.int32) if config.prefix_lm else None
  packed = np.asarray(apply(params, inputs_for(
      config, tokens, segments, positions, targets, target_segments, target_positions, prefix)))
  assert packed.shape == (1, 11 if config.architecture == "encoder_decoder" else 12, 128)
  assert np.isfinite(packed).all()

  def alone(x, tx):
    own_prefix = None
    if config.prefix_lm:
      own_prefix = (np.arange(len(x)) < (2 if len(x) == 5 else 3)).astype(np.int32)[None]
    return np.asarray(apply(params, inputs_for(config, x[None], None, None, tx[None], None,
                                               prefix=own_prefix)))[0]

  if config.architecture == "encoder_decoder":
    np.testing.assert_allclose(packed[0, :3], alone(a, ta), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[0, 3:9], alone(b, tb), atol=1e-5, rtol=1e-5)
  else:
    np.testing.assert_allclose(packed[0, :5], alone(a, ta), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[0, 5:9], alone(b, tb), atol=1e-5, rtol=1e-5)

  # Garbage in the padding (tokens and positions) must not move any real output.
  noisy_tokens, noisy_targets = tokens.copy(), targets.copy()
  noisy_positions, noisy_target_positions = positions.copy(), target_positions.copy()
  noisy_tokens[0, 9:] = [7, 8, 9]
  noisy_targets[0, 9:] = [10, 11]
  noisy_positions[0, 9:] = [30, 2, 17]
  noisy_target_positions[0, 9:] = [5, 40]
  noisy = np.asarray(apply(params, inputs_for(
      config, noisy_tokens, segments, noisy_positions, noisy_targets, target_segments,
      noisy_target_positions, prefix)))
  real = slice(0, 9)
  np.testing.assert_allclose(noisy[0, real], packed[0, real], atol=1e-6, rtol=1e-6)


def test_encoder_padding_mask_comes_from_tokens_when_segments_are_omitted():
  config = VARIANTS["t5_v1_1"]
  params = params_for(config, 2)
  enc = random_tokens((1, 8))
  dec = random_tokens((1, 5), 9)
  padded = np.concatenate([enc, np.zeros((1, 4), np.int32)], axis=1)
  apply = jitted_apply(config)
  short = apply(params, {"encoder_input_tokens": enc, "decoder_input_tokens": dec})
  long = apply(params, {"encoder_input_tokens": padded, "decoder_input_tokens": dec})
  np.testing.assert_allclose(np.asarray(long), np.asarray(short), atol=1e-5, rtol=1e-5)


def _scan_loss(config):
  """The jitted value and gradients of a fixed function of the model's output."""
  model = make_model(config)
  tokens = random_tokens((2, 10))
  inputs = inputs_for(config, tokens, targets=tokens[:, :6])
  return jax.jit(jax.value_and_grad(
      lambda p: jnp.sum(model.apply({"params": p}, **inputs) ** 2) / 1e4))


def _two_layers(name):
  """A variant with a stack of 2 layers (a scan of 1 would not show the stacking)."""
  return VARIANTS[name].replace(num_encoder_layers=2, num_decoder_layers=2)


@functools.lru_cache(maxsize=None)
def _unrolled_value_and_grads(name):
  """The unrolled model's side of the scan comparison: the same for every remat policy (which
  only the scanned model has), so compiled and run once per variant."""
  config = _two_layers(name)
  return _scan_loss(config)(params_for(config, 3))


# Every family's stack scanned; the remat policies change what is saved, not the values
# (`make test-fast` checks "none"). A policy wraps each layer class the same way in every
# stack (transformer.run_layers), so T5's encoder and decoder layers (the decoder-only and
# encoder-only stacks' classes) are where "full" and "dots" are checked.
@pytest.mark.parametrize("remat, name", [
    ("none", "t5_v1_1"), ("none", "decoder_only_rope_swiglu"), ("none", "encoder_only_learned"),
    pytest.param("full", "t5_v1_1", marks=pytest.mark.slow),
    pytest.param("dots", "t5_v1_1", marks=pytest.mark.slow),
    pytest.param("save_attention", "t5_v1_1", marks=pytest.mark.slow)])
def test_scan_matches_unrolled_values_and_gradients(name, remat):
  config = _two_layers(name)
  scanned = config.replace(scan_layers=True, remat_policy=remat)
  params = params_for(config, 3)
  stacked = scan_params(params, scanned)
  assert jax.tree_util.tree_structure(stacked) == jax.tree_util.tree_structure(
      abstract_params(scanned))
  value, grads = _unrolled_value_and_grads(name)
  scan_value, scan_grads = _scan_loss(scanned)(stacked)
  np.testing.assert_allclose(scan_value, value, rtol=1e-5)
  flat = jax.tree_util.tree_leaves_with_path(grads)
  scan_flat = dict(jax.tree_util.tree_leaves_with_path(unscan_params(scan_grads)))
  assert len(flat) == len(scan_flat)
  for path, g in flat:
    np.testing.assert_allclose(scan_flat[path], g, rtol=2e-4, atol=1e-6, err_msg=str(path))


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_save_attention_keeps_attentions_outputs_and_recomputes_the_mlp(kernel, capsys):
  """What 'save_attention' saves for the backward pass, read from jax's list of residuals:
  each attention's query, key, value, heads' output and out projection (the encoder's, the
  decoder's self- and cross-attention of a 1 + 1-layer T5: 5 names each), the matmuls' as
  2-D products (tokens, features) and the heads' output as (B, L, heads x d_kv), for either
  kernel; no (tokens, d_ff) activation of the MLP, recomputed."""
  config = VARIANTS["t5_v1_1"].replace(remat_policy="save_attention", d_ff=96,
                                       attention_implementation=kernel)
  model = make_model(config)
  tokens = random_tokens((2, 10))
  inputs = inputs_for(config, tokens, targets=tokens[:, :6])
  loss = lambda p: jnp.sum(model.apply({"params": p}, **inputs) ** 2)  # noqa: E731
  jax.ad_checkpoint.print_saved_residuals(loss, abstract_params(config))
  saved = capsys.readouterr().out.splitlines()
  named = sorted(line.split("named '")[1].split("'")[0] for line in saved if "named '" in line)
  assert named == sorted(["query", "key", "value", "attention", "out"] * 3)
  width = config.num_heads * config.d_kv
  for line in saved:
    if "named 'attention'" in line:  # the heads side by side, (B, L, H x K), as the kernel's
      assert f"[2,10,{width}]" in line or f"[2,6,{width}]" in line, line
    elif "named '" in line:
      assert f"[{2 * 10},{width}]" in line or f"[{2 * 6},{width}]" in line or (
          f"[{2 * 6},{config.d_model}]" in line), line
  activations = [line for line in saved if "from the argument" not in line]
  assert not [line for line in activations if f",{config.d_ff}]" in line], activations


def test_decoder_only_is_causal():
  config = VARIANTS["decoder_only_rope_swiglu"]
  params = params_for(config, 4)
  apply = jitted_apply(config)
  tokens = random_tokens((1, 10))
  base = np.asarray(apply(params, {"decoder_input_tokens": tokens}))
  for t in (0, 4, 9):
    changed = tokens.copy()
    changed[0, t] = (changed[0, t] + 1) % 128
    out = np.asarray(apply(params, {"decoder_input_tokens": changed}))
    np.testing.assert_array_equal(out[0, :t], base[0, :t])  # the past never sees the future
    assert np.abs(out[0, t:] - base[0, t:]).max() > 1e-4  # and the present does see itself


def test_prefix_lm_is_bidirectional_on_the_prefix_only():
  config = VARIANTS["decoder_only_prefix_lm"]
  params = params_for(config, 5)
  apply = jitted_apply(config)
  tokens = random_tokens((1, 10))
  prefix = (np.arange(10) < 4).astype(np.int32)[None]
  run = lambda t: np.asarray(apply(params, {"decoder_input_tokens": t,
                                            "decoder_causal_attention": prefix}))
  base = run(tokens)
  changed = tokens.copy()
  changed[0, 3] += 1  # last prefix token: earlier prefix positions see it
  assert np.abs(run(changed)[0, :3] - base[0, :3]).max() > 1e-4
  changed = tokens.copy()
  changed[0, 6] += 1  # a target token: nothing before it sees it
  np.testing.assert_array_equal(run(changed)[0, :6], base[0, :6])


def test_prefix_lm_flag_and_inputs_must_agree():
  config = VARIANTS["decoder_only_prefix_lm"]
  params = params_for(config, 0)
  with pytest.raises(ValueError, match="needs decoder_causal_attention"):
    make_model(config).apply({"params": params}, random_tokens((1, 4)))
  causal = VARIANTS["decoder_only_rope_swiglu"]
  with pytest.raises(ValueError, match="prefix_lm=False"):
    make_model(causal).apply({"params": params_for(causal, 0)}, random_tokens((1, 4)),
                             decoder_causal_attention=np.ones((1, 4), np.int32))


def test_learned_positions_reject_too_long_inputs():
  config = VARIANTS["encoder_only_learned"]
  with pytest.raises(ValueError, match="max_position_embeddings=64"):
    make_model(config).apply({"params": params_for(config, 0)}, random_tokens((1, 65)))


def test_dropout_is_seeded_and_off_by_default():
  config = one_layer(dropout_rate=0.3)
  params = params_for(config, 6)
  tokens = random_tokens((2, 8))
  inputs = {"encoder_input_tokens": tokens, "decoder_input_tokens": tokens}
  train = jitted_apply(config, enable_dropout=True)
  a = np.asarray(train(params, inputs, jax.random.key(1)))
  b = np.asarray(train(params, inputs, jax.random.key(1)))
  c = np.asarray(train(params, inputs, jax.random.key(2)))
  np.testing.assert_array_equal(a, b)
  assert np.abs(a - c).max() > 1e-3
  # Scanned stacks split the dropout rng per layer; their masks differ from the unrolled
  # model's, so check seeding and variety there too.
  scanned = config.replace(scan_layers=True)
  train_scanned = jitted_apply(scanned, enable_dropout=True)
  stacked = scan_params(params, scanned)
  s1 = np.asarray(train_scanned(stacked, inputs, jax.random.key(1)))
  np.testing.assert_array_equal(s1, np.asarray(train_scanned(stacked, inputs, jax.random.key(1))))
  assert np.abs(s1 - np.asarray(train_scanned(stacked, inputs, jax.random.key(2)))).max() > 1e-3
  eval_out = np.asarray(jitted_apply(config)(params, inputs))
  no_dropout = np.asarray(jitted_apply(config.replace(dropout_rate=0.0))(params, inputs))
  np.testing.assert_array_equal(eval_out, no_dropout)


def test_bfloat16_activations_stay_close_to_float32():
  config = VARIANTS["t5_v1_1"]
  params = params_for(config, 7)
  tokens = random_tokens((2, 8))
  inputs = {"encoder_input_tokens": tokens, "decoder_input_tokens": tokens}
  fp32 = np.asarray(jitted_apply(config)(params, inputs))
  bf16 = jitted_apply(config.replace(dtype="bfloat16"))(params, inputs)
  assert bf16.dtype == jnp.float32  # logits leave the model in float32 for the loss
  assert np.abs(np.asarray(bf16) - fp32).max() < 0.05 * np.abs(fp32).max()


@pytest.mark.parity
@pytest.mark.parametrize("gin_size, published", [("small", 76_961_152), ("base", 247_577_856)])
def test_t5_v1_1_param_counts_match_published_and_hf(gin_size, published):
  import torch
  import transformers
  from t5lite.models import ModelConfig
  widths = {"small": (512, 1024, 6, 8), "base": (768, 2048, 12, 12)}[gin_size]
  d, ff, heads, layers = widths
  ours = count_params(ModelConfig(d_model=d, d_ff=ff, num_heads=heads, num_encoder_layers=layers,
                                  num_decoder_layers=layers))
  assert ours == published
  hf_config = transformers.T5Config(d_model=d, d_ff=ff, num_heads=heads, num_layers=layers,
                                    feed_forward_proj="gated-gelu", tie_word_embeddings=False)
  with torch.device("meta"):
    hf = transformers.T5ForConditionalGeneration(hf_config)
  # HF's tied shared/embed_tokens count once; v1.1's lm_head is its own tensor.
  hf_count = sum(p.numel() for p in hf.parameters()) + (
      0 if hf.lm_head.weight is not hf.shared.weight else hf.lm_head.weight.numel())
  assert ours == hf_count


LOGICAL_NAMES = {"embed", "mlp", "heads", "kv_heads", "kv", "vocab", "relpos_buckets", "classes",
                 "layers", None}


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("scan", [False, True])
def test_every_param_has_logical_axis_names(name, scan):
  config = VARIANTS[name].replace(scan_layers=scan)
  specs = param_logical_axes(config)
  shapes = abstract_params(config)
  for (path, spec), shape in zip(jax.tree_util.tree_leaves_with_path(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
                                 jax.tree_util.tree_leaves(shapes)):
    assert len(spec) == len(shape.shape), path
    assert set(spec) <= LOGICAL_NAMES, (path, spec)
    assert any(n is not None for n in spec) or len(spec) == 0, path
    in_stack = "layers" in jax.tree_util.keystr(path)
    assert (spec[0] == "layers") == (scan and in_stack), (path, spec)


def test_activations_are_constrained_under_a_mesh():
  """With 8 fake devices and rules heads->tensor, batch->data, the lowered forward carries
  sharding constraints on (batch, length, heads, kv) and (batch, length, embed) activations."""
  config = tiny()  # 2 + 2 layers: the counts below are per layer
  mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
  rules = [("batch", "data"), ("heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor")]
  model = make_model(config)
  params = abstract_params(config)  # lowered, never run: shapes are all it needs
  tokens = jnp.ones((4, 8), jnp.int32)
  forward = lambda p, e, d: model.apply({"params": p}, e, d)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    text = jax.jit(forward).lower(params, tokens, tokens).as_text()
  constraints = [line for line in text.splitlines() if "sharding_constraint" in line]
  heads = [c for c in constraints if re.search(r'\[\{"data"\}, \{\}, \{"tensor"\}, \{\}\]', c)]
  embed = [c for c in constraints if re.search(r'\[\{"data"\}, \{\}, \{\}\]', c)]
  # q, k, v and the attention output in each of 2 encoder + 2x2 decoder attentions.
  assert len(heads) >= 4 * 6
  assert len(embed) >= 2 + 2 + 2  # both embeddings and every layer's output
  assert any(re.search(r'\[\{"data"\}, \{\}, \{"tensor"\}\]> : tensor<4x8x128', c)
             for c in constraints)  # logits (batch, length, vocab)
