"""Prompt tuning and prefix tuning against the peft library (t5lite.interop.peft.prompts).

Random soft prompts and prefixes (never zeros: they would prove nothing) on tiny random HF
models: t5lite's adapted logits equal peft's PeftModel on the HF base, for prompt tuning of
every family and prefix tuning of decoder-only models; peft's own adapters load into t5lite
with the same logits; packed rows, padding, scanned layers and KV-cache decoding agree with the
plain forward; merging and encoder-decoder prefix export are refused by name."""
import functools
import json

import jax
import numpy as np
import pytest
import torch
import peft
import transformers

import t5lite
from helpers import random_hf_models
from t5lite.errors import ConfigError
from t5lite.interop.peft import lora_merge
from t5lite.interop.peft import adapters as peft_io
from t5lite.families import family_of
from t5lite.models import adapters
from t5lite.models.adapters import AdapterConfig

pytestmark = pytest.mark.parity

T = transformers
V, N = 97, 3
MODELS = {
    "t5": (T.T5ForConditionalGeneration,
           lambda: T.T5Config(vocab_size=V, d_model=24, d_kv=8, num_heads=3, d_ff=40, num_layers=2,
                              num_decoder_layers=3, feed_forward_proj="gated-gelu",
                              dropout_rate=0.0)),
    "gpt2": (T.GPT2LMHeadModel,
             lambda: T.GPT2Config(vocab_size=V, n_embd=24, n_layer=2, n_head=3, n_inner=40,
                                  n_positions=32, bos_token_id=96, eos_token_id=96)),
    "llama": (T.LlamaForCausalLM,
              lambda: T.LlamaConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    intermediate_size=40)),
    "bert_cls": (T.BertForSequenceClassification,
                 lambda: T.BertConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2,
                                      num_attention_heads=3, intermediate_size=40,
                                      max_position_embeddings=32, num_labels=3)),
}
TASKS = {"t5": "SEQ_2_SEQ_LM", "gpt2": "CAUSAL_LM", "llama": "CAUSAL_LM", "bert_cls": "SEQ_CLS"}
PROMPT = AdapterConfig(method="prompt_tuning", num_virtual_tokens=N)
PREFIX = AdapterConfig(method="prefix_tuning", num_virtual_tokens=N)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """name -> (HF directory, t5lite config, params) of a random HF model, built once."""
  return random_hf_models(tmp_path_factory, MODELS)


def ids_for(seed=1, shape=(2, 7)):
  return np.random.RandomState(seed).randint(2, V, shape)


def random_adapter(config, saved=(), seed=0):
  rng = np.random.RandomState(seed)
  half = adapters.split(family_of(config).abstract_params(), saved)[1]
  return jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), half)


@functools.lru_cache(maxsize=None)
def jitted_logits(config):
  """The family's logits(params, batch), jitted once per config: one compiled program per
  input shape instead of one per operation (op by op, a cold cache compiles each op)."""
  return jax.jit(family_of(config).logits)


def ours(config, params, name, ids):
  if name == "t5":
    return t5lite.logits(config, params, ids, ids[:, ::-1])
  return np.asarray(jitted_logits(config)(params, {
      "decoder_input_tokens" if name in ("gpt2", "llama") else "encoder_input_tokens": ids}))


def theirs(model, name, ids):
  ids_t = torch.tensor(ids)
  with torch.no_grad():
    if name == "t5":
      out = model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t),
                  decoder_input_ids=torch.tensor(ids[:, ::-1].copy())).logits
    else:
      out = model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t)).logits
  out = out.numpy()
  # peft returns a causal LM's logits over the soft prompt too: the tokens' come last.
  return out[:, -ids.shape[1]:] if out.ndim == 3 else out


def assert_close(got, want, tolerance=1e-4):
  assert got.shape == want.shape, (got.shape, want.shape)
  error = np.abs(got - want).max() / max(1.0, np.abs(want).max())
  assert error <= tolerance, error


def load_in_peft(hf_dir, name, adapter_dir):
  hf_model = MODELS[name][0].from_pretrained(hf_dir).eval()
  model = peft.PeftModel.from_pretrained(hf_model, adapter_dir).eval()
  result = peft.set_peft_model_state_dict(model, peft.load_peft_weights(adapter_dir))
  # peft copies prompt_embeddings into its prompt encoder itself, then reports the key as
  # unexpected by the base's state dict; any other unexpected key is a naming error.
  assert set(result.unexpected_keys) <= {"prompt_embeddings"}, result.unexpected_keys
  return model


CASES = [("prompt", "t5"), ("prompt", "gpt2"), ("prompt", "llama"), ("prompt", "bert_cls"),
         ("prefix", "gpt2"), ("prefix", "llama")]


@pytest.mark.parametrize("kind, name", CASES)
def test_t5lite_adapters_load_in_peft_with_the_same_logits(base, tmp_path, kind, name):
  hf_dir, config, params = base(name)
  saved = (("head",),) if name == "bert_cls" else ()
  adapted = config.replace(adapter=PROMPT if kind == "prompt" else PREFIX)
  whole = adapters.combine(params, random_adapter(adapted, saved))
  ids = ids_for()
  want = ours(adapted, whole, name, ids)
  assert np.abs(want - ours(config, params, name, ids)).max() > 0.05  # the adapter matters
  files = peft_io.save(adapted, whole, str(tmp_path / "adapter"), saved_modules=saved)
  assert files == ["adapter_config.json", "adapter_model.safetensors"]
  settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert settings["peft_type"] == {"prompt": "PROMPT_TUNING", "prefix": "PREFIX_TUNING"}[kind]
  assert settings["task_type"] == TASKS[name] and settings["num_virtual_tokens"] == N
  model = load_in_peft(hf_dir, name, str(tmp_path / "adapter"))
  assert_close(theirs(model, name, ids), want)
  # And back: the same adapter.
  back, tree, back_saved = peft_io.load(str(tmp_path / "adapter"), config)
  assert back == adapted.adapter and back_saved == saved
  assert_close(ours(config.replace(adapter=back), adapters.combine(params, tree), name, ids),
               want, 1e-6)


@pytest.mark.parametrize("kind, name", [("prompt", "gpt2"), ("prefix", "llama"),
                                        ("prompt", "t5")])
def test_peft_adapters_load_into_t5lite(base, tmp_path, kind, name):
  """peft's own adapters (prefix tuning trained through its MLP) read by t5lite."""
  hf_dir, config, params = base(name)
  torch.manual_seed(3)
  hf_model = MODELS[name][0].from_pretrained(hf_dir).eval()
  if kind == "prompt":
    settings = peft.PromptTuningConfig(task_type=TASKS[name], num_virtual_tokens=N)
  else:
    settings = peft.PrefixTuningConfig(task_type=TASKS[name], num_virtual_tokens=N,
                                       prefix_projection=True, encoder_hidden_size=16)
  model = peft.get_peft_model(hf_model, settings)
  with torch.no_grad():
    for p in model.prompt_encoder.parameters():
      p.normal_(0, 0.5)
  model.save_pretrained(str(tmp_path / "adapter"))
  if name == "t5":  # 2n rows, the encoder's first: a warning says the rest are dropped
    with pytest.warns(UserWarning, match="reads the first n"):
      adapter, tree, _ = peft_io.load(str(tmp_path / "adapter"), config)
  else:
    adapter, tree, _ = peft_io.load(str(tmp_path / "adapter"), config)
  ids = ids_for(2)
  model = load_in_peft(hf_dir, name, str(tmp_path / "adapter"))
  if name == "t5":  # peft's seq2seq forward also prompts the decoder; its generate feeds
    # the encoder alone the first n rows: that is the model t5lite reads.
    hf_model = model.get_base_model()
    with torch.no_grad():
      prompts = model.get_prompt(batch_size=ids.shape[0])[:, :N]
      embeds = torch.cat([prompts, hf_model.get_input_embeddings()(torch.tensor(ids))], 1)
      want = hf_model(inputs_embeds=embeds,
                      decoder_input_ids=torch.tensor(ids[:, ::-1].copy())).logits.numpy()
    assert_close(ours(config.replace(adapter=adapter), adapters.combine(params, tree), name,
                      ids), want)
    return
  assert_close(ours(config.replace(adapter=adapter), adapters.combine(params, tree), name, ids),
               theirs(model, name, ids))


@pytest.mark.parametrize("adapter", [PROMPT, PREFIX])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_packed_rows_equal_each_example_alone(base, adapter, name):
  """A soft prompt or prefix before every packed example of a decoder: a row of two packed
  examples gives each one's logits as it alone would."""
  _, config, params = base(name)
  adapted = config.replace(adapter=adapter)
  whole = adapters.combine(params, random_adapter(adapted))
  a, b = ids_for(4, (1, 5)), ids_for(5, (1, 4))
  apply = jax.jit(family_of(adapted).make_model().apply)
  packed = apply({"params": whole}, np.concatenate([a, b], 1),
                 decoder_segment_ids=np.array([[1] * 5 + [2] * 4]),
                 decoder_positions=np.array([list(range(5)) + list(range(4))]))
  alone = [apply({"params": whole}, x) for x in (a, b)]
  assert_close(np.asarray(packed), np.concatenate([np.asarray(x) for x in alone], 1), 1e-5)


@pytest.mark.parametrize("adapter", [PROMPT, PREFIX])
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_decoding_with_the_cache_equals_the_forward(base, adapter, name):
  """Greedy decoding (KV cache: prompt in the first slots, prefix before them) gives the
  tokens the full forward would choose; ragged prompts decode as they would alone."""
  _, config, params = base(name)
  adapted = config.replace(adapter=adapter)
  whole = adapters.combine(params, random_adapter(adapted, seed=1))
  prompts = ids_for(6, (2, 5))
  prompts[1, 3:] = 0  # a shorter second prompt
  out = t5lite.generate(adapted, whole, prompts, max_decode_length=4)
  # Alone: the first row twice, in the batch's shape (the program just compiled), and the
  # second unpadded.
  alone = [t5lite.generate(adapted, whole, prompts[[0, 0]], max_decode_length=4)[:1],
           t5lite.generate(adapted, whole, prompts[1:2, :3], max_decode_length=4)]
  for row in range(2):
    np.testing.assert_array_equal(out[row:row + 1], alone[row])
  # Teacher-forced scoring (the forward) of the decoded tokens picks the same argmax.
  row = prompts[:1]
  if name == "t5":
    logits = t5lite.logits(adapted, whole, row, np.pad(out[:1, :-1], ((0, 0), (1, 0))))
  else:
    tokens = np.concatenate([[[adapted.bos_id]], row, out[:1, :-1]], 1)
    logits = ours(adapted, whole, name, tokens)[:, row.shape[1]:]
  np.testing.assert_array_equal(np.argmax(logits, -1), out[:1])


def test_scanned_layers_give_the_same_logits(base):
  _, config, params = base("llama")
  adapted = config.replace(adapter=PREFIX)
  whole = adapters.combine(params, random_adapter(adapted))
  from t5lite.models.params import scan_params
  scanned = adapted.replace(scan_layers=True)
  ids = ids_for()
  assert_close(ours(scanned, scan_params(whole, scanned), "llama", ids),
               ours(adapted, whole, "llama", ids), 1e-6)


def test_merge_and_encoder_decoder_prefix_export_are_refused(base, tmp_path):
  _, config, params = base("t5")
  prompted = config.replace(adapter=PROMPT)
  with pytest.raises(ConfigError, match="cannot be merged"):
    lora_merge.merge(prompted, adapters.combine(params, random_adapter(prompted)))
  prefixed = config.replace(adapter=PREFIX)
  with pytest.raises(ConfigError, match="Li and Liang"):
    peft_io.save(prefixed, adapters.combine(params, random_adapter(prefixed)),
                 str(tmp_path / "adapter"))


def test_a_prompt_of_another_width_is_refused(base, tmp_path):
  _, config, params = base("gpt2")
  adapted = config.replace(adapter=PROMPT)
  peft_io.save(adapted, adapters.combine(params, random_adapter(adapted)), str(tmp_path / "a"))
  _, other, _ = base("t5")
  with pytest.raises(ConfigError, match="24 wide"):
    peft_io.load(str(tmp_path / "a"), other.replace(d_model=32))


@pytest.mark.parametrize("kind, name", [("prompt", "bert_cls"), ("prefix", "gpt2")])
def test_cli_import_then_export_gives_back_the_same_tensors(base, tmp_path, capsys, kind, name):
  """peft's adapter -> `t5lite import peft` (a RUN_DIR on a t5lite MODEL_DIR base) -> `t5lite
  export peft`: the same tensors; `export hf --merge` of it is refused, exit 2."""
  import os

  import safetensors.numpy

  from t5lite import cli
  from t5lite.interop import params_only
  hf_dir, config, params = base(name)
  torch.manual_seed(4)
  settings = (peft.PromptTuningConfig(task_type=TASKS[name], num_virtual_tokens=N)
              if kind == "prompt" else
              peft.PrefixTuningConfig(task_type=TASKS[name], num_virtual_tokens=N))
  model = peft.get_peft_model(MODELS[name][0].from_pretrained(hf_dir), settings)
  with torch.no_grad():
    for p in model.parameters():
      if p.requires_grad:  # the prompt, and a classifier's saved head
        p.normal_(0, 0.5)
  model.save_pretrained(str(tmp_path / "adapter"))
  home = str(tmp_path / "base")
  params_only.write_model_dir(home, config, params, step=0, vocabulary=None)
  run, out = str(tmp_path / "run"), str(tmp_path / "out")
  assert cli.main(["import", "peft", "--from", str(tmp_path / "adapter"), "--base", home,
                   "--out", run]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["method"] == f"{kind}_tuning" and summary["num_virtual_tokens"] == N
  assert summary["saved_modules"] == (["head"] if name == "bert_cls" else [])
  assert cli.main(["export", "peft", "--checkpoint", run, "--out", out]) == 0
  before = safetensors.numpy.load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  after = safetensors.numpy.load_file(os.path.join(out, "adapter_model.safetensors"))
  assert sorted(before) == sorted(after)
  for key in before:
    np.testing.assert_allclose(after[key], before[key], rtol=1e-6, err_msg=key)
  capsys.readouterr()
  assert cli.main(["export", "hf", "--merge", "--checkpoint", run,
                   "--out", str(tmp_path / "merged")]) == 2
  assert "cannot be merged" in capsys.readouterr().err
