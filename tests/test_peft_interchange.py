"""peft library interchange (t5lite.interop.peft.lora, `t5lite export peft`, `t5lite import
peft`, `t5lite export hf --merge`).

Tiny random HF models of each family (T5, GPT-2, LLaMA, BERT MLM, a RoBERTa classifier whose
head is a saved module) against the peft library itself: t5lite LoRAs with random A and B
(an untrained B = 0 would prove nothing) written by save_peft load into peft.PeftModel with
no missing or unexpected keys and the same logits; peft's own LoRAs (fused GPT-2 c_attn, rank
3, rsLoRA, a layer subset, scan_layers=True) load into t5lite with the same logits; merging
equals the adapted model; one LoRA training step's loss and gradients equal PyTorch's in
peft; the CLI round trip gives back the same tensors; bad input is refused
by name."""
import json
import os
import warnings

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import peft
import transformers

import t5lite
from helpers import random_hf_models
from helpers.cli import run_t5lite
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.interop.peft import lora_merge
from t5lite.interop import params_only
from t5lite.interop.peft import lora as peft_format
from t5lite.interop.peft import record as peft_record
from t5lite.families import family_of
from t5lite.families.peft import Peft, PeftConfig
from t5lite.models import adapters
from t5lite.models.adapters import AdapterConfig

pytestmark = pytest.mark.parity

T = transformers
V = 97
# name: (model class, config, AutoModel class). Biases and norms perturbed in make_hf.
MODELS = {
    "t5": (T.T5ForConditionalGeneration,
           lambda: T.T5Config(vocab_size=V, d_model=24, d_kv=8, num_heads=3, d_ff=40, num_layers=2,
                              num_decoder_layers=2, feed_forward_proj="gated-gelu",
                              dropout_rate=0.0),
           T.AutoModelForSeq2SeqLM),
    "gpt2": (T.GPT2LMHeadModel,
             lambda: T.GPT2Config(vocab_size=V, n_embd=24, n_layer=2, n_head=3, n_inner=40,
                                  n_positions=32, bos_token_id=96, eos_token_id=96),
             T.AutoModelForCausalLM),
    "llama": (T.LlamaForCausalLM,
              lambda: T.LlamaConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    intermediate_size=40),
              T.AutoModelForCausalLM),
    "bert": (T.BertForMaskedLM,
             lambda: T.BertConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2,
                                  num_attention_heads=3, intermediate_size=40,
                                  max_position_embeddings=32),
             T.AutoModelForMaskedLM),
    "roberta_cls": (T.RobertaForSequenceClassification,
                    lambda: T.RobertaConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2,
                                            num_attention_heads=3, intermediate_size=40,
                                            max_position_embeddings=32, type_vocab_size=1,
                                            num_labels=3),
                    T.AutoModelForSequenceClassification),
}
HEAD = (("head",),)  # the classifier's saved module


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """name -> (HF directory, t5lite config, params) of a random HF model, built once."""
  return random_hf_models(tmp_path_factory, MODELS)


def ids_for(seed=1):
  """Inputs (B, L) without ids 0 and 1 (pads; RoBERTa numbers positions past 1)."""
  return np.random.RandomState(seed).randint(2, V, (2, 7))


def ours(config, params, name, ids):
  if name == "t5":
    return t5lite.logits(config, params, ids, ids[:, ::-1])
  return t5lite.logits(config, params, ids)


def theirs(model, name, ids):
  kwargs = {"decoder_input_ids": torch.tensor(ids[:, ::-1].copy())} if name == "t5" else {}
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), **kwargs).logits.numpy()


def assert_close(got, want, tolerance=1e-4):
  assert got.shape == want.shape
  error = np.abs(got - want).max() / max(1.0, np.abs(want).max())
  assert error <= tolerance, error


def random_adapter(config, saved=(), seed=0):
  """Random LoRA A and B (and saved modules) for an adapted config."""
  rng = np.random.RandomState(seed)
  half = adapters.split(family_of(config).abstract_params(), saved)[1]
  return jax.tree.map(lambda s: (rng.normal(0, 0.3, s.shape)).astype(s.dtype), half)


def load_in_peft(hf_dir, auto, adapter_dir):
  """peft.PeftModel of an adapter directory on its HF base, refused on missing or unexpected
  adapter keys (peft only warns)."""
  hf_model = auto.from_pretrained(hf_dir)
  config = peft.PeftConfig.from_pretrained(adapter_dir)
  if not hasattr(hf_model, "_prepare_encoder_decoder_kwargs_for_generation"):
    # peft 0.21's PeftModelForSeq2SeqLM reads a method transformers 5.x removed: a plain
    # PeftModel runs the same forward.
    config.task_type = None
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model = peft.PeftModel.from_pretrained(hf_model, adapter_dir, config=config).eval()
  assert not [str(w.message) for w in caught if "adapter keys" in str(w.message)]
  result = peft.set_peft_model_state_dict(model, peft.load_peft_weights(adapter_dir))
  assert not result.unexpected_keys, result.unexpected_keys
  mine = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
  assert not mine, mine
  return model


# --- t5lite -> peft ---------------------------------------------------------------------------

SAVE_CASES = {  # name: (AdapterConfig, saved modules)
    "t5": (AdapterConfig(r=4, lora_alpha=8.0, target_modules=("all-linear",)), ()),
    # q and v of the fused c_attn (k without LoRA: zero rows of B), and the MLP's c_fc.
    "gpt2": (AdapterConfig(r=2, lora_alpha=5.0, target_modules=("query", "value", "mlp/wi")), ()),
    "llama": (AdapterConfig(r=3, lora_alpha=4.0, use_rslora=True,
                            target_modules=("query", "key", "out", "wi_0")), ()),
    # `dense` names four kinds of modules: one of them needs full module paths.
    "bert": (AdapterConfig(r=2, lora_alpha=2.0,
                           target_modules=("value", "mlp/wi", "layers_1/attention/out")), ()),
    "roberta_cls": (AdapterConfig(r=2, lora_alpha=4.0, target_modules=("query", "value")), HEAD),
}


@pytest.mark.parametrize("name", list(SAVE_CASES))
def test_save_peft_loads_in_peft_with_the_same_logits(base, tmp_path, name):
  hf_dir, config, params = base(name)
  adapter, saved = SAVE_CASES[name]
  adapted = config.replace(adapter=adapter)
  whole = adapters.combine(params, random_adapter(adapted, saved))
  ids = ids_for()
  want = ours(adapted, whole, name, ids)
  assert np.abs(want - ours(config, params, name, ids)).max() > 0.05  # the LoRA matters

  t5lite.save_hf(config, params, str(tmp_path / "hf"))  # the base, as t5lite exports it
  files = peft_format.save_peft(adapted, whole, str(tmp_path / "adapter"), saved_modules=saved)
  assert files == ["adapter_config.json", "adapter_model.safetensors"]
  model = load_in_peft(str(tmp_path / "hf"), MODELS[name][2], str(tmp_path / "adapter"))
  assert_close(theirs(model, name, ids), want)

  settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert (settings["r"], settings["lora_alpha"], settings["use_rslora"]) == (
      adapter.r, adapter.lora_alpha, adapter.use_rslora)
  if name == "gpt2":  # one LoRA per c_attn of rank 2 x r: q and v blocks, k zero
    assert settings["fan_in_fan_out"] and settings["rank_pattern"] == {"c_attn": 4}
    assert settings["alpha_pattern"] == {"c_attn": 10.0}
  if name == "bert":
    assert "value" in settings["target_modules"]
    assert "bert.encoder.layer.1.attention.output.dense" in settings["target_modules"]
  if name == "roberta_cls":
    assert settings["task_type"] == "SEQ_CLS" and settings["modules_to_save"] == ["classifier"]
  # And back: the same adapter.
  back, tree, back_saved = peft_format.load_peft(str(tmp_path / "adapter"), config)
  assert back_saved == saved and (back.r, back.lora_alpha) == (adapter.r, adapter.lora_alpha)
  assert_close(ours(config.replace(adapter=back), adapters.combine(params, tree), name, ids),
               want, 1e-6)


def test_task_types():
  assert peft_format.task_type(t5lite.ModelConfig()) == "SEQ_2_SEQ_LM"
  assert peft_format.task_type(t5lite.ModelConfig(architecture="decoder_only")) == "CAUSAL_LM"
  assert peft_format.task_type(t5lite.ModelConfig(architecture="encoder_only")) is None


@pytest.mark.parametrize("length", [9, 16])
def test_one_lora_step_equals_a_torch_rederivation_in_peft(base, tmp_path, length):
  """One MLM training step of a LoRA (rank 2 on query, value and the MLP's first dense) on a
  frozen BERT, against PyTorch in float64 on peft's LoraModel over HF's BertForMaskedLM for
  the same base, adapter and batch: the loss and the gradient of every lora_A and lora_B
  within 1e-5."""
  hf_dir, config, params = base("bert")
  adapter = AdapterConfig(r=2, lora_alpha=4.0, target_modules=("query", "value", "mlp/wi"))
  adapted = config.replace(adapter=adapter, dropout_rate=0.0)
  family = Peft.wrap(family_of(adapted), PeftConfig(base=hf_dir, adapter=adapter))
  lora = random_adapter(adapted, seed=3)
  rng = np.random.RandomState(length)
  original = rng.randint(5, V, (3, length))
  weights = (rng.rand(3, length) < 0.3).astype(np.float32)
  weights[:, 1] = 1
  real = np.ones((3, length), np.int32)
  real[-1, length - 3:] = 0
  original, weights = original * real, weights * real
  batch = dict(encoder_input_tokens=np.where(weights > 0, 4, original).astype(np.int32),
               mlm_target_tokens=original.astype(np.int32), mlm_loss_weights=weights,
               encoder_segment_ids=real)

  def mean_loss(half):
    loss_sum, sums = family.loss_fn(half, batch, jax.random.key(0), fixed_params=params)
    return loss_sum / sums["normalizer"]
  loss, grads = jax.jit(jax.value_and_grad(mean_loss))(lora)

  peft_format.save_peft(adapted, adapters.combine(params, lora), str(tmp_path / "adapter"))
  model = load_in_peft(hf_dir, T.AutoModelForMaskedLM, str(tmp_path / "adapter")).double()
  for name, param in model.named_parameters():  # loaded for inference: train the LoRAs
    param.requires_grad_("lora_" in name)
  logits = model(input_ids=torch.tensor(batch["encoder_input_tokens"]),
                 attention_mask=torch.tensor(real)).logits
  nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2),
                                          torch.tensor(original, dtype=torch.long),
                                          reduction="none")
  expected = (nll * torch.tensor(weights, dtype=torch.float64)).sum() / weights.sum()
  expected.backward()
  assert float(loss) == pytest.approx(expected.item(), rel=1e-5)

  # t5lite's gradients written as an adapter: peft's names and layout for each lora_A / lora_B.
  peft_format.save_peft(adapted, adapters.combine(params, grads), str(tmp_path / "grads"))
  ours = safetensors.numpy.load_file(str(tmp_path / "grads" / "adapter_model.safetensors"))
  trained = {name.replace(".default", ""): p for name, p in model.named_parameters()
             if p.requires_grad}
  assert sorted(trained) == sorted(ours) and len(ours) == 2 * 3 * 2  # A, B x 3 modules x 2 layers
  for name, param in trained.items():
    expected_grad = param.grad.numpy()
    np.testing.assert_allclose(ours[name], expected_grad, rtol=0, err_msg=name,
                               atol=1e-5 * max(1.0, np.abs(expected_grad).max()))


# --- peft -> t5lite ---------------------------------------------------------------------------

LOAD_CASES = {  # case: (model, LoraConfig kwargs, load with scan_layers)
    "gpt2_c_attn_rank3": ("gpt2", dict(r=3, lora_alpha=7, target_modules=["c_attn", "c_proj"],
                                       fan_in_fan_out=True), False),
    "t5_scanned": ("t5", dict(r=2, lora_alpha=4, target_modules=["q", "k", "v", "o", "wi_0",
                                                                 "wi_1", "wo"]), True),
    "llama_rslora": ("llama", dict(r=4, lora_alpha=6, use_rslora=True,
                                   target_modules=["q_proj", "v_proj", "down_proj"]), False),
    "bert_one_layer": ("bert", dict(r=2, lora_alpha=2, target_modules=["query", "value"],
                                    layers_to_transform=[1]), False),
    "roberta_head": ("roberta_cls", dict(r=2, lora_alpha=4, target_modules=["query", "value"],
                                         task_type="SEQ_CLS"), False),
}


def peft_adapter(hf_dir, name, kwargs, out, seed=0):
  """A peft LoRA with random A and B (and saved modules) saved at out; returns its model."""
  torch.manual_seed(seed)
  model = peft.get_peft_model(MODELS[name][2].from_pretrained(hf_dir),
                              peft.LoraConfig(**kwargs)).eval()
  with torch.no_grad():
    for key, p in model.named_parameters():
      if "lora_" in key or "modules_to_save" in key:
        p.copy_(torch.randn_like(p) * 0.3)
  model.save_pretrained(out)
  return model


@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_peft_adapters_load_into_t5lite_with_the_same_logits(base, tmp_path, case):
  name, kwargs, scan = LOAD_CASES[case]
  hf_dir, config, params = base(name)
  model = peft_adapter(hf_dir, name, kwargs, str(tmp_path / "adapter"))
  ids = ids_for()
  want = theirs(model, name, ids)
  if scan:
    config, params = t5lite.load_hf(hf_dir, scan_layers=True)
  adapter, tree, saved = peft_format.load_peft(str(tmp_path / "adapter"), config)
  assert (adapter.r, adapter.use_rslora) == (kwargs["r"], kwargs.get("use_rslora", False))
  adapted = config.replace(adapter=adapter)
  got = ours(adapted, adapters.combine(params, tree), name, ids)
  assert_close(got, want)
  assert np.abs(got - ours(config, params, name, ids)).max() > 0.05
  if case == "gpt2_c_attn_rank3":  # q, k and v share c_attn's A; c_proj: attention out, MLP wo
    assert adapter.target_modules == ("key", "out", "query", "value", "wo")
    layer = tree["decoder"]["layers_1"]["attention"]
    np.testing.assert_array_equal(layer["query"]["lora_a"], layer["value"]["lora_a"])
    assert len(jax.tree.leaves(tree)) == 2 * 5 * 2
  if case == "t5_scanned":
    assert adapter.target_modules == ("all-linear",)
    assert tree["encoder"]["layers"]["attention"]["query"]["lora_a"].shape == (2, 24, 2)
  if case == "bert_one_layer":
    assert all("layers_1" in t for t in adapter.target_modules), adapter.target_modules
  if case == "roberta_head":
    assert saved == HEAD and set(tree["head"]) == {"dense", "classifier"}


def test_scanned_base_refuses_an_adapter_of_some_layers(base, tmp_path):
  hf_dir, _, _ = base("bert")
  peft_adapter(hf_dir, "bert", dict(r=2, target_modules=["query"], layers_to_transform=[0]),
               str(tmp_path / "adapter"))
  config, _ = t5lite.load_hf(hf_dir, scan_layers=True)
  with pytest.raises(ConfigError, match=r"attention/query in layers \[0\] of 2 only.*"
                     "scan_layers=False"):
    peft_format.load_peft(str(tmp_path / "adapter"), config)


# --- merge ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, scan", [("gpt2", False), ("t5", True)])
def test_merge_equals_the_adapted_model(base, name, scan):
  hf_dir, config, params = base(name)
  if scan:
    config, params = t5lite.load_hf(hf_dir, scan_layers=True)
  adapted = config.replace(adapter=SAVE_CASES[name][0])
  whole = adapters.combine(params, random_adapter(adapted))
  merged_config, merged = lora_merge.merge(adapted, whole)
  assert merged_config == config
  assert jax.tree.structure(merged) == jax.tree.structure(params)
  ids = ids_for()
  assert_close(ours(config, merged, name, ids), ours(adapted, whole, name, ids), 1e-5)


def test_export_hf_merge_loads_in_transformers(base, tmp_path, capsys):
  hf_dir, config, params = base("roberta_cls")
  adapted = config.replace(adapter=SAVE_CASES["roberta_cls"][0])
  whole = adapters.combine(params, random_adapter(adapted, HEAD))
  run = str(tmp_path / "run")
  params_only.write_model_dir(run, adapted, whole, step=0, vocabulary=None)
  out = str(tmp_path / "hf")
  assert cli.main(["export", "hf", "--checkpoint", run, "--out", out]) == 2
  error = capsys.readouterr().err
  assert "export peft" in error and "--merge" in error and not os.path.exists(out)
  assert cli.main(["export", "hf", "--merge", "--checkpoint", run, "--out", out]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["merged_lora"]
  model, info = T.AutoModelForSequenceClassification.from_pretrained(out,
                                                                     output_loading_info=True)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  ids = ids_for()
  assert_close(theirs(model.eval(), "roberta_cls", ids), ours(adapted, whole, "roberta_cls", ids))


# --- CLI --------------------------------------------------------------------------------------

def base_dir(base, name, path):
  """A t5lite MODEL_DIR of the model's base params."""
  _, config, params = base(name)
  params_only.write_model_dir(path, config, params, step=0, vocabulary=None)
  return str(path)


@pytest.mark.parametrize("name, kwargs", [
    ("gpt2", dict(r=3, lora_alpha=7, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)),
    ("roberta_cls", dict(r=2, lora_alpha=4, target_modules=["query", "value"],
                         task_type="SEQ_CLS"))])
def test_cli_import_then_export_gives_back_the_same_tensors(base, tmp_path, capsys, name,
                                                            kwargs):
  hf_dir, config, params = base(name)
  model = peft_adapter(hf_dir, name, kwargs, str(tmp_path / "adapter"))
  home = base_dir(base, name, tmp_path / "base")
  run, out = str(tmp_path / "run"), str(tmp_path / "out")
  assert cli.main(["import", "peft", "--from", str(tmp_path / "adapter"), "--base", home,
                   "--out", run]) == 0
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["r"] == kwargs["r"] and summary["saved_modules"] == (
      ["head"] if name == "roberta_cls" else [])
  assert json.loads(open(os.path.join(run, "peft.json")).read())["base"] == home
  run_config, whole, _ = peft_record.load_run(run)  # joined with the base, fingerprint checked
  assert run_config.adapter.r == kwargs["r"]
  ids = ids_for()
  assert_close(ours(run_config, jax.device_get(whole), name, ids), theirs(model, name, ids))

  assert cli.main(["export", "peft", "--checkpoint", run, "--out", out]) == 0
  before = safetensors.numpy.load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  after = safetensors.numpy.load_file(os.path.join(out, "adapter_model.safetensors"))
  assert sorted(before) == sorted(after)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  settings = json.loads(open(os.path.join(out, "adapter_config.json")).read())
  assert (settings["r"], settings["lora_alpha"]) == (kwargs["r"], kwargs["lora_alpha"])
  assert sorted(settings["target_modules"]) == sorted(kwargs["target_modules"])


def rewrite(adapter_dir, change):
  """The adapter's tensors, changed by change(dict) in place and saved again."""
  path = os.path.join(adapter_dir, "adapter_model.safetensors")
  tensors = safetensors.numpy.load_file(path)
  change(tensors)
  safetensors.numpy.save_file(tensors, path, metadata={"format": "pt"})


def test_bad_adapters_are_refused_by_name(base, tmp_path, capsys):
  hf_dir, config, _ = base("gpt2")
  good = str(tmp_path / "adapter")
  peft_adapter(hf_dir, "gpt2", dict(r=2, target_modules=["c_attn"], fan_in_fan_out=True), good)
  key = "base_model.model.transformer.h.0.attn.c_attn.lora_{}.weight"

  def big_rank(t):  # rank 25 > the 24 x 24 kernels' smaller side
    t[key.format("A")] = np.ones((25, 24), np.float32)
    t[key.format("B")] = np.ones((72, 25), np.float32)
  rewrite(good, big_rank)
  with pytest.raises(ConfigError, match=r"transformer.h.0.attn.c_attn's LoRA rank 25 is larger "
                     r"than decoder/layers_0/attention/query's smaller side \(24 x 24\)"):
    peft_format.load_peft(good, config)
  home = base_dir(base, "gpt2", tmp_path / "base")
  assert cli.main(["import", "peft", "--from", good, "--base", home,
                   "--out", str(tmp_path / "run")]) == 2
  assert "rank 25" in capsys.readouterr().err

  def unknown(t):
    t[key.format("A")] = np.ones((2, 24), np.float32)
    t[key.format("B")] = np.ones((72, 2), np.float32)
    t["base_model.model.transformer.h.7.attn.c_attn.lora_A.weight"] = np.ones((2, 24))
  rewrite(good, unknown)
  with pytest.raises(ConfigError, match=r"transformer.h.7.attn.c_attn.lora_A.weight maps to no "
                     "kernel"):
    peft_format.load_peft(good, config)

  def ranks(t):
    del t["base_model.model.transformer.h.7.attn.c_attn.lora_A.weight"]
    t[key.format("A")] = np.ones((3, 24), np.float32)
    t[key.format("B")] = np.ones((72, 3), np.float32)
  rewrite(good, ranks)
  with pytest.raises(ConfigError, match="different ranks.*rank 2: .*rank 3: "):
    peft_format.load_peft(good, config)

  settings = json.loads(open(os.path.join(good, "adapter_config.json")).read())
  with open(os.path.join(good, "adapter_config.json"), "w") as f:
    json.dump({**settings, "peft_type": "IA3"}, f)
  with pytest.raises(ConfigError, match="peft_type='IA3'; t5lite reads LORA, PROMPT_TUNING, "
                     "PREFIX_TUNING adapters"):
    peft_format.load_peft(good, config)
  with open(os.path.join(good, "adapter_config.json"), "w") as f:
    json.dump({**settings, "use_dora": True}, f)
  with pytest.raises(ConfigError, match="use_dora=True has no t5lite equivalent"):
    peft_format.load_peft(good, config)


SETTINGS_CASES = [
    ({"lora_alpha": "abc"}, r"lora_alpha 'abc' is not a finite number"),
    ({"lora_alpha": 1e308}, r"lora_alpha 1e\+308 is not a finite number float32 can hold"),
    ({"lora_dropout": "x"}, r"lora_dropout 'x' is not a probability in \[0, 1\)"),
    ({"alpha_pattern": {"(": 3}}, r"alpha_pattern key '\(' is not a regular expression"),
    ({"alpha_pattern": [1, 2]}, r"alpha_pattern is a JSON list"),
    ({"alpha_pattern": {"c_attn": "big"}}, r"alpha_pattern\['c_attn'\] 'big' is not a finite"),
    ({"use_rslora": "no"}, r"use_rslora 'no' is not true or false"),
    ({"r": 0}, r": r 0 is not a positive integer rank")]


def _rank_zero(t):
  t[LORA_KEY.format("A")] = np.ones((0, 24), np.float32)
  t[LORA_KEY.format("B")] = np.ones((72, 0), np.float32)


def _zero_d(t):
  t[LORA_KEY.format("A")] = np.array(1.0, np.float32)


def _all_nan(t):
  t[LORA_KEY.format("B")] = np.full_like(t[LORA_KEY.format("B")], np.nan)


LORA_KEY = "base_model.model.transformer.h.0.attn.c_attn.lora_{}.weight"
TENSOR_CASES = [(_rank_zero, r"lora_A.weight has shape \(0, 24\); a LoRA weight is a"),
                (_zero_d, r"lora_A.weight has shape \(\); a LoRA weight is a"),
                (_all_nan, r"lora_B.weight holds NaN or inf values")]


def test_crafted_settings_and_tensors_are_refused_in_one_line(base, tmp_path, capsys):
  """Each field or tensor peft would write otherwise: one ConfigError naming it (exit 2 from
  `t5lite import peft`), never a traceback or a silent misreading."""
  hf_dir, config, _ = base("gpt2")
  good = str(tmp_path / "adapter")
  peft_adapter(hf_dir, "gpt2", dict(r=2, target_modules=["c_attn"], fan_in_fan_out=True), good)
  settings_file = os.path.join(good, "adapter_config.json")
  settings = json.loads(open(settings_file).read())
  for change, message in SETTINGS_CASES:
    with open(settings_file, "w") as f:
      json.dump({**settings, **change}, f)
    with pytest.raises(ConfigError, match=message):
      peft_format.load_peft(good, config)
  with open(settings_file, "w") as f:
    json.dump(settings, f)
  weights = os.path.join(good, "adapter_model.safetensors")
  original = open(weights, "rb").read()
  for change, message in TENSOR_CASES:
    with open(weights, "wb") as f:
      f.write(original)
    rewrite(good, change)
    with pytest.raises(ConfigError, match=message):
      peft_format.load_peft(good, config)
  home = base_dir(base, "gpt2", tmp_path / "base")
  capsys.readouterr()
  assert cli.main(["import", "peft", "--from", good, "--base", home,
                   "--out", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert "holds NaN or inf values" in err and "Traceback" not in err
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_changed_base_and_plain_runs_are_refused(base, tmp_path, capsys):
  hf_dir, config, params = base("gpt2")
  peft_adapter(hf_dir, "gpt2", dict(r=2, target_modules=["c_attn"], fan_in_fan_out=True),
               str(tmp_path / "adapter"))
  home = base_dir(base, "gpt2", tmp_path / "base")
  run = str(tmp_path / "run")
  assert cli.main(["import", "peft", "--from", str(tmp_path / "adapter"), "--base", home,
                   "--out", run]) == 0
  capsys.readouterr()
  # The base is retrained (rewritten with other params): its adapters no longer apply.
  import shutil
  shutil.rmtree(home)
  changed = jax.tree.map(lambda x: np.asarray(x) * 1.01, params)
  params_only.write_model_dir(home, config, changed, step=0, vocabulary=None)
  with pytest.raises(ConfigError, match="fingerprint"):
    peft_record.load_run(run)
  assert cli.main(["export", "peft", "--checkpoint", run, "--out",
                   str(tmp_path / "out")]) == 2
  assert "fingerprint" in capsys.readouterr().err
  # A plain model has nothing to export as peft, and is no base to import onto a LoRA run.
  assert cli.main(["export", "peft", "--checkpoint", home, "--out", str(tmp_path / "o2")]) == 2
  assert "holds no adapters" in capsys.readouterr().err
  assert cli.main(["import", "peft", "--from", str(tmp_path / "adapter"), "--base", run,
                   "--out", str(tmp_path / "run2")]) == 2
  assert "itself a LoRA model" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_subprocess_round_trip(base, tmp_path):
  """`t5lite import peft` and `t5lite export peft` as commands."""
  hf_dir, _, _ = base("llama")
  peft_adapter(hf_dir, "llama", dict(r=2, target_modules=["q_proj", "v_proj"]),
               str(tmp_path / "adapter"))
  home = base_dir(base, "llama", tmp_path / "base")
  for argv in (["import", "peft", "--from", str(tmp_path / "adapter"), "--base", home,
                "--out", str(tmp_path / "run")],
               ["export", "peft", "--checkpoint", str(tmp_path / "run"), "--out",
                str(tmp_path / "out")]):
    done = run_t5lite(*argv, timeout=600)
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout.strip().splitlines()[-1])
  before = safetensors.numpy.load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  after = safetensors.numpy.load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
  assert all(np.array_equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
