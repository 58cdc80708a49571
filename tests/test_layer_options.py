"""The layer options of the landmark models against independent references: the original
Transformer against torch.nn's post-norm layers, interleaved sinusoids against numpy.
(BERT, RoBERTa, ALBERT, GPT-2 and LLaMA are checked against HF transformers in
test_hf_encoders.py and test_hf_decoders.py: grouped-query attention against HF's repeated
key/value heads in LLaMA's case, ALBERT's layer sharing in the albert_two_groups case, 2
groups of 2 layers.)"""
import functools

import jax
import numpy as np
import pytest
import torch

import t5lite
from helpers import tiny
from t5lite.errors import ConfigError
from t5lite.families import family_of, token_loss_sums
from t5lite.models import init_params
from t5lite.models.positions import interleaved_sinusoidal_embedding

VASWANI = dict(norm="layer", layer_norm_epsilon=1e-5, norm_position="post", use_bias=True,
               scale_attention=True, mlp_activation="relu",
               position_encoding="sinusoidal_interleaved", scale_embeddings=True,
               tie_output_embedding=True)


@pytest.mark.parametrize("features", [7, 10])
def test_interleaved_sinusoids_equal_the_papers_formula(features):
  positions = np.array([[0, 1, 5, 63]])
  ours = np.asarray(interleaved_sinusoidal_embedding(positions, features))
  want = np.zeros((1, 4, features))
  for p, pos in enumerate(positions[0]):
    for j in range(features):
      angle = pos / 10000 ** (2 * (j // 2) / features)
      want[0, p, j] = np.sin(angle) if j % 2 == 0 else np.cos(angle)
  np.testing.assert_allclose(ours, want, atol=2e-6)


def _linear(weight_in_out, bias):
  return torch.tensor(np.asarray(weight_in_out).T.copy()), torch.tensor(np.asarray(bias))


def _copy_attention(mha: torch.nn.MultiheadAttention, p):
  d = mha.embed_dim
  w = [np.asarray(p[n]["kernel"]).reshape(d, -1) for n in ("query", "key", "value")]
  b = [np.asarray(p[n]["bias"]).reshape(-1) for n in ("query", "key", "value")]
  mha.in_proj_weight.copy_(torch.tensor(np.concatenate(w, 1).T.copy()))
  mha.in_proj_bias.copy_(torch.tensor(np.concatenate(b)))
  mha.out_proj.weight.copy_(torch.tensor(np.asarray(p["out"]["kernel"]).reshape(-1, d).T.copy()))
  mha.out_proj.bias.copy_(torch.tensor(np.asarray(p["out"]["bias"])))


def _copy_norm(norm: torch.nn.LayerNorm, p):
  norm.weight.copy_(torch.tensor(np.asarray(p["scale"])))
  norm.bias.copy_(torch.tensor(np.asarray(p["bias"])))


def _copy_mlp(layer, p):
  for torch_linear, ours in ((layer.linear1, p["wi"]), (layer.linear2, p["wo"])):
    w, b = _linear(ours["kernel"], ours["bias"])
    torch_linear.weight.copy_(w)
    torch_linear.bias.copy_(b)


def _perturbed(params, seed=1):
  """Params with every leaf moved a little, so that zero biases and unit norms are tested."""
  leaves, tree = jax.tree.flatten(params)
  rng = np.random.RandomState(seed)
  return jax.tree.unflatten(tree, [np.asarray(x) + 0.1 * rng.standard_normal(x.shape)
                                   .astype(np.float32) for x in leaves])


@pytest.mark.parity
@torch.no_grad()
def test_original_transformer_equals_torch_post_norm_layers():
  """Encoder-decoder, post-norm, biases, ReLU, interleaved sinusoids, embeddings times
  sqrt(d), tied output: torch.nn.TransformerEncoderLayer / DecoderLayer (norm_first=False)
  stacked without final norms, as in the paper."""
  config = tiny(vocab_size=61, d_model=24, d_ff=40, num_heads=3, d_kv=8, num_encoder_layers=2,
                num_decoder_layers=3, **VASWANI)
  params = _perturbed(init_params(config, 0))
  d = config.d_model
  make = dict(d_model=d, nhead=3, dim_feedforward=40, dropout=0.0, batch_first=True,
              layer_norm_eps=1e-5)
  encoder = [torch.nn.TransformerEncoderLayer(**make).eval() for _ in range(2)]
  decoder = [torch.nn.TransformerDecoderLayer(**make).eval() for _ in range(3)]
  for i, layer in enumerate(encoder):
    p = params["encoder"][f"layers_{i}"]
    _copy_attention(layer.self_attn, p["attention"])
    _copy_norm(layer.norm1, p["post_attention_layer_norm"])
    _copy_mlp(layer, p["mlp"])
    _copy_norm(layer.norm2, p["post_mlp_layer_norm"])
  for i, layer in enumerate(decoder):
    p = params["decoder"][f"layers_{i}"]
    _copy_attention(layer.self_attn, p["self_attention"])
    _copy_norm(layer.norm1, p["post_self_attention_layer_norm"])
    _copy_attention(layer.multihead_attn, p["encoder_decoder_attention"])
    _copy_norm(layer.norm2, p["post_cross_attention_layer_norm"])
    _copy_mlp(layer, p["mlp"])
    _copy_norm(layer.norm3, p["post_mlp_layer_norm"])
  embedding = np.asarray(params["token_embedder"]["embedding"])
  rng = np.random.RandomState(0)
  enc, dec = rng.randint(0, 61, (2, 13)), rng.randint(0, 61, (2, 9))

  def embed(ids):
    pe = np.asarray(interleaved_sinusoidal_embedding(np.arange(ids.shape[1])[None], d))
    return torch.tensor(embedding[ids] * d ** 0.5 + pe, dtype=torch.float32)

  x = embed(enc)
  for layer in encoder:
    x = layer(x)
  y = embed(dec)
  causal = torch.nn.Transformer.generate_square_subsequent_mask(dec.shape[1])
  for layer in decoder:
    y = layer(y, x, tgt_mask=causal, tgt_is_causal=True)
  want = (y @ torch.tensor(embedding).T).numpy()
  ours = t5lite.logits(config, params, enc, dec)
  assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("changes, message", [
    (dict(architecture="decoder_only", embedding_size=16), "encoder-only option"),
    (dict(architecture="decoder_only", pooler=True), "encoder-only option"),
    (dict(num_heads=4, num_key_value_heads=3), "must divide num_heads"),
    (dict(architecture="encoder_only", num_encoder_layers=3, shared_layer_groups=2),
     "must divide num_encoder_layers"),
    (dict(architecture="encoder_only", shared_layer_groups=1, scan_layers=True),
     "scan_layers=False"),
    (dict(architecture="encoder_only", sentence_classes=2), "needs pooler=True"),
    (dict(norm_position="middle"), "norm_position"),
    (dict(layers_per_group=0), "layers_per_group"),
])
def test_impossible_layer_options_are_named(changes, message):
  with pytest.raises(ConfigError, match=message):
    tiny(**changes)


@functools.lru_cache(maxsize=None)
def _mlm_loss_and_reference(config):
  """Jitted (loss, sums) and gradients of the family's loss and of the head over every
  position, built once per config: both parametrizations run the same two programs, and
  op by op each of the hundreds of ops would compile alone."""
  family = family_of(config)

  def reference(params, batch):
    logits, sentence = family.make_model().apply(
        {"params": params}, **family.model_inputs(batch), with_sentence_logits=True)
    loss_sum, sums = token_loss_sums(logits, batch["mlm_target_tokens"], batch["mlm_loss_weights"],
                                     batch["encoder_segment_ids"], family.loss)
    nll = -jax.nn.log_softmax(sentence)[jax.numpy.arange(3), batch["sentence_labels"]]
    return loss_sum + nll.sum() * sums["normalizer"] / 3, sums

  ours = jax.jit(jax.value_and_grad(lambda p, b: family.loss_fn(p, b, None), has_aux=True))
  return ours, jax.jit(jax.value_and_grad(reference, has_aux=True))


@pytest.mark.parametrize("per_row", [3, 12])
def test_mlm_loss_on_the_chosen_positions_equals_the_loss_over_every_position(per_row):
  """The encoder-only loss runs its MLM head on each row's weighted positions (8 slots for a
  row of 16); with more chosen than that (12) it runs on every position. Loss, sums and
  gradients equal those of the head over every position."""
  config = tiny(architecture="encoder_only", family="bert", num_decoder_layers=0,
                norm="layer", norm_position="post", use_bias=True, scale_attention=True,
                position_encoding="learned", max_position_embeddings=32, type_vocab_size=2,
                embedding_norm=True, tie_output_embedding=True, pooler=True,
                sentence_classes=2, mlp_activation="gelu_exact")
  params = init_params(config, 0)
  rng = np.random.RandomState(per_row)
  weights = np.zeros((3, 16), np.float32)
  for row in weights:
    row[rng.choice(16, per_row, replace=False)] = 1.0
  batch = dict(encoder_input_tokens=rng.randint(3, 128, (3, 16)),
               encoder_segment_ids=np.ones((3, 16), np.int32),
               encoder_token_type_ids=rng.randint(0, 2, (3, 16)),
               mlm_target_tokens=rng.randint(3, 128, (3, 16)), mlm_loss_weights=weights,
               sentence_labels=rng.randint(0, 2, (3,)))
  batch = jax.tree.map(jax.numpy.asarray, batch)

  ours_fn, reference_fn = _mlm_loss_and_reference(config)
  (ours, ours_sums), ours_grads = ours_fn(params, batch)
  (want, want_sums), want_grads = reference_fn(params, batch)
  np.testing.assert_allclose(ours, want, rtol=1e-6)
  for key in ("weight_sum", "correct", "normalizer"):
    np.testing.assert_allclose(ours_sums[key], want_sums[key], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # summation order
  if per_row == 3:
    # Without a sentence head (bert_ablations' "MLM alone (pairs)" arm) the pairs' labels are
    # ignored: the MLM part of the loss alone.
    no_head = family_of(config.replace(sentence_classes=0))
    alone, sums = jax.jit(lambda p, b: no_head.loss_fn(p, b, None))(params, batch)
    assert "sentence_loss" not in sums
    np.testing.assert_allclose(
        alone, ours - ours_sums["sentence_loss"] * ours_sums["normalizer"] / 3, rtol=1e-5)
