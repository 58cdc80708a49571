"""`t5lite import t5x`: checkpoints written here in T5X's own layouts, read back bit for bit.

The writers (helpers/t5x_checkpoints.py) state T5X's layouts independently of
t5lite/interop/t5x/checkpoints.py: the key names come from t5x/examples/t5/network.py + layers.py,
the files from t5x/checkpoints.py (`Checkpointer.save`: msgpack + tensorstore;
`OrbaxCheckpointManagerInterface`: orbax).
"""
import os
import shutil

import numpy as np
import pytest
from flax import traverse_util

import t5lite
from helpers import assert_trees_equal, tiny
from helpers.t5x_checkpoints import (  # noqa: F401
    DECODER_LAYER, ENCODER_LAYER, MLP, STEP, TOP, UNTIED, V11, _moments, _nest, _write_zarr,
    t5x_target, write_msgpack_checkpoint, write_orbax_aggregate_checkpoint,
    write_orbax_checkpoint)
from t5lite import cli
from t5lite.data.vocab.vocabularies import train_sentencepiece
from t5lite.interop.t5x import checkpoints as t5x
from t5lite.interop.t5x import files as t5x_files
from t5lite.models.params import init_params
from t5lite.runtime import model_dir

V10 = tiny(mlp_activation="relu", tie_output_embedding=True, scale_logits=True)  # T5 v1.0

# T5X's operative config.gin, in base.gin's block form and the flat form T5X writes.
GIN_BLOCK = """from __gin__ import dynamic_registration
import seqio
from t5x.examples.t5 import network
DROPOUT_RATE = 0.0  # a macro, as in t5_1_1/base.gin
seqio.SentencePieceVocabulary.sentencepiece_model_file = "{spm}"
seqio.SentencePieceVocabulary.extra_ids = 100
network.Transformer.config = @network.T5Config()
network.T5Config:
  vocab_size = 128
  emb_dim = 32
  mlp_activations = {acts}
  dropout_rate = %DROPOUT_RATE
  logits_via_embedding = {tied}
"""
GIN_FLAT = """# Parameters for network.T5Config:
# ==============================================================================
network.T5Config.dropout_rate = 0.0
network.T5Config.logits_via_embedding = {tied}
network.T5Config.mlp_activations = {acts}
"""
T5X_ACTS = {"relu": "('relu',)", "gated-gelu": "('gelu', 'linear')"}


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory) -> str:
  texts = ["the cat sat on the mat", "a dog and a cat", "tea at ten to two"] * 20
  path = tmp_path_factory.mktemp("spm") / "sentencepiece.model"
  path.write_bytes(train_sentencepiece(texts, 20, byte_fallback=False))  # 20 + 100 extra <= 128
  return str(path)


def _assert_imported(out: str, config, params, step: int):
  assert model_dir.load_model_config(out) == config  # every field inferred right
  loaded_config, loaded, loaded_step = model_dir.load_params(out)
  assert loaded_step == step
  assert_trees_equal(loaded, params)
  enc = np.array([[5, 9, 17, 3, 1, 0]], np.int32)
  dec = np.array([[0, 7, 11, 2]], np.int32)
  np.testing.assert_array_equal(t5lite.logits(loaded_config, loaded, enc, dec),
                                t5lite.logits(config, params, enc, dec))


@pytest.mark.parametrize("config", [V10, V11], ids=["v1.0", "v1.1"])
@pytest.mark.parametrize("layout", ["msgpack", "orbax",
                                    pytest.param("orbax_aggregate", marks=pytest.mark.slow)])
def test_import_is_bitwise_and_gives_the_same_logits(layout, config, spm_file, tmp_path, capsys):
  params = init_params(config, 1)
  target = t5x_target(config, params)
  t5x_dir, out = str(tmp_path / "t5x"), str(tmp_path / "out")
  acts, tied = T5X_ACTS[config.mlp_activation], config.tie_output_embedding
  if layout == "msgpack":
    write_msgpack_checkpoint(os.path.join(t5x_dir, f"checkpoint_{STEP}"), target, STEP)
    os.makedirs(os.path.join(t5x_dir, f"checkpoint_{STEP + 10}.tmp-1234"))  # unfinished save
    spm_inside = shutil.copy(spm_file, t5x_dir)  # config.gin is followed inside the model dir
    with open(os.path.join(t5x_dir, "config.gin"), "w") as f:
      f.write(GIN_BLOCK.format(spm=spm_inside, acts=acts, tied=tied))
    args = []
  elif layout == "orbax":
    write_orbax_checkpoint(t5x_dir, target, STEP)
    with open(os.path.join(t5x_dir, "config.gin"), "w") as f:
      f.write(GIN_FLAT.format(acts=acts, tied=tied))
    args = ["--vocabulary", spm_file, "--extra_ids", "50"]
  else:  # no config.gin: the activation is the T5 default for the MLP's shape, with a note
    write_orbax_aggregate_checkpoint(os.path.join(t5x_dir, f"checkpoint_{STEP}"), target, STEP)
    args = []
  assert cli.main(["import", "t5x", "--from", t5x_dir, "--out", out] + args) == 0
  _assert_imported(out, config, params, STEP)
  err = capsys.readouterr().err
  vocab_json = os.path.join(out, "vocabulary.json")
  if layout == "msgpack":
    assert '"extra_ids": 100' in open(vocab_json).read()
  elif layout == "orbax":
    assert '"extra_ids": 50' in open(vocab_json).read()
  else:
    assert not os.path.exists(vocab_json) and "eval and infer will need one" in err
    assert f"mlp_activation={config.mlp_activation!r}" in err


def test_step_folder_and_step_flag(tmp_path):
  params = init_params(V11, 2)
  target = t5x_target(V11, params)
  old = {k: v + 1 for k, v in target.items()}
  t5x_dir = str(tmp_path / "t5x")
  write_msgpack_checkpoint(os.path.join(t5x_dir, "checkpoint_10"), old, 10)
  write_msgpack_checkpoint(os.path.join(t5x_dir, "checkpoint_20"), target, 20)
  _, newest = t5x.load_t5x(t5x_dir)
  assert_trees_equal(newest, params)
  _, folder = t5x.load_t5x(os.path.join(t5x_dir, "checkpoint_20"))
  assert_trees_equal(folder, params)
  config, older = t5x.load_t5x(t5x_dir, step=10)
  np.testing.assert_array_equal(older["token_embedder"]["embedding"],
                                params["token_embedder"]["embedding"] + 1)
  config, scanned = t5x.load_t5x(t5x_dir, scan_layers=True)  # a hint overrides the inferred
  assert config.scan_layers and "layers" in scanned["encoder"]


def _scalable_target(config, params, scan: str | None, relpos: str,
                     relpos_equal=True) -> dict[str, np.ndarray]:
  """scalable_t5 (t5x/examples/scalable_t5/network.py): 3-D q/k/v/out kernels and a relative
  position table `relpos` inside every layer. Scanned, a stack's layers are `scan`
  ('layers': encoder/layers/...; 'stack': encoder/encoder/..., the naming of the released
  umT5 checkpoints) with the layer axis at param_scan_axis=1; unscanned (None) layers_N."""
  flat = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}
  out = {k: v for k, v in flat.items() if "layers_" not in k and "relpos_bias" not in k}
  for stack, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    table = flat[f"{stack}/relpos_bias/rel_embedding"].T  # (heads, buckets)
    per_layer = [{k.split("/", 2)[2]: v for k, v in flat.items()
                  if k.startswith(f"{stack}/layers_{i}/")} for i in range(n)]
    for i, layer in enumerate(per_layer):
      layer[f"{relpos}/rel_embedding"] = table if relpos_equal or i == 0 else table + 1
    for name in per_layer[0]:
      if scan is None:
        out.update({f"{stack}/layers_{i}/{name}": layer[name] for i, layer in enumerate(per_layer)})
      else:
        out[f"{stack}/{stack if scan == 'stack' else scan}/{name}"] = np.stack(
            [layer[name] for layer in per_layer], axis=1)
  return out


SCALABLE_NAMINGS = [("layers", "relative_posemb"), ("stack", "relpos_bias"),
                    (None, "relative_posemb")]


@pytest.mark.parametrize("scan, relpos", SCALABLE_NAMINGS,
                         ids=["layers-relative_posemb", "stack-relpos_bias", "unscanned"])
def test_scalable_t5_layouts(scan, relpos, tmp_path):
  params = init_params(V11, 3)
  ckpt = str(tmp_path / "checkpoint_5")
  write_msgpack_checkpoint(ckpt, _scalable_target(V11, params, scan, relpos), 5)
  config, imported = t5x.load_t5x(ckpt, scan_layers=False)
  assert config == V11
  assert_trees_equal(imported, params)


@pytest.mark.parametrize("scan, relpos", SCALABLE_NAMINGS[:1] + SCALABLE_NAMINGS[2:],
                         ids=["scanned", "unscanned"])
def test_scalable_t5_per_layer_tables_are_refused_before_the_weights_are_read(scan, relpos,
                                                                              tmp_path):
  """scalable_t5 initializes every layer's table on its own: t5lite (one table per stack)
  refuses such a checkpoint up front, before reading the weights (here: one with a lost
  chunk, which would fail the import if it were read first)."""
  ckpt = str(tmp_path / "checkpoint_5")
  write_msgpack_checkpoint(ckpt, _scalable_target(V11, init_params(V11, 3), scan, relpos,
                                                  relpos_equal=False), 5)
  os.remove(os.path.join(ckpt, "target.token_embedder.embedding", "1.0"))
  with pytest.raises(t5x.T5XCheckpointError, match="layer 1 has its own relative position "
                     "table.*t5lite shares one table per stack"):
    t5x.load_t5x(ckpt)


@pytest.fixture
def good_checkpoint(tmp_path):
  """A v1.1 msgpack checkpoint and a valid zarr array outside it (for escape attempts)."""
  target = t5x_target(V11, init_params(V11, 4))
  outside = str(tmp_path / "outside.kernel")
  _write_zarr(outside, target["encoder/layers_0/mlp/wi_0/kernel"])
  return target, str(tmp_path / "t5x"), outside


def _import_error(t5x_dir, tmp_path, capsys) -> str:
  """A checkpoint that cannot be imported is a setup error: exit 2 and one message."""
  assert cli.main(["import", "t5x", "--from", t5x_dir, "--out", str(tmp_path / "out")]) == 2
  assert not os.path.exists(tmp_path / "out" / "checkpoints")
  return capsys.readouterr().err


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlinked_array", "symlinked_chunk"])
def test_paths_outside_the_checkpoint_are_refused(escape, good_checkpoint, tmp_path, capsys):
  target, t5x_dir, outside = good_checkpoint
  name = "target/encoder/layers_0/mlp/wi_0/kernel"
  ckpt = os.path.join(t5x_dir, f"checkpoint_{STEP}")
  paths = {"dotdot": {name: "../../outside.kernel"}, "absolute": {name: outside}}.get(escape)
  write_msgpack_checkpoint(ckpt, target, STEP, paths=paths)
  array_dir = os.path.join(ckpt, "target.encoder.layers_0.mlp.wi_0.kernel")
  if escape == "symlinked_array":
    shutil.rmtree(array_dir)
    os.symlink(outside, array_dir)
  elif escape == "symlinked_chunk":
    os.remove(os.path.join(array_dir, "0.0"))
    os.symlink(os.path.join(outside, "0.0"), os.path.join(array_dir, "0.0"))
  err = _import_error(t5x_dir, tmp_path, capsys)
  assert "outside the checkpoint folder" in err and "refused" in err, err


def test_truncated_chunk_names_the_file(good_checkpoint, tmp_path, capsys):
  target, t5x_dir, _ = good_checkpoint
  ckpt = os.path.join(t5x_dir, f"checkpoint_{STEP}")
  write_msgpack_checkpoint(ckpt, target, STEP)
  chunk = os.path.join(ckpt, "target.encoder.layers_0.mlp.wi_0.kernel", "0.0")
  data = open(chunk, "rb").read()
  open(chunk, "wb").write(data[: len(data) // 2])
  err = _import_error(t5x_dir, tmp_path, capsys)
  assert f"checkpoint_{STEP}/target.encoder.layers_0.mlp.wi_0.kernel: truncated or corrupted" in err


def test_missing_chunk_names_the_array(good_checkpoint, tmp_path, capsys):
  """tensorstore reads a missing zarr chunk as zeros unless told not to."""
  target, t5x_dir, _ = good_checkpoint
  ckpt = os.path.join(t5x_dir, f"checkpoint_{STEP}")
  write_msgpack_checkpoint(ckpt, target, STEP)
  os.remove(os.path.join(ckpt, "target.encoder.layers_0.mlp.wi_0.kernel", "1.0"))
  err = _import_error(t5x_dir, tmp_path, capsys)
  assert (f"checkpoint_{STEP}/target.encoder.layers_0.mlp.wi_0.kernel: a chunk file is missing"
          in err), err


def test_oversized_msgpack_names_the_file_and_the_cap(tmp_path, monkeypatch):
  assert t5x_files.MAX_MSGPACK_BYTES == 4 << 30  # version 0 inlines arrays; read whole
  ckpt = tmp_path / "checkpoint_3"
  ckpt.mkdir()
  (ckpt / "checkpoint").write_bytes(b"\x80" * 100)
  monkeypatch.setattr(t5x_files, "MAX_MSGPACK_BYTES", 64)
  with pytest.raises(t5x.T5XCheckpointError,
                     match="checkpoint_3/checkpoint: 100 bytes, over the 64 byte"):
    t5x_files.read_target(str(ckpt))


def test_config_gin_vocabulary_is_only_followed_inside_the_model_dir(spm_file, tmp_path,
                                                                     capsys):
  """config.gin is untrusted: its sentencepiece_model_file must not read any local file."""
  t5x_dir = tmp_path / "t5x"
  (t5x_dir / "vocab").mkdir(parents=True)
  shutil.copy(spm_file, t5x_dir / "vocab" / "sentencepiece.model")
  os.symlink(spm_file, t5x_dir / "link.model")  # a symlink out is outside too
  gin = "seqio.SentencePieceVocabulary.sentencepiece_model_file = '{}'\n"
  for outside in (spm_file, "link.model", os.path.relpath(spm_file, t5x_dir)):
    assert t5x._gin_vocabulary(gin.format(outside), None, str(t5x_dir)) is None, outside
    err = capsys.readouterr().err
    assert "outside the T5X model dir" in err and "pass --vocabulary" in err, err
  for inside in (str(t5x_dir / "vocab" / "sentencepiece.model"), "vocab/sentencepiece.model"):
    assert t5x._gin_vocabulary(gin.format(inside), 100, str(t5x_dir)) is not None, inside


def test_truncated_msgpack_names_the_file(good_checkpoint, tmp_path, capsys):
  target, t5x_dir, _ = good_checkpoint
  ckpt = os.path.join(t5x_dir, f"checkpoint_{STEP}")
  write_msgpack_checkpoint(ckpt, target, STEP)
  index = os.path.join(ckpt, "checkpoint")
  data = open(index, "rb").read()
  open(index, "wb").write(data[: len(data) - 7])
  err = _import_error(t5x_dir, tmp_path, capsys)
  assert f"checkpoint_{STEP}/checkpoint: truncated or corrupted msgpack" in err


def test_wrong_shape_names_the_parameter_and_both_shapes(good_checkpoint, tmp_path, capsys):
  target, t5x_dir, _ = good_checkpoint
  target = dict(target)
  target["decoder/layers_1/mlp/wo/kernel"] = np.zeros((64, 16), np.float32)  # d_model is 32
  write_msgpack_checkpoint(os.path.join(t5x_dir, f"checkpoint_{STEP}"), target, STEP)
  err = _import_error(t5x_dir, tmp_path, capsys)
  assert ("decoder/layers_1/mlp/wo/kernel: shape (64, 16) in the checkpoint, "
          "expected (64, 32)") in err
