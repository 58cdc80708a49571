"""`t5lite export hf | params` and `t5lite import hf`: a trained tiny model out to HF
transformers and back, tokenizer files that encode like the t5lite vocabulary, params-only
checkpoints on another mesh, and untrusted weight files refused with the file named."""
import inspect
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import t5lite
from t5lite import cli
from t5lite.cli.imports import import_hf
from t5lite.data.vocab import vocabularies
from t5lite.interop.hf import checkpoints as hf
from t5lite.interop.hf import tokenizer as hf_tokenizer
from t5lite.interop import params_only
from t5lite.models.params import abstract_params, init_params
from t5lite.runtime import model_dir, partitioning
from t5lite.train.trainer import train
import train_tasks
from helpers.terminal import on_terminal, redrawn
from helpers import (assert_trees_equal, checkpoint_params, hf_generate, quiet, tiny,
                     train_config)

# Real text with accents, CJK, an emoji, a ligature, tabs, newlines and runs of spaces: the
# characters a sentencepiece model without them must spell in bytes (byte fallback).
SAMPLE = ["Héllo wörld — naïve café, 日本語のテキスト, emoji 🙂 done.",
          "  two leading spaces,  doubled  ones\tand a tab\nand a newline  ",
          "Ünïcödé ﬁ ligature ½ and Ωmega", ""]
# Sentinels typed inside text, and whitespace at the edges of lines and texts.
EDGES = ["x <extra_id_0> y", "a<extra_id_0>b", "foo<extra_id_0> bar <extra_id_9>", "  x",
         "x\n  y\n z", "   ", " a  "]
V1_0 = dict(mlp_activation="relu", tie_output_embedding=True, scale_logits=True)


def run(*argv):
  code = cli.main(list(argv))
  assert code == 0, argv
  return code


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny T5 v1.1 (untied, gated-GELU) trained 3 steps on the byte-vocabulary copy task
  (a training run: the tests that use it are marked slow)."""
  directory = tmp_path_factory.mktemp("run")
  train(tiny(vocab_size=384), train_config(
      directory, task_feature_lengths={"inputs": 32, "targets": 16}), log=quiet)
  return str(directory)


def inputs(seed, vocab=384):
  x = np.random.RandomState(seed).randint(3, vocab, (3, 11))
  x[:, -1] = 1
  x[2, 6:] = 0  # a padded row
  return x


@pytest.mark.e2e
@pytest.mark.slow
def test_export_hf_of_a_trained_model_loads_in_transformers_and_matches(trained, tmp_path):
  out = tmp_path / "hf"
  run("export", "hf", "--checkpoint", trained, "--out", str(out))
  config, params, step = checkpoint_params(trained)
  assert step == 3
  model, info = transformers.T5ForConditionalGeneration.from_pretrained(
      str(out), output_loading_info=True)
  assert not any(info.values()), info
  enc, dec = inputs(0), inputs(1)[:, :7]
  with torch.no_grad():
    theirs = model.eval()(input_ids=torch.tensor(enc),
                          decoder_input_ids=torch.tensor(dec)).logits.numpy()
  np.testing.assert_allclose(t5lite.logits(config, params, enc, dec), theirs,
                             rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
  np.testing.assert_array_equal(t5lite.generate(config, params, enc, max_decode_length=9),
                                hf_generate(model, enc, 9, do_sample=False, num_beams=1))
  # ByT5's byte layout: transformers' own ByT5Tokenizer encodes like ByteVocabulary.
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  vocab = vocabularies.load_vocabulary(trained)
  for text in SAMPLE:
    assert tokenizer(text, add_special_tokens=False).input_ids == vocab.encode(text).tolist()

  # ... and back: the import holds the checkpoint's params bitwise.
  back = tmp_path / "back"
  run("import", "hf", "--from", str(out), "--out", str(back))
  config2, params2, step2 = checkpoint_params(back)
  assert step2 == 0 and config2.replace(dropout_rate=config.dropout_rate) == config
  assert_trees_equal(params2, params)
  assert vocabularies.load_vocabulary(back) == vocab


@pytest.mark.parity
def test_v1_0_tied_relu_layout_and_sharded_weights(tmp_path):
  config = tiny(vocab_size=384, **V1_0)
  params = init_params(config, 3)
  params_only.write_model_dir(tmp_path / "run", config, params, step=7,
                              vocabulary=vocabularies.ByteVocabulary(extra_ids=100))
  out = tmp_path / "hf"
  run("export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(out),
      "--max_shard_size", "20KB")
  index = json.loads((out / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and not (out / "model.safetensors").exists()
  hf_config = json.loads((out / "config.json").read_text())
  assert hf_config["feed_forward_proj"] == "relu" and hf_config["tie_word_embeddings"]
  model, info = transformers.T5ForConditionalGeneration.from_pretrained(
      str(out), output_loading_info=True)
  assert not any(info.values()), info
  enc, dec = inputs(2), inputs(3)[:, :5]
  with torch.no_grad():
    theirs = model.eval()(input_ids=torch.tensor(enc),
                          decoder_input_ids=torch.tensor(dec)).logits.numpy()
  np.testing.assert_allclose(t5lite.logits(config, params, enc, dec), theirs,
                             rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
  loaded_config, loaded = hf.load_hf(str(out))
  assert loaded_config.tie_output_embedding and loaded_config.scale_logits
  assert_trees_equal(loaded, params)


def stdlib_text():
  import argparse, collections, email, json as json_module, pathlib, re, tempfile
  modules = (argparse, collections, email, json_module, pathlib, re, tempfile, os, inspect)
  return "\n".join(inspect.getdoc(m) or "" for m in modules)


@pytest.mark.parity
@pytest.mark.parametrize("model_type,normalization", [
    ("unigram", "identity"), ("bpe", "identity"), ("unigram", "nmt_nfkc")])
def test_tokenizer_json_encodes_like_the_sentencepiece_vocabulary(model_type, normalization,
                                                                  tmp_path):
  import io

  import sentencepiece as spm
  writer = io.BytesIO()
  # T5's own spiece.model is unigram + nmt_nfkc with extra-space removal; t5lite trains
  # identity-normalized models that keep whitespace. Both must survive the export.
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(stdlib_text().splitlines()), model_writer=writer,
      vocab_size=700, model_type=model_type, byte_fallback=True, character_coverage=0.99,
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1, normalization_rule_name=normalization,
      remove_extra_whitespaces=normalization != "identity", num_threads=1, minloglevel=2)
  vocab = vocabularies.SentencePieceVocabulary(writer.getvalue(), extra_ids=10)
  hf_tokenizer.write_hf_tokenizer(vocab, str(tmp_path))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  fallback, differ = 0, []
  for text in SAMPLE + EDGES + stdlib_text().split("\n\n")[:40]:
    ours = vocab.encode(text).tolist()
    theirs = tokenizer(text, add_special_tokens=False).input_ids
    if theirs != ours:
      differ.append(text)
      continue
    assert tokenizer(text).input_ids == ours + [vocab.eos_id]  # HF T5 appends EOS
    assert tokenizer.decode(ours) == vocab.decode(ours)
    fallback += sum(3 <= i < 3 + 256 for i in ours)  # byte pieces <0x00>.. follow the specials
  assert not any(text in SAMPLE + EDGES for text in differ)
  # One paragraph of the NFKC model splits '(before' as o+re in sentencepiece, or+e in
  # tokenizers (whose nbest and short-text encodes agree with or+e): a Viterbi near-tie
  # that HF's own converted T5 tokenizers share. Identity-normalized models match exactly.
  assert len(differ) <= (1 if normalization == "nmt_nfkc" else 0), differ
  assert fallback > 10  # the sample really exercised byte fallback


@pytest.mark.e2e
@pytest.mark.slow
def test_params_export_casts_drops_optimizer_state_and_restores_on_any_mesh(trained, tmp_path):
  config, params, step = checkpoint_params(trained)
  out = tmp_path / "params"
  run("export", "params", "--checkpoint", trained, "--out", str(out), "--dtype", "bfloat16")
  saved = model_dir.load_model_config(out)
  assert saved.param_dtype == "bfloat16" and saved.replace(param_dtype="float32") == config
  state_dir = out / "checkpoints" / str(step) / "state"
  assert state_dir.is_dir() and not (out / "checkpoints" / str(step) / "data").exists()
  import orbax.checkpoint as ocp
  tree = ocp.PyTreeCheckpointer().metadata(str(state_dir)).item_metadata.tree
  assert set(tree) == {"step", "params"}  # no optimizer moments
  mesh = partitioning.make_mesh(partitioning.MeshConfig(data=2, fsdp=2, tensor=2))
  rules = partitioning.logical_axis_rules(fsdp=True)
  _, restored, restored_step = model_dir.load_params(str(out), mesh, rules)
  assert restored_step == step
  kernel = restored["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
  assert kernel.sharding.spec != jax.sharding.PartitionSpec() and kernel.dtype == "bfloat16"
  expected = params_only.cast_params(params, "bfloat16")
  assert_trees_equal(restored, expected)
  # Finetuning starts from it (params only, T5X step counting: TRAIN_STEPS is the last step).
  result = train(tiny(vocab_size=384), train_config(
      tmp_path / "finetune", train_steps=step + 2,
      task_feature_lengths={"inputs": 32, "targets": 16}, initial_checkpoint_path=str(out)),
      log=quiet)
  assert result.step == step + 2 and np.isfinite(list(result.losses.values())).all()


@pytest.mark.e2e
@pytest.mark.slow
def test_export_hf_on_a_terminal_shows_a_progress_bar_and_in_a_log_one_line(
    trained, tmp_path, monkeypatch, capsys):
  with on_terminal(monkeypatch) as screen:
    run("export", "hf", "--checkpoint", trained, "--out", str(tmp_path / "a"),
        "--max_shard_size", "20KB")
  shown = screen()
  shards = len(list((tmp_path / "a").glob("model-*-of-*.safetensors")))
  assert shards > 1 and redrawn(shown) and f"export hf: weights: 100%|" in shown
  assert f"{shards}/{shards}" in shown
  run("export", "hf", "--checkpoint", trained, "--out", str(tmp_path / "b"))
  assert "export hf: weights: 1/1 shards (100%)" in capsys.readouterr().err  # not a terminal


def test_exports_never_write_into_a_non_empty_folder(trained, tmp_path, capsys):
  (tmp_path / "keep.txt").write_text("mine")
  for fmt in ("hf", "params"):
    assert cli.main(["export", fmt, "--checkpoint", trained, "--out", str(tmp_path)]) != 0
    assert "not empty" in capsys.readouterr().err
  assert os.listdir(tmp_path) == ["keep.txt"]
  assert cli.main(["export", "onnx"]) == 2
  assert "hf" in capsys.readouterr().err


def zero_params(config):
  """Zeros of the params' shapes, for tests of layouts and files rather than of numbers: no
  init program to compile."""
  return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(config))


def test_variants_without_an_hf_layout_are_refused_by_name(tmp_path, capsys):
  config = tiny(vocab_size=384, position_encoding="rope")
  params_only.write_model_dir(tmp_path / "run", config, zero_params(config), step=1,
                              vocabulary=None)
  with pytest.warns(UserWarning, match="no vocabulary"):
    assert cli.main(["export", "hf", "--checkpoint", str(tmp_path / "run"),
                     "--out", str(tmp_path / "hf")]) == 2
  assert "position_encoding='rope'" in capsys.readouterr().err


@pytest.mark.parity
def test_untrusted_or_damaged_weight_files_are_refused_naming_the_file(tmp_path):
  config = tiny(vocab_size=384)
  source = tmp_path / "hf"
  hf.save_hf(config, zero_params(config), str(source))
  weights = source / "model.safetensors"
  # Truncated: the error names the file.
  data = weights.read_bytes()
  weights.write_bytes(data[: len(data) // 2])
  with pytest.raises(ValueError, match="model.safetensors cannot be read"):
    hf.load_hf(str(source))
  # Integer tensors are no T5 weights.
  tensors = safetensors.numpy.load(data)
  tensors["shared.weight"] = tensors["shared.weight"].astype(np.int64)
  safetensors.numpy.save_file(tensors, str(weights))
  with pytest.raises(ValueError, match="shared.weight"):
    hf.load_hf(str(source))
  # An index may only name shard files beside it.
  weights.unlink()
  (source / hf.INDEX_FILE).write_text(json.dumps(
      {"weight_map": {"shared.weight": "../../outside.safetensors"}}))
  with pytest.raises(ValueError, match="outside its directory"):
    hf.load_hf(str(source))
  # A torch .bin is only ever read weights-only: a pickle of anything else is refused.
  (source / hf.INDEX_FILE).unlink()
  torch.save({"shared.weight": torch.zeros(2), "payload": Exploit()}, source / hf.TORCH_FILE)
  with pytest.raises(ValueError, match="pytorch_model.bin cannot be read as a weights-only"):
    hf.load_hf(str(source))
  # weights_only allows plain values too: a non-tensor entry is named with its file.
  torch.save({"shared.weight": torch.zeros(2), "step": 7}, source / hf.TORCH_FILE)
  with pytest.raises(ValueError, match="pytorch_model.bin: entry 'step' is not a tensor"):
    hf.load_hf(str(source))


class Exploit:
  def __reduce__(self):
    return (os.system, ("echo pwned > /dev/null",))


def test_import_hf_carries_the_sentencepiece_vocabulary(tmp_path):
  config = tiny(vocab_size=416)  # 400 pieces + 7 extra ids fit, as T5's 32,100 in 32,128 rows
  source = tmp_path / "hf"
  hf.save_hf(config, zero_params(config), str(source))
  vocab = vocabularies.load_vocabulary(train_tasks_spiece_dir(tmp_path))
  hf_tokenizer.write_hf_tokenizer(vocab, str(source))
  run("import", "hf", "--from", str(source), "--out", str(tmp_path / "imported"))
  assert vocabularies.load_vocabulary(tmp_path / "imported") == vocab
  # A tokenizer with more ids than the model has rows is refused, naming both counts.
  small = _hf_dir_with(tmp_path / "small", 384, vocab)
  with pytest.raises(ValueError, match=r"the tokenizer has 407 ids but the model's embedding "
                     r"has 384 rows"):
    import_hf(str(small), str(tmp_path / "refused"))
  assert not (tmp_path / "refused").exists()
  # One with far fewer ids than rows (50 for 4,096 in the report) is imported with a warning.
  big = _hf_dir_with(tmp_path / "big", 1024, vocab)
  with pytest.warns(UserWarning, match=r"the tokenizer has 407 ids for the model's 1024 "
                    r"embedding rows: is it this model's tokenizer\?"):
    import_hf(str(big), str(tmp_path / "big_imported"))


def _hf_dir_with(folder, vocab_size, vocab):
  """An HF folder of a tiny T5 with `vocab_size` embedding rows and `vocab`'s tokenizer."""
  config = tiny(vocab_size=vocab_size)
  hf.save_hf(config, zero_params(config), str(folder))
  hf_tokenizer.write_hf_tokenizer(vocab, str(folder))
  return folder


def train_tasks_spiece_dir(tmp_path):
  """A small sentencepiece vocabulary with 7 extra ids, saved in its own folder."""
  model = vocabularies.train_sentencepiece([stdlib_text()], 400, character_coverage=0.99)
  vocab = vocabularies.SentencePieceVocabulary(model, extra_ids=7)
  vocab.save(tmp_path / "vocab")
  return tmp_path / "vocab"


assert train_tasks  # registers train_test_copy
