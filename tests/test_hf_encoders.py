"""HF parity of the encoder layouts: BERT (BertForPreTraining: MLM + next-sentence), RoBERTa
(RobertaForMaskedLM) and ALBERT (AlbertForPreTraining: factorized embeddings, shared layer
groups, MLM + sentence-order). Random HF models of odd shapes load into t5lite with the same
logits, t5lite writes files transformers loads with no missing, unexpected or mismatched
keys, bad input is refused by name, and parameter counts equal HF's."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import t5lite
from helpers.hf_models import CASES, T, make_hf_model
from helpers.cli import run_t5lite
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.interop.hf import layout as hf_layout
from t5lite.interop import params_only
from t5lite.models.config import ModelConfig

pytestmark = pytest.mark.parity


def inputs(model, seed=1):
  # No id 1: RoBERTa numbers positions past its padding id (1), t5lite always from 0.
  rng = np.random.RandomState(seed)
  return (rng.randint(2, model.config.vocab_size, (2, 17)),
          rng.randint(0, model.config.type_vocab_size, (2, 17)))


def hf_outputs(model, ids, types):
  """(MLM logits, sentence logits or None) of an HF model."""
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), token_type_ids=torch.tensor(types))
  mlm = getattr(out, "prediction_logits", None)
  mlm = out.logits if mlm is None else mlm
  sentence = getattr(out, "seq_relationship_logits", getattr(out, "sop_logits", None))
  return mlm.numpy(), None if sentence is None else sentence.numpy()


def ours(config, params, ids, types):
  sentence = (t5lite.sentence_logits(config, params, ids, token_type_ids=types)
              if config.sentence_classes else None)
  return t5lite.logits(config, params, ids, token_type_ids=types), sentence


def assert_parity(got, reference):
  for a, b in zip(got, reference):
    assert (a is None) == (b is None)
    if b is not None:
      assert a.shape == b.shape
      assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def loads_cleanly(auto_cls, path, model_cls):
  model, info = auto_cls.from_pretrained(path, output_loading_info=True)
  assert type(model) is model_cls
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  return model.eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
  model = make_hf_model(request.param)
  path = str(tmp_path_factory.mktemp(request.param))
  model.save_pretrained(path)
  ids, types = inputs(model)
  return request.param, model, path, (ids, types), hf_outputs(model, ids, types)


@pytest.fixture(scope="module")
def loaded(saved):
  return t5lite.load_hf(saved[2])


def test_load_hf_matches_hf_logits(saved, loaded):
  name, model, _, (ids, types), reference = saved
  config, params = loaded
  assert config.family == name.split("_")[0]
  if name.startswith("albert"):
    c = model.config
    assert (config.embedding_size, config.shared_layer_groups, config.layers_per_group) == (
        c.embedding_size, c.num_hidden_groups, c.inner_group_num)
  assert_parity(ours(config, params, ids, types), reference)


def test_save_hf_loads_in_transformers_like_save_pretrained(saved, loaded, tmp_path):
  name, model, path, (ids, types), reference = saved
  _, model_cls, auto_cls, _ = CASES[name]
  t5lite.save_hf(*loaded, str(tmp_path))
  # The same tensors as transformers writes (tied copies dropped), nothing more.
  names = lambda d: set(safetensors.numpy.load_file(os.path.join(d, "model.safetensors")))
  assert names(str(tmp_path)) == names(path)
  assert_parity(hf_outputs(loads_cleanly(auto_cls, str(tmp_path), model_cls), ids, types),
                reference)


@pytest.mark.parametrize("saved", ["albert_one_group"], indirect=True)
def test_unshared_model_exports_as_one_layer_per_albert_group(saved, loaded, tmp_path):
  """shared_layer_groups=0 (layers_i) is ALBERT with num_hidden_layers groups of one layer:
  the shared model with its one layer copied to every slot is the same network."""
  _, _, _, (ids, types), reference = saved
  config, params = loaded
  encoder = dict(params["encoder"])
  layer = encoder.pop("groups_0_0")
  encoder.update({f"layers_{i}": layer for i in range(config.num_encoder_layers)})
  t5lite.save_hf(config.replace(shared_layer_groups=0), {**params, "encoder": encoder},
                 str(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text())["num_hidden_groups"] == 3
  model = loads_cleanly(T.AutoModelForPreTraining, str(tmp_path), T.AlbertForPreTraining)
  assert_parity(hf_outputs(model, ids, types), reference)


@pytest.mark.slow
@pytest.mark.parametrize("saved", ["albert_two_groups"], indirect=True)
def test_import_and_export_cli_round_trip(saved, tmp_path):
  _, _, path, (ids, types), reference = saved
  model_dir, out = str(tmp_path / "model"), str(tmp_path / "hf")
  for argv in (["import", "hf", "--from", path, "--out", model_dir],
               ["export", "hf", "--checkpoint", model_dir, "--out", out]):
    done = run_t5lite(*argv, timeout=300)
    assert done.returncode == 0, done.stderr
    json.loads(done.stdout.strip().splitlines()[-1])  # the one summary line
  model = loads_cleanly(T.AutoModelForPreTraining, out, T.AlbertForPreTraining)
  assert_parity(hf_outputs(model, ids, types), reference)


# --- bad input --------------------------------------------------------------------------

def edited_copy(path, tmp_path, **changes):
  """A copy of an HF directory with config.json keys changed."""
  copy = tmp_path / "edited"
  shutil.copytree(path, copy)
  config = json.loads((copy / "config.json").read_text())
  (copy / "config.json").write_text(json.dumps({**config, **changes}))
  return str(copy)


def cli_error(argv, capsys):
  assert cli.main(argv) == 2
  return capsys.readouterr().err


@pytest.mark.parametrize("saved", ["bert"], indirect=True)
def test_unsupported_model_type_names_the_supported_ones(saved, tmp_path, capsys):
  source = edited_copy(saved[2], tmp_path, model_type="deberta")
  with pytest.raises(ConfigError, match="model_type=.deberta. is not supported.*albert, bert"):
    t5lite.load_hf(source)
  err = cli_error(["import", "hf", "--from", source, "--out", str(tmp_path / "m")], capsys)
  assert "'deberta'" in err and "electra" in err and "roberta" in err


@pytest.mark.parametrize("case, change, tensor, shapes", [
    ("bert", dict(intermediate_size=40), "bert.encoder.layer.0.intermediate.dense.weight",
     ["(44, 30)", "(40, 30)"]),
    ("albert_two_groups", dict(embedding_size=12), "albert.embeddings.word_embeddings.weight",
     ["(97, 10)", "(97, 12)"]),
])
def test_sizes_that_do_not_match_the_weights_name_tensor_and_shapes(case, change, tensor,
                                                                   shapes, tmp_path, capsys):
  source = str(tmp_path / "hf")
  make_hf_model(case).save_pretrained(source)
  source = edited_copy(source, tmp_path, **change)
  with pytest.raises(ConfigError) as error:
    t5lite.load_hf(source)
  assert all(s in str(error.value) for s in [repr(tensor)] + shapes), error.value
  err = cli_error(["import", "hf", "--from", source, "--out", str(tmp_path / "m")], capsys)
  assert tensor in err


@pytest.mark.parametrize("case, change, named", [
    ("bert", dict(norm_position="pre"), "norm_position='pre'"),
    ("bert", dict(position_encoding="rope"), "position_encoding='rope'"),
    ("roberta", dict(pooler=True), "pooler=True"),
    ("albert_two_groups", dict(embedding_size=0), "embedding_size=0"),
    ("albert_two_groups", dict(type_vocab_size=0), "type_vocab_size=0"),
    ("albert_two_groups", dict(mlp_activation="swiglu"), "mlp_activation='swiglu'"),
])
def test_export_refuses_options_without_an_hf_equivalent_by_name(case, change, named,
                                                                 tmp_path):
  config = our_config(make_config(case)).replace(**change)
  with pytest.raises(ConfigError, match=re.escape(named)):
    t5lite.save_hf(config, {}, str(tmp_path / "out"))  # refused before any weight is read
  assert not (tmp_path / "out").exists()


def test_export_cli_refusal_exits_2_naming_the_option(tmp_path, capsys):
  config = our_config(make_config("bert")).replace(norm_position="pre")
  params_only.write_model_dir(tmp_path / "run", config, t5lite.init_params(config, 0), step=1,
                              vocabulary=None)
  with pytest.warns(UserWarning, match="no vocabulary"):
    err = cli_error(["export", "hf", "--checkpoint", str(tmp_path / "run"),
                     "--out", str(tmp_path / "hf")], capsys)
  assert "norm_position='pre'" in err


# --- parameter counts -------------------------------------------------------------------

def make_config(name):
  config_cls, _, _, kwargs = CASES[name]
  return config_cls(**kwargs)


def our_config(hf_config) -> ModelConfig:
  """t5lite's ModelConfig of an HF config object, through its layout (nothing loaded;
  `import t5lite` registered every layout)."""
  values = hf_config.to_dict()
  return hf_layout.for_model_type(values["model_type"]).config_from_hf(values, None)


@pytest.mark.parametrize("model_cls, hf_config, size", [
    (T.BertForPreTraining, T.BertConfig(), 110e6),  # bert-base-uncased
    (T.RobertaForMaskedLM, T.RobertaConfig(vocab_size=50265, max_position_embeddings=514,
                                           type_vocab_size=1), 125e6),  # roberta-base
    (T.AlbertForPreTraining, T.AlbertConfig(hidden_size=768, num_attention_heads=12,
                                            intermediate_size=3072), 12e6),  # albert-base-v2
    (T.AlbertForPreTraining, T.AlbertConfig(), 223e6),  # albert-xxlarge-v2
])
def test_param_counts_equal_hf(model_cls, hf_config, size):
  with torch.device("meta"):  # shapes only: nothing allocated
    model = model_cls(hf_config)
  # parameters() lists a tied tensor once, as count_params counts our one table.
  expected = sum(p.numel() for p in model.parameters())
  assert t5lite.count_params(our_config(hf_config)) == expected
  assert 0.95 * size < expected < 1.05 * size
