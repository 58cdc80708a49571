"""PEFT runs through the trainer (t5lite.families.peft): only the adapters train, only they are
stored, the base is bitwise unchanged and named by fingerprint, and resume is exact."""
import json

import jax
import numpy as np
import pytest

import train_tasks  # noqa: F401 (registers train_test_copy)
from helpers import BYTE_VOCAB_SIZE, quiet, train_config
from helpers import tiny as _tiny
from helpers import tiny_encoder_only
from t5lite.errors import ConfigError
from t5lite.interop import params_only
from t5lite.families import family_of
from t5lite.families import peft as peft_lib
from t5lite.families.peft import PeftConfig
from t5lite.models import adapters
from t5lite.models.adapters import AdapterConfig
from t5lite.interop.peft import record as peft_record
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.trainer import Trainer, train



def tiny(**changes):
  return _tiny(vocab_size=BYTE_VOCAB_SIZE, **changes)


LORA = AdapterConfig(r=4, lora_alpha=8, target_modules=("query", "value"))


def write_base(path, config, seed=0):
  params = family_of(config).init_params(seed)
  params_only.write_model_dir(str(path), config, params, step=0, vocabulary=None)
  return jax.device_get(params)


def options(base, **changes):
  return PeftConfig(base=str(base), **{"adapter": LORA, **changes})


def run(model_dir, model, peft, steps=4, lr=1e-2, **changes):
  optimizer = OptimizerConfig(name="adamw", schedule=ScheduleConfig("constant", lr,
                                                                    warmup_steps=0))
  return train(model, train_config(str(model_dir), train_steps=steps, log_period=2,
                                   optimizer=optimizer, peft=peft, **changes), log=quiet)


def leaves(tree):
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


def test_the_train_state_holds_only_the_adapters(tmp_path):
  config = tiny()
  write_base(tmp_path / "base", config)
  trainer = Trainer(config, train_config(str(tmp_path / "run"), peft=options(tmp_path / "base")))
  params = leaves(trainer.abstract_params)
  assert params and all(k.endswith(("['lora_a']", "['lora_b']")) for k in params)
  # Optimizer state: AdamW's two moments of the adapters, nothing for the base.
  opt_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state.opt_state))
  adapter_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_params))
  assert opt_bytes <= 2 * adapter_bytes + 64
  full = Trainer(config, train_config(str(tmp_path / "full")))
  full_opt = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(full.abstract_state.opt_state))
  assert opt_bytes * 10 < full_opt
  assert trainer.model_config.adapter == LORA


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
  """(folder, base params, train()'s result for once): a base, a 4-step LoRA run on it in one
  go (folder/once) and the same run stopped at step 2 and resumed (folder/twice). Made once
  for the two tests below, which only read them."""
  root = tmp_path_factory.mktemp("lora")
  config = tiny()
  base = write_base(root / "base", config)
  result = run(root / "once", config, options(root / "base"), steps=4)
  run(root / "twice", config, options(root / "base"), steps=2, checkpoint=_every(2))
  run(root / "twice", config, options(root / "base"), steps=4)
  return root, base, result


@pytest.mark.e2e
@pytest.mark.slow
def test_a_lora_run_trains_the_adapters_and_leaves_the_base_bitwise(lora_runs):
  root, base, result = lora_runs
  assert result.step == 4
  # The checkpoint holds the adapters only; peft.json names the base by fingerprint.
  record = peft_record.read(root / "once")
  assert record["base"] == str(root / "base") and len(record["base_fingerprint"]) == 64
  from t5lite.runtime import checkpoint_reader
  saved = checkpoint_reader.saved_param_shapes(str(root / "once"))
  assert saved and all(k.endswith(("['lora_a']", "['lora_b']")) for k in saved)
  # load_params joins them to the untouched base.
  loaded_config, params, step = peft_record.load_run(str(root / "once"))
  assert loaded_config.adapter == LORA and step == 4
  base_half, adapter_half = adapters.split(jax.device_get(params))
  for k, v in leaves(base).items():
    np.testing.assert_array_equal(leaves(base_half)[k], v)
  assert any(np.abs(v).max() > 0 for k, v in leaves(adapter_half).items() if "lora_b" in k)
  losses = [json.loads(l)["loss"] for l in open(root / "once" / "metrics.jsonl")
            if '"loss"' in l]
  assert losses[-1] < losses[0]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_stopped_and_resumed_lora_run_equals_one_run_bitwise(lora_runs):
  root = lora_runs[0]
  a = leaves(peft_record.load_run(str(root / "once"))[1])
  b = leaves(peft_record.load_run(str(root / "twice"))[1])
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])


def _every(period):
  from t5lite.runtime.checkpoints import CheckpointConfig
  return CheckpointConfig(period=period)


def test_a_changed_base_is_refused_by_fingerprint(tmp_path):
  config = tiny()
  write_base(tmp_path / "base", config)
  run(tmp_path / "run", config, options(tmp_path / "base"), steps=1)
  import shutil
  shutil.rmtree(tmp_path / "base")
  write_base(tmp_path / "base", config, seed=1)
  with pytest.raises(ConfigError, match="fingerprint"):
    peft_record.load_run(str(tmp_path / "run"))
  with pytest.raises(ConfigError, match="another base fingerprint"):
    run(tmp_path / "run", config, options(tmp_path / "base"), steps=2)


@pytest.mark.parametrize("adapter, message", [
    (AdapterConfig(target_modules=("qkv",)), "'qkv' matches no kernel"),
    (AdapterConfig(r=40, target_modules=("wo",)), "r=40 is larger than .*wo's smaller side"),
])
def test_bad_targets_are_refused_with_names_and_numbers(adapter, message, tmp_path):
  config = tiny()
  write_base(tmp_path / "base", config)
  with pytest.raises(ConfigError, match=message):
    Trainer(config, train_config(str(tmp_path / "run"),
                                 peft=options(tmp_path / "base", adapter=adapter)))


def test_a_base_of_another_model_is_refused(tmp_path):
  write_base(tmp_path / "base", tiny())
  with pytest.raises(ConfigError, match="d_ff: base 64, run 48"):
    Trainer(tiny(d_ff=48), train_config(str(tmp_path / "run"), peft=options(tmp_path / "base")))


def test_a_base_pretrained_with_a_next_sentence_head_takes_a_classifier_run():
  """As peft on AutoModelForSequenceClassification of a BERT pretraining checkpoint: the
  run's own head (a classifier, no next-sentence head) differs from the base's; the encoder
  must not."""
  base = tiny_encoder_only(pooler=True, type_vocab_size=2, sentence_classes=2)
  run = base.replace(head="sequence_classification", num_labels=8, sentence_classes=0)
  assert peft_lib.adapted_config(run, base, options("base")).adapter == LORA
  with pytest.raises(ConfigError, match="d_model: base 32, run 48"):
    peft_lib.adapted_config(run.replace(d_model=48), base, options("base"))


PROMPT = AdapterConfig(method="prompt_tuning", num_virtual_tokens=4)
PREFIX_MLP = AdapterConfig(method="prefix_tuning", num_virtual_tokens=3, prefix_projection=True,
                           encoder_hidden_size=16)


def test_a_soft_prompt_starts_as_the_base_embeddings_of_sampled_tokens(tmp_path):
  config = tiny()
  base = write_base(tmp_path / "base", config)
  trainer = Trainer(config, train_config(str(tmp_path / "run"),
                                         peft=options(tmp_path / "base", adapter=PROMPT)))
  assert trainer.converter.pack is False  # an encoder's prompt would join packed examples
  params = jax.device_get(trainer.fresh_state().params)
  assert list(params) == ["encoder"] and list(params["encoder"]) == [adapters.PROMPT]
  ids = peft_lib.prompt_init_ids(PROMPT, None, config.vocab_size, seed=0)
  assert len(ids) == 4 and len(set(ids)) > 1
  np.testing.assert_array_equal(params["encoder"][adapters.PROMPT],
                                base["token_embedder"]["embedding"][np.array(ids)])
  text = AdapterConfig(method="prompt_tuning", num_virtual_tokens=5, prompt_init="text",
                       prompt_init_text="ab")
  from t5lite.data.vocab.vocabularies import ByteVocabulary
  vocabulary = ByteVocabulary()
  want = list(vocabulary.encode("ab"))
  assert peft_lib.prompt_init_ids(text, vocabulary, config.vocab_size, 0) == tuple(
      (want * 5)[:5])


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("adapter", [PROMPT, PREFIX_MLP], ids=["prompt", "prefix_mlp"])
def test_prompt_and_prefix_runs_train_store_only_their_adapter_and_resume_bitwise(
    tmp_path, adapter):
  config = tiny()
  base = write_base(tmp_path / "base", config)
  peft = options(tmp_path / "base", adapter=adapter)
  lr = 0.3 if adapter is PROMPT else 1e-2  # Lester et al. train prompts at 0.3
  run(tmp_path / "once", config, peft, steps=8, lr=lr)
  run(tmp_path / "twice", config, peft, steps=4, lr=lr, checkpoint=_every(4))
  run(tmp_path / "twice", config, peft, steps=8, lr=lr)
  from t5lite.runtime import checkpoint_reader
  saved = checkpoint_reader.saved_param_shapes(str(tmp_path / "once"))
  kind = "prompt_embeddings" if adapter is PROMPT else "prefix_encoder"
  assert saved and all(kind in k for k in saved), saved
  a = leaves(peft_record.load_run(str(tmp_path / "once"))[1])
  b = leaves(peft_record.load_run(str(tmp_path / "twice"))[1])
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  for k, v in leaves(base).items():  # the base is bitwise as written
    np.testing.assert_array_equal(a[k], v)
  if adapter is PREFIX_MLP:  # read back as the prefixes the MLP gives, at every attention
    prefixes = [k for k in a if "prefix_key" in k]
    queries = [k for k in a if k.endswith("['query']['kernel']")]
    assert prefixes and len(prefixes) == len(queries)  # one per attention
    assert not [k for k in a if "prefix_encoder" in k]
  losses = [json.loads(l)["loss"] for l in open(tmp_path / "once" / "metrics.jsonl")
            if '"loss"' in l]
  assert np.mean(losses[-2:]) < losses[0]  # a random base: noisy, so the last two


@pytest.mark.e2e
@pytest.mark.slow
def test_a_sharded_lora_run_on_a_bf16_base_equals_unsharded_params(tmp_path):
  """LoRA's A and B carry their kernels' logical axes: over data 2 x fsdp 2 x tensor 2 fake
  devices (scanned layers, a bfloat16 base, float32 adapters) the run equals one whose params
  are whole on every device (data parallel only)."""
  from t5lite.runtime.partitioning import MeshConfig
  config = tiny(scan_layers=True)
  write_base(tmp_path / "base", config)
  peft = options(tmp_path / "base", base_dtype="bfloat16")
  trainer = Trainer(config, train_config(str(tmp_path / "probe"), peft=peft, fsdp=True,
                                         mesh=MeshConfig(2, 2, 2)))
  query = trainer.param_shardings["encoder"]["layers"]["attention"]["query"]
  assert "fsdp" in tuple(query["lora_a"].spec) and "tensor" in tuple(query["lora_b"].spec)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(trainer.abstract_params))
  assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(trainer.fixed_params))
  run(tmp_path / "many", config, peft, steps=3, fsdp=True, mesh=MeshConfig(2, 2, 2))
  run(tmp_path / "one", config, peft, steps=3, mesh=MeshConfig(8, 1, 1))  # params whole
  losses = [[json.loads(l)["loss"] for l in open(tmp_path / d / "metrics.jsonl")
             if '"loss"' in l] for d in ("many", "one")]
  np.testing.assert_allclose(losses[0], losses[1], rtol=2e-3)
  a = leaves(peft_record.load_run(str(tmp_path / "many"))[1])
  b = leaves(peft_record.load_run(str(tmp_path / "one"))[1])
  for k in a:
    np.testing.assert_allclose(a[k].astype(np.float32), b[k].astype(np.float32), atol=2e-3)
