"""T5's shared encoder-decoder (ModelConfig.shared_encoder_decoder) against HF transformers' T5
whose decoder layers hold the very torch Parameters of the encoder's self-attention, MLP and
their norms: the same logits, the same gradients (torch sums both uses of a shared Parameter),
the same greedy decode; the export is a plain T5 that HF loads; and a run trains it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import t5lite
import train_tasks  # noqa: F401 (registers train_test_copy)
from helpers import (assert_trees_equal, checkpoint_params, hf_generate, hf_t5, quiet, tiny,
                     train_config)
from helpers.hf_models import assert_gradients_match
from t5lite.errors import ConfigError
from t5lite.interop.hf import checkpoints as hf_export
from t5lite.models import count_params, init_params, shared_stacks
from t5lite.models.network import make_model
from t5lite.models.params import scan_params
from t5lite.train.trainer import train

VOCAB = 67
# Odd shapes: 3 layers a stack, heads * d_kv != d_model, a gated MLP, few buckets.
HF_SHAPE = dict(d_model=24, d_kv=10, d_ff=40, num_heads=3, num_layers=3, num_decoder_layers=3,
                relative_attention_num_buckets=8, relative_attention_max_distance=20,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def shared_hf_t5(seed=0):
  """A random HF T5 whose decoder layer i runs encoder layer i's self-attention projections,
  feed-forward and their layer norms (the same torch Parameters); the decoder's own
  relative position bias and cross-attention stay."""
  import torch
  model = hf_t5(seed, VOCAB, untied=True, **HF_SHAPE)
  with torch.no_grad():  # norm scales off 1, so that a swapped norm shows
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  for enc, dec in zip(model.encoder.block, model.decoder.block):
    for name in ("q", "k", "v", "o"):
      setattr(dec.layer[0].SelfAttention, name, getattr(enc.layer[0].SelfAttention, name))
    dec.layer[0].layer_norm = enc.layer[0].layer_norm
    dec.layer[2].DenseReluDense = enc.layer[1].DenseReluDense
    dec.layer[2].layer_norm = enc.layer[1].layer_norm
  return model


def ours_of(model):
  """(shared config, shared params) of shared_hf_t5's model."""
  tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
  config = hf_export.config_from_hf(model.config.to_dict(), tied=False)
  params = hf_export.params_from_hf(config, tensors)
  return config.replace(shared_encoder_decoder=True), shared_stacks.untie({"params": params})[
      "params"]


def tokens(seed):
  rng = np.random.RandomState(seed)
  return rng.randint(1, VOCAB, (2, 23)), rng.randint(1, VOCAB, (2, 9))


@pytest.fixture(scope="module")
def shared_pair():
  model = shared_hf_t5()
  return model, *ours_of(model)


@pytest.mark.parity
def test_logits_and_every_gradient_equal_hfs_t5_with_shared_parameters(shared_pair):
  import torch
  model, config, params = shared_pair
  enc, dec = tokens(0)
  weights = np.random.RandomState(3).randn(2, 9, VOCAB).astype(np.float32)
  hf_logits = model(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits
  (hf_logits * torch.tensor(weights)).sum().backward()
  ours = t5lite.logits(config, params, enc, dec)
  scale = np.abs(hf_logits.detach().numpy()).max()
  np.testing.assert_allclose(ours, hf_logits.detach().numpy(), rtol=1e-4, atol=1e-5 * scale)

  apply = make_model(config).apply
  ones = jnp.ones_like(enc)

  def loss(p):
    logits = apply({"params": p}, enc, dec, encoder_segment_ids=ones,
                   decoder_segment_ids=jnp.ones_like(dec))
    return jnp.sum(logits * weights)
  with jax.default_matmul_precision("highest"):
    grads = jax.grad(loss)(params)
  # torch's named_parameters lists a shared Parameter once, under its encoder name, with
  # the gradient of both uses; ours is the encoder copy's, expanded to every HF name.
  assert "self_attention" not in str(jax.tree.map(np.shape, grads["decoder"]))
  assert assert_gradients_match(config, grads, model) == len(list(model.parameters()))


@pytest.mark.parity
def test_greedy_decoding_equals_hfs_and_the_export_is_a_t5_hf_loads(shared_pair, tmp_path):
  import transformers
  model, config, params = shared_pair
  inputs = tokens(1)[0]
  inputs[0, 17:] = 0  # a padded row
  ours = t5lite.generate(config, params, inputs, max_decode_length=7)
  np.testing.assert_array_equal(ours, hf_generate(model, inputs, 7, do_sample=False, num_beams=1))
  hf_export.save_hf(config, params, str(tmp_path))
  loaded = transformers.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
  np.testing.assert_array_equal(hf_generate(loaded, inputs, 7, do_sample=False, num_beams=1), ours)
  block = loaded.decoder.block[2].layer[0].SelfAttention.q.weight.detach().numpy()
  np.testing.assert_array_equal(
      block, loaded.encoder.block[2].layer[0].SelfAttention.q.weight.detach().numpy())


def test_the_decoder_stores_only_what_is_its_own_and_scanned_layers_share_alike():
  unshared = tiny(num_encoder_layers=3, num_decoder_layers=3, mlp_activation="gated-gelu")
  config = unshared.replace(shared_encoder_decoder=True)
  params = init_params(config, 0)
  layer = set(params["decoder"]["layers_1"])
  assert layer == {"encoder_decoder_attention", "pre_cross_attention_layer_norm"}
  expanded = shared_stacks.expand(params, config)
  assert count_params(expanded) == count_params(unshared)
  shared = sum(np.size(x) for x in jax.tree.leaves(
      [params["encoder"][f"layers_{i}"] for i in range(3)]))
  assert count_params(config) == count_params(unshared) - shared
  enc, dec = tokens(2)
  logits = t5lite.logits(config, params, enc % 128, dec % 128)
  assert_trees_equal(logits, t5lite.logits(unshared, expanded, enc % 128, dec % 128))
  scanned = config.replace(scan_layers=True)
  np.testing.assert_allclose(  # one scan compiles to other float roundings
      t5lite.logits(scanned, scan_params(params, scanned), enc % 128, dec % 128), logits,
      atol=1e-5)


@pytest.mark.parametrize("changes", [dict(num_decoder_layers=1),
                                     dict(architecture="decoder_only", num_encoder_layers=0)])
def test_a_shared_encoder_decoder_needs_two_stacks_of_one_depth(changes):
  with pytest.raises(ConfigError, match="shared_encoder_decoder needs an encoder-decoder"):
    tiny(shared_encoder_decoder=True, **changes)


def test_a_shared_run_trains_and_its_checkpoint_holds_the_shared_params(tmp_path):
  config = tiny(shared_encoder_decoder=True, vocab_size=384, num_encoder_layers=1,
                num_decoder_layers=1)
  result = train(config, train_config(tmp_path / "run", train_steps=4), log=quiet)
  assert result.step == 4 and all(np.isfinite(v) for v in result.losses.values())
  saved_config, params, step = checkpoint_params(tmp_path / "run")
  assert step == 4 and saved_config.shared_encoder_decoder
  assert set(params["decoder"]["layers_0"]) == {"encoder_decoder_attention",
                                                "pre_cross_attention_layer_norm"}
  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, init_params(config, 0))
