"""HF transformers parity: random HF T5 models load into t5lite and give the same logits."""
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import t5lite
from helpers import assert_trees_equal, hf_t5, tiny
from t5lite.interop.hf import checkpoints as hf_export

pytestmark = pytest.mark.parity

# (name, T5Config kwargs, untied): v1.0-style tied ReLU, v1.1-style untied gated-GELU, and
# odd shapes (num_heads * d_kv != d_model, gated-SiLU, asymmetric depth, other buckets).
HF_CONFIGS = {
    "v1_0_tied_relu": (dict(d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=2,
                            feed_forward_proj="relu", tie_word_embeddings=True), False),
    "v1_1_untied_gated_gelu": (dict(d_model=32, d_kv=8, d_ff=48, num_heads=6, num_layers=2,
                                    num_decoder_layers=3, relative_attention_num_buckets=8,
                                    relative_attention_max_distance=20,
                                    feed_forward_proj="gated-gelu", tie_word_embeddings=False),
                               True),
    "two_heads_gated_silu": (dict(d_model=24, d_kv=16, d_ff=40, num_heads=2, num_layers=3,
                                  num_decoder_layers=1, relative_attention_num_buckets=16,
                                  relative_attention_max_distance=64,
                                  feed_forward_proj="gated-silu", tie_word_embeddings=False),
                             True),
}
VOCAB = 101


def make_hf_model(name: str, seed: int = 0) -> transformers.T5ForConditionalGeneration:
  kwargs, untied = HF_CONFIGS[name]
  return hf_t5(seed, VOCAB, untied, **kwargs)


def hf_logits(model, enc, dec):
  with torch.no_grad():
    return model(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits.numpy()


def tokens(seed):
  # Lengths beyond max_distance reach the log-spaced buckets; 0s appear as in real batches.
  rng = np.random.RandomState(seed)
  return rng.randint(0, VOCAB, (2, 41)), rng.randint(0, VOCAB, (2, 29))


def assert_parity(ours, reference):
  scale = np.abs(reference).max()
  assert np.abs(ours - reference).max() <= 1e-4 * scale
  np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-5 * scale)


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def saved_hf(request, tmp_path_factory):
  model = make_hf_model(request.param)
  path = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(path)
  return request.param, model, path


def test_load_hf_matches_hf_logits(saved_hf):
  name, model, path = saved_hf
  config, params = t5lite.load_hf(path)
  untied = HF_CONFIGS[name][1]
  assert config.tie_output_embedding == (not untied) and config.scale_logits == (not untied)
  enc, dec = tokens(1)
  assert_parity(t5lite.logits(config, params, enc, dec), hf_logits(model, enc, dec))


def test_transformers_4x_era_config_semantics(saved_hf, tmp_path):
  """4.x-era configs have no scale_decoder_outputs: tie_word_embeddings says both."""
  name, model, path = saved_hf
  with open(os.path.join(path, "config.json")) as f:
    hf_config = json.load(f)
  hf_config.pop("scale_decoder_outputs", None)
  hf_config["tie_word_embeddings"] = not HF_CONFIGS[name][1]
  old = tmp_path / "old"
  old.mkdir()
  (old / "config.json").write_text(json.dumps(hf_config))
  os.link(os.path.join(path, "model.safetensors"), old / "model.safetensors")
  config, params = t5lite.load_hf(str(old))
  enc, dec = tokens(2)
  assert_parity(t5lite.logits(config, params, enc, dec), hf_logits(model, enc, dec))


def test_save_load_round_trip_is_bitwise_and_hf_loads_the_export(saved_hf, tmp_path):
  name, model, path = saved_hf
  config, params = t5lite.load_hf(path)
  out = str(tmp_path / "export")
  t5lite.save_hf(config, params, out)
  config2, params2 = t5lite.load_hf(out)
  assert config2 == config
  assert_trees_equal(params2, params)
  reloaded, info = transformers.T5ForConditionalGeneration.from_pretrained(
      out, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"]
  assert not info["mismatched_keys"] and not info["error_msgs"]
  enc, dec = tokens(3)
  np.testing.assert_array_equal(hf_logits(reloaded.eval(), enc, dec), hf_logits(model, enc, dec))


def test_scanned_import_gives_the_same_logits(saved_hf):
  _, model, path = saved_hf
  config, params = t5lite.load_hf(path, scan_layers=True)
  assert "layers" in params["encoder"]
  enc, dec = tokens(4)
  assert_parity(t5lite.logits(config, params, enc, dec), hf_logits(model, enc, dec))


def test_sharded_bin_and_bf16_checkpoints(tmp_path):
  model = make_hf_model("v1_1_untied_gated_gelu", seed=5)
  enc, dec = tokens(5)
  reference = hf_logits(model, enc, dec)
  sharded = str(tmp_path / "sharded")
  model.save_pretrained(sharded, max_shard_size="20KB")
  assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  config, params = t5lite.load_hf(sharded)
  assert_parity(t5lite.logits(config, params, enc, dec), reference)

  legacy = tmp_path / "legacy"
  legacy.mkdir()
  torch.save(model.state_dict(), legacy / "pytorch_model.bin")
  (legacy / "config.json").write_text(json.dumps(model.config.to_dict()))
  config, params = t5lite.load_hf(str(legacy))
  assert_parity(t5lite.logits(config, params, enc, dec), reference)

  sharded_bin = tmp_path / "sharded_bin"
  sharded_bin.mkdir()
  state = model.state_dict()
  names = sorted(state)
  halves = {"pytorch_model-00001-of-00002.bin": names[::2],
            "pytorch_model-00002-of-00002.bin": names[1::2]}
  for shard, keys in halves.items():
    torch.save({k: state[k] for k in keys}, sharded_bin / shard)
  weight_map = {k: shard for shard, keys in halves.items() for k in keys}
  (sharded_bin / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
  (sharded_bin / "config.json").write_text(json.dumps(model.config.to_dict()))
  config, params = t5lite.load_hf(str(sharded_bin))
  assert_parity(t5lite.logits(config, params, enc, dec), reference)

  half = str(tmp_path / "bf16")
  model.to(torch.bfloat16).save_pretrained(half)
  for directory in (half, str(legacy)):
    if directory == str(legacy):  # a bf16 .bin: numpy has no bfloat16, the bits are kept
      torch.save(model.state_dict(), legacy / "pytorch_model.bin")
    config, params = t5lite.load_hf(directory)
    assert config.param_dtype == "bfloat16"
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {np.dtype("bfloat16")}
    np.testing.assert_array_equal(
        np.asarray(params["token_embedder"]["embedding"], np.float32),
        model.shared.weight.detach().float().numpy())
  # Casting on request: every leaf takes the asked dtype.
  config, params = t5lite.load_hf(half, param_dtype="float32")
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {np.dtype("float32")}


def test_float16_checkpoints_with_float32_wo_load_as_one_dtype(tmp_path):
  """HF keeps `wo` in float32 inside float16 models (_keep_in_fp32_modules)."""
  model = make_hf_model("v1_1_untied_gated_gelu", seed=6)
  model.save_pretrained(tmp_path)
  half = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float16)
  half.save_pretrained(tmp_path / "fp16")
  stored = safetensors.numpy.load_file(str(tmp_path / "fp16" / "model.safetensors"))
  assert {str(v.dtype) for v in stored.values()} == {"float16", "float32"}
  config, params = t5lite.load_hf(str(tmp_path / "fp16"))
  assert config.param_dtype == "float16"
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {np.dtype("float16")}
  shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), t5lite.models.abstract_params(config))
  assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), params) == shapes


def test_logits_accepts_one_example():
  model = make_hf_model("v1_0_tied_relu")
  config = hf_export.config_from_hf(model.config.to_dict(), tied=True)
  params = hf_export.params_from_hf(config, {k: v.numpy() for k, v in model.state_dict().items()})
  enc, dec = tokens(6)
  single = t5lite.logits(config, params, enc[0], dec[0])
  assert single.shape == (29, VOCAB)
  assert_parity(single, hf_logits(model, enc[:1], dec[:1])[0])
  with pytest.raises(ValueError, match="batch size"):
    t5lite.logits(config, params, enc, dec[:1])


@pytest.mark.parametrize("changes, field", [
    (dict(position_encoding="rope"), "position_encoding='rope'"),
    (dict(norm="layer"), "norm='layer'"),
    (dict(architecture="decoder_only"), "a 'decoder_only' model has no HF layout"),
])
def test_variants_without_an_hf_equivalent_are_refused(changes, field, tmp_path):
  config = tiny(**changes)
  with pytest.raises(ValueError, match=field):
    t5lite.save_hf(config, t5lite.init_params(config), str(tmp_path))
  assert not os.listdir(tmp_path)  # nothing half-written


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_scaled_logits_must_agree(tied, tmp_path):
  """transformers 4.x reads tie_word_embeddings as tied *and* scaled: any other combination
  would give it wrong logits, so it is refused before anything is written."""
  config = tiny(tie_output_embedding=tied, scale_logits=not tied)
  with pytest.raises(ValueError, match=f"tie_output_embedding={tied} but scale_logits="
                     f"{not tied}: HF's T5 layout .transformers 4.x semantics.* needs them equal"):
    t5lite.save_hf(config, None, str(tmp_path))  # refused before the params are looked at
  assert not os.listdir(tmp_path)


def test_missing_or_misshapen_tensors_are_named(saved_hf, tmp_path):
  _, _, path = saved_hf
  tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
  hf_config = json.load(open(os.path.join(path, "config.json")))
  config = hf_export.config_from_hf(hf_config, tied="lm_head.weight" not in tensors)
  name = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
  with pytest.raises(KeyError, match=name.replace(".", r"\.")):
    hf_export.params_from_hf(config, {k: v for k, v in tensors.items() if k != name})
  with pytest.raises(ValueError, match="shared.weight"):
    hf_export.params_from_hf(config, {**tensors, "shared.weight": tensors["shared.weight"][:-1]})
  # A square kernel in the wrong layout: same size, transposed shape.
  q = "encoder.block.0.layer.0.SelfAttention.q.weight"
  wrong = np.zeros(tensors[q].shape[::-1] + (1,), tensors[q].dtype)[..., 0]
  if wrong.shape != tensors[q].shape:
    with pytest.raises(ValueError, match="expected"):
      hf_export.params_from_hf(config, {**tensors, q: wrong})
  with pytest.raises(FileNotFoundError, match="config.json"):
    t5lite.load_hf(str(tmp_path))
  with pytest.raises(ValueError, match="architecture"):
    t5lite.load_hf(path, tie_output_embedding=False)
