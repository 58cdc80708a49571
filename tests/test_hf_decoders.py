"""HF parity of the decoder-only layouts: GPT-2 (GPT2LMHeadModel: fused Conv1D q/k/v, learned
positions, tied output) and LLaMA (LlamaForCausalLM: RoPE, SwiGLU, RMSNorm, grouped-query
attention with head_dim != hidden / heads, untied output). Random HF models of odd shapes load
into t5lite with the same logits, t5lite writes files transformers loads with no missing,
unexpected or mismatched keys, greedy decoding through t5lite's KV cache equals HF's
`generate` token for token, and options neither side can express are refused by name."""
import os
import shutil
import re

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import t5lite
from t5lite.errors import ConfigError
from t5lite.interop.hf import checkpoints as hf_export
from t5lite.interop.hf import layout as hf_layout
from t5lite.models.config import ModelConfig

pytestmark = pytest.mark.parity

T = transformers
N_POSITIONS = 24  # GPT-2's learned table; the decoding test reaches its last row
# name: (HF config class, config kwargs). Odd widths, 3 heads of 12 (GPT-2); 6 query heads of
# 8 over 2 key/value heads, head_dim 8 != 36 / 6 and a rotary base off the default (LLaMA);
# a LLaMA variant with biases, a tied output and tanh-gated GELU; a GPT-2 variant untied,
# unscaled, with exact GELU. initializer_range 0.2 keeps the models' greedy outputs varied.
# GPT-2's <|endoftext|> is its last id, as 50256 is the real one's.
CASES = {
    "gpt2": (T.GPT2Config, dict(vocab_size=97, n_embd=36, n_layer=2, n_head=3, n_inner=50,
                                n_positions=N_POSITIONS, initializer_range=0.2,
                                layer_norm_epsilon=1e-4, bos_token_id=96, eos_token_id=96)),
    "llama": (T.LlamaConfig, dict(vocab_size=97, hidden_size=36, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                  intermediate_size=50, rope_theta=500.0, rms_norm_eps=1e-5,
                                  initializer_range=0.2)),  # bos 1, eos 2: LlamaConfig's
    "gpt2_variant": (T.GPT2Config, dict(vocab_size=89, n_embd=30, n_layer=2, n_head=5,
                                        n_inner=44, n_positions=40, activation_function="gelu",
                                        scale_attn_weights=False, tie_word_embeddings=False,
                                        reorder_and_upcast_attn=True, bos_token_id=3,
                                        eos_token_id=4)),
    "llama_variant": (T.LlamaConfig, dict(vocab_size=89, hidden_size=30, num_hidden_layers=2,
                                          num_attention_heads=3, head_dim=12,
                                          intermediate_size=44, hidden_act="gelu_new",
                                          attention_bias=True, mlp_bias=True,
                                          tie_word_embeddings=True)),
}
TOLERANCE = 1e-4  # relative to the largest logit


def make_hf_model(name, seed=0):
  config_cls, kwargs = CASES[name]
  torch.manual_seed(seed)
  model = T.AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
  with torch.no_grad():  # biases off 0 and norm scales off 1, so that a swapped one shows
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
    # The EOS row (at which decoding stops) of the output projection zeroed: its logit is 0,
    # below the best of the others, so greedy decoding runs to its full length.
    model.get_output_embeddings().weight[model.config.eos_token_id] = 0.0
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """name -> (HF model, its save_pretrained directory), built once per name."""
  built = {}

  def get(name):
    if name not in built:
      model = make_hf_model(name)
      path = str(tmp_path_factory.mktemp(name))
      model.save_pretrained(path)
      built[name] = model, path
    return built[name]
  return get


def hf_logits(model, ids):
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids)).logits.numpy()


def relative_error(ours, ref):
  return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", list(CASES))
def test_import_logits_and_export_round_trip(saved, tmp_path, name):
  model, path = saved(name)
  config, params = t5lite.load_hf(path)
  assert config.family == name.split("_")[0] and config.architecture == "decoder_only"
  ids = np.random.RandomState(1).randint(2, model.config.vocab_size, (2, 13))
  ref = hf_logits(model, ids)
  assert relative_error(t5lite.logits(config, params, ids), ref) < TOLERANCE

  out = str(tmp_path / "export")
  t5lite.save_hf(config, params, out)
  reloaded, info = T.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  assert type(reloaded) is type(model)
  assert relative_error(hf_logits(reloaded.eval(), ids), ref) < 1e-6
  assert t5lite.load_hf(out)[0] == config  # the config survives the round trip


def test_import_reads_the_layouts_options(saved):
  gpt2 = t5lite.load_hf(saved("gpt2")[1])[0]
  assert (gpt2.d_ff, gpt2.d_kv, gpt2.num_heads, gpt2.max_position_embeddings) == (50, 12, 3, 24)
  assert gpt2.tie_output_embedding and gpt2.scale_attention and gpt2.mlp_activation == "gelu"
  llama = t5lite.load_hf(saved("llama")[1])[0]
  assert (llama.d_kv, llama.num_heads, llama.kv_heads, llama.rope_theta) == (8, 6, 2, 500.0)
  assert llama.mlp_activation == "swiglu" and not llama.tie_output_embedding
  assert not llama.use_bias and llama.layer_norm_epsilon == 1e-5


def test_gpt2_base_model_names_get_the_transformer_prefix(saved, tmp_path):
  """The published GPT-2 checkpoints name their tensors as GPT2Model (`wte.weight`, `h.0.*`,
  plus the old `attn.bias` mask buffers, which t5lite does not read whatever their dtype):
  load_hf reads such a directory as the prefixed one."""
  model, path = saved("gpt2")
  config, params = t5lite.load_hf(path)
  tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
  bare = {name.removeprefix("transformer."): value for name, value in tensors.items()}
  bare["h.0.attn.bias"] = np.tril(np.ones((1, 1, 24, 24), bool))
  safetensors.numpy.save_file(bare, str(tmp_path / "model.safetensors"))
  shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
  layout = hf_layout.for_model_type("gpt2")
  assert layout.checkpoint_tensors(tensors).keys() == tensors.keys()  # already prefixed
  bare_config, bare_params = t5lite.load_hf(str(tmp_path))
  assert bare_config == config
  ids = np.random.RandomState(1).randint(2, 97, (1, 9))
  np.testing.assert_array_equal(t5lite.logits(config, bare_params, ids),
                                t5lite.logits(config, params, ids))


def hf_greedy(model, prompt, new_tokens):
  """HF greedy continuation of [BOS] + prompt (what HF's LLaMA tokenizer gives; GPT-2's
  <|endoftext|> before a text), 0-padded to new_tokens after an EOS, as t5lite.generate
  returns it for the prompt alone (it reads config.bos_id first, as in training)."""
  bos, eos = model.config.bos_token_id, model.config.eos_token_id
  ids = torch.tensor([[bos] + list(prompt)])
  out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos)
  out = out[0, ids.shape[1]:].numpy()
  return np.pad(out, (0, new_tokens - len(out)))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_decoding_matches_hf_generate(saved, name):
  """Prompts of different lengths in one batch (each row continues from its own length:
  per-row RoPE offsets, cache slots and learned positions), compared row by row with HF's
  incremental generate (HF left-pads a batch; t5lite right-pads, so rows go one at a time).
  GPT-2 decodes up to the last row of its position table."""
  model, path = saved(name)
  config, params = t5lite.load_hf(path)
  rng = np.random.RandomState(2)
  lengths = [6, 2, 4]
  prompts = np.zeros((3, max(lengths)), np.int32)
  for row, n in enumerate(lengths):
    prompts[row, :n] = rng.randint(2, model.config.vocab_size, n)
  # BOS + 6 prompt tokens + 17 outputs fed back = 24 positions: exactly GPT-2's table.
  new_tokens = N_POSITIONS - max(lengths)
  ours = t5lite.generate(config, params, prompts, max_decode_length=new_tokens)
  assert ours.shape == (3, new_tokens)
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(ours[row], hf_greedy(model, prompts[row, :n], new_tokens),
                                  err_msg=f"row {row} (prompt of {n})")
  assert (config.bos_id, config.eos_id) == (model.config.bos_token_id,
                                            model.config.eos_token_id)
  assert not (ours == config.eos_id).any()  # no EOS: every row decodes all of its tokens
  assert len(set(ours[0].tolist())) > 3  # a varied continuation, not one repeated token


def test_learned_positions_are_not_read_past_the_table(saved):
  config, params = t5lite.load_hf(saved("gpt2")[1])
  prompts = np.full((1, 6), 5, np.int32)
  with pytest.raises(ConfigError, match="max_position_embeddings=24"):
    t5lite.generate(config, params, prompts, max_decode_length=N_POSITIONS - 6 + 1)


# --- refusals ---------------------------------------------------------------------------------

GPT2_JSON = dict(model_type="gpt2", vocab_size=97, n_embd=36, n_layer=2, n_head=3,
                 bos_token_id=96, eos_token_id=96)
LLAMA_JSON = dict(model_type="llama", vocab_size=97, hidden_size=36, intermediate_size=50,
                  num_hidden_layers=2, num_attention_heads=6)


@pytest.mark.parametrize("base, change, named", [
    (GPT2_JSON, dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (GPT2_JSON, dict(add_cross_attention=True), "add_cross_attention"),
    (GPT2_JSON, dict(activation_function="silu"), "activation_function"),
    (GPT2_JSON, dict(n_head=5), "n_head"),
    (LLAMA_JSON, dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0)),
     "rope_parameters.rope_type='linear'"),
    (LLAMA_JSON, dict(rope_scaling=dict(type="dynamic", factor=2.0)),
     "rope_scaling.rope_type='dynamic'"),
    (LLAMA_JSON, dict(attention_bias=True), "mlp_bias"),
    (LLAMA_JSON, dict(hidden_act="gelu"), "hidden_act"),
])
def test_import_refuses_what_t5lite_cannot_run(base, change, named):
  with pytest.raises(ConfigError, match=re.escape(named)):
    hf_export.config_from_hf({**base, **change})


def test_rope_theta_in_either_spelling():
  assert hf_export.config_from_hf({**LLAMA_JSON, "rope_theta": 5e5}).rope_theta == 5e5
  five_x = dict(rope_parameters=dict(rope_type="default", rope_theta=2e4))
  assert hf_export.config_from_hf({**LLAMA_JSON, **five_x}).rope_theta == 2e4
  assert hf_export.config_from_hf(LLAMA_JSON).rope_theta == 1e4


GPT2 = ModelConfig(architecture="decoder_only", family="gpt2", vocab_size=97, d_model=36,
                   d_ff=50, num_heads=3, d_kv=12, num_decoder_layers=1, mlp_activation="gelu",
                   norm="layer", use_bias=True, scale_attention=True,
                   position_encoding="learned", tie_output_embedding=True)
LLAMA = ModelConfig(architecture="decoder_only", family="llama", vocab_size=97, d_model=36,
                    d_ff=50, num_heads=6, num_key_value_heads=2, d_kv=8, num_decoder_layers=1,
                    mlp_activation="swiglu", scale_attention=True, position_encoding="rope")


@pytest.mark.parametrize("config, change, named", [
    (GPT2, dict(norm="rms"), "norm='rms'"),
    (GPT2, dict(position_encoding="rope"), "position_encoding='rope'"),
    (GPT2, dict(use_bias=False), "use_bias=False"),
    (GPT2, dict(num_key_value_heads=1), "num_key_value_heads=1"),
    (GPT2, dict(d_kv=8), "d_kv=8"),
    (GPT2, dict(mlp_activation="swiglu"), "mlp_activation='swiglu'"),
    (GPT2, dict(scale_logits=True), "scale_logits=True"),
    (LLAMA, dict(scale_attention=False), "scale_attention=False"),
    (LLAMA, dict(norm="layer"), "norm='layer'"),
    (LLAMA, dict(mlp_activation="gelu"), "mlp_activation='gelu'"),
    (LLAMA, dict(num_heads=5, num_key_value_heads=0), "num_heads=5"),
    (LLAMA, dict(prefix_lm=True), "prefix_lm=True"),
])
def test_export_refuses_what_hf_cannot_express(config, change, named):
  with pytest.raises(ConfigError, match=re.escape(named)):
    hf_export.config_to_hf(config.replace(**change))


def test_export_maps_the_options_hf_has():
  gpt2 = hf_export.config_to_hf(GPT2.replace(scale_attention=False, tie_output_embedding=False))
  assert gpt2["scale_attn_weights"] is False and gpt2["tie_word_embeddings"] is False
  assert hf_export.config_from_hf(gpt2) == GPT2.replace(
      scale_attention=False, tie_output_embedding=False, init_std=0.02)
  llama = hf_export.config_to_hf(LLAMA.replace(use_bias=True, rope_theta=5e5))
  assert llama["attention_bias"] and llama["mlp_bias"] and llama["num_key_value_heads"] == 2
  assert llama["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
  assert T.LlamaConfig.from_dict(llama).rope_parameters["rope_theta"] == 5e5
