"""Bounded imports: sizes a checkpoint claims are checked against its files and the import
ceiling before anything is allocated, and no file is read through a symlink out of it.

Each case is a small hostile checkpoint built by hand; the old importer aborted (a .zarray
claiming 2^20 x 2^16 floats: std::bad_alloc, rc 134), ran for minutes (num_layers=10**6),
gave tracebacks (non-integer sizes) or followed symlinks out (spiece.model -> /etc/passwd).
"""
import contextlib
import gzip
import json
import os
import threading

import numpy as np
import pytest
from flax import serialization, traverse_util

import t5lite
from helpers import tiny
from helpers.cli import run_t5lite
from t5lite import cli
from t5lite.data.vocab.vocabularies import train_sentencepiece
from t5lite.errors import ConfigError
from t5lite.interop import limits
from t5lite.interop.t5x import checkpoints as t5x
from t5lite.interop.t5x import files as t5x_files
from t5lite.models.params import init_params
from helpers.t5x_checkpoints import (DECODER_LAYER, ENCODER_LAYER, MLP, STEP, V11,
                                     write_msgpack_checkpoint, t5x_target)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, env: dict | None = None, timeout: float = 120):
  """`python -m t5lite.cli ARGS` in a fresh process: (exit code, stderr, seconds)."""
  result = run_t5lite(*args, env=env, timeout=timeout)
  return result.returncode, result.stderr, result.seconds


# --- T5X ----------------------------------------------------------------------------------------

def _claimed_shapes(vocab: int, d_model: int) -> dict[str, tuple[int, ...]]:
  """A self-consistent T5 v1.0 target (1 layer per stack, 1 head of 1, d_ff 1) of the given
  embedding: every array's shape fits the config the importer infers from them."""
  shapes = {"token_embedder/embedding": (vocab, d_model),
            "encoder/relpos_bias/rel_embedding": (1, 32),
            "decoder/relpos_bias/rel_embedding": (1, 32),
            "encoder/encoder_norm/scale": (d_model,), "decoder/decoder_norm/scale": (d_model,)}
  for stack, layer in (("encoder", ENCODER_LAYER), ("decoder", DECODER_LAYER)):
    for name, how in layer + MLP["relu"]:
      shapes[f"{stack}/layers_0/{name}"] = (
          (d_model,) if name.endswith("scale") else
          (1, d_model) if how == "out" or name.endswith("wo/kernel") else (d_model, 1))
  return shapes


def write_claiming_checkpoint(ckpt: str, shapes: dict[str, tuple[int, ...]]) -> None:
  """A msgpack + zarr checkpoint whose .zarray files claim `shapes`, each in one gzipped
  chunk: zeros for arrays under 1 MiB (so they read fine), a few bytes for bigger claims.
  A few KB on disk, whatever the claim."""
  os.makedirs(ckpt)
  leaves = {}
  for name, shape in shapes.items():
    relpath = "target." + name.replace("/", ".")
    os.makedirs(os.path.join(ckpt, relpath))
    meta = {"zarr_format": 2, "shape": list(shape), "chunks": list(shape), "dtype": "<f4",
            "compressor": {"id": "gzip", "level": 1}, "fill_value": None, "filters": None,
            "order": "C", "dimension_separator": "."}
    with open(os.path.join(ckpt, relpath, ".zarray"), "w") as f:
      json.dump(meta, f)
    with open(os.path.join(ckpt, relpath, ".".join("0" * len(shape))), "wb") as f:
      raw = 4 * int(np.prod(shape))
      f.write(gzip.compress(b"\0" * (raw if raw < 1 << 20 else 64)))
    leaves[("target",) + tuple(name.split("/"))] = {
        "driver": "zarr", "kvstore": {"driver": "file", "path": relpath},
        "metadata": {"shape": list(shape)}}
  blob = serialization.msgpack_serialize(
      {"version": 3, "optimizer": traverse_util.unflatten_dict(leaves)})
  with open(os.path.join(ckpt, "checkpoint"), "wb") as f:
    f.write(blob)


def test_t5x_zarray_claiming_256_gib_exits_2_not_134(tmp_path):
  """2^20 x 2^16 float32 (256 GiB, 6.9e10 params: under the ceiling) from ~9 KB of files:
  tensorstore allocated it whole and the process aborted (std::bad_alloc, rc 134)."""
  t5x_dir = tmp_path / "t5x"
  write_claiming_checkpoint(str(t5x_dir / "checkpoint_1"), _claimed_shapes(2**20, 2**16))
  rc, err, seconds = _cli("import", "t5x", "--from", str(t5x_dir), "--out", str(tmp_path / "o"))
  assert rc == 2, err
  assert ("checkpoint_1/target.token_embedder.embedding/.zarray: shape (1048576, 65536) of "
          "float32 claims 274,877,906,944 bytes, but its chunk files hold 24 bytes") in err, err
  assert sum(f.stat().st_size for f in t5x_dir.rglob("*") if f.is_file()) < 32 << 10
  assert seconds < 60 and not (tmp_path / "o" / "checkpoints").exists()


def test_t5x_claims_over_the_ceiling_are_refused(tmp_path, monkeypatch, capsys):
  """A legitimate checkpoint, over a lowered ceiling: by flag, by environment variable."""
  t5x_dir = tmp_path / "t5x"
  write_msgpack_checkpoint(str(t5x_dir / f"checkpoint_{STEP}"),
                           t5x_target(V11, init_params(V11, 0)), STEP)
  out = str(tmp_path / "out")
  assert cli.main(["import", "t5x", "--from", str(t5x_dir), "--out", out,
                   "--max_params", "1e3"]) == 2
  err = capsys.readouterr().err
  assert "over the import ceiling of 1,000" in err and limits.MAX_IMPORT_PARAMS_ENV in err, err
  monkeypatch.setenv(limits.MAX_IMPORT_PARAMS_ENV, "1000")
  with pytest.raises(ConfigError, match=r"checkpoint_1000: the target \(\d+ arrays; the "
                     r"largest, [\w/]+, of shape \(\d+, \d+\)\) claims"):
    t5x.load_t5x(str(t5x_dir))
  config, _ = t5x.load_t5x(str(t5x_dir), max_params=10**6)  # the argument wins
  assert config == V11


def test_t5x_many_small_claims_add_up(tmp_path):
  """Each array passes alone (under UNCHECKED_BYTES), but the target's total is checked."""
  size = t5x_files.UNCHECKED_BYTES // 4  # float32 values per array
  target = {("a", str(i)): t5x_files._ZarrArray(f"a{i}", "", (size,), "float32", stored=10)
            for i in range(3)}
  with pytest.raises(ConfigError, match="zarr arrays claim 50,331,648 bytes in all, but "
                     "their chunk files hold 30 bytes"):
    t5x_files.check_size(target, "checkpoint_1")


def test_t5x_chunk_file_larger_than_its_chunk_is_refused(tmp_path, capsys):
  t5x_dir = tmp_path / "t5x"
  ckpt = t5x_dir / f"checkpoint_{STEP}"
  write_msgpack_checkpoint(str(ckpt), t5x_target(V11, init_params(V11, 0)), STEP)
  chunk = ckpt / "target.decoder.decoder_norm.scale" / "0"
  chunk.write_bytes(chunk.read_bytes() + b"\0" * 8192)  # 16 floats: 64 raw bytes a chunk
  assert cli.main(["import", "t5x", "--from", str(t5x_dir), "--out", str(tmp_path / "o")]) == 2
  assert ("target.decoder.decoder_norm.scale/0: 8,2" in capsys.readouterr().err)


def test_t5x_scanned_depth_is_bounded():
  """A scanned stack's depth is one number in a shape: 4097 layers of width 1 are few bytes."""
  layers = limits.MAX_LAYERS + 1
  target = {("token_embedder", "embedding"): np.zeros((8, 4), np.float32),
            ("encoder", "relpos_bias", "rel_embedding"): np.zeros((1, 4), np.float32)}
  for stack in ("encoder", "decoder"):
    for name in ("pre_attention_layer_norm", "pre_mlp_layer_norm"):
      target[(stack, "layers", name, "scale")] = np.zeros((1, layers), np.float32)
    for name in ("attention/query", "mlp/wi"):
      target[(stack, "layers", *name.split("/"), "kernel")] = np.zeros((1, layers, 1), np.float32)
  with pytest.raises(ConfigError, match=f"claim \\[{layers}, {layers}\\] .* layers, over 4096"):
    t5x.infer_config(target, {}, {}, print)


# --- HF -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spm_bytes() -> bytes:
  texts = ["the cat sat on the mat", "a dog and a cat", "tea at ten to two"] * 20
  return train_sentencepiece(texts, 20, byte_fallback=False)  # 20 + 100 extra ids <= 128


@pytest.fixture
def hf_dir(tmp_path, spm_bytes):
  """A legitimate tiny HF T5 directory: config.json, model.safetensors, spiece.model and
  tokenizer_config.json."""
  path = tmp_path / "hf"
  t5lite.save_hf(tiny(), init_params(tiny(), 0), str(path))
  (path / "spiece.model").write_bytes(spm_bytes)
  (path / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 100}))
  return path


def _edit_config(path, **changes) -> None:
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  (path / "config.json").write_text(json.dumps(config))


def test_hf_million_layers_exit_2_fast(hf_dir, tmp_path):
  """num_layers=10**6 (1.8e10 params at this width: under the ceiling) ran for minutes at
  2 GB; the safetensors headers say the files hold two layers."""
  _edit_config(hf_dir, num_layers=10**6)
  rc, err, seconds = _cli("import", "hf", "--from", str(hf_dir), "--out", str(tmp_path / "o"))
  assert rc == 2, err
  assert "num_layers=1,000,000" in err and "model.safetensors holds only" in err, err
  assert seconds < 60


def test_hf_claim_over_the_ceiling(hf_dir, monkeypatch, capsys):
  _edit_config(hf_dir, num_layers=10**6, d_model=4096, d_ff=16384)  # 2.6e14 params
  with pytest.raises(ConfigError, match="num_layers=1,000,000.* over the import ceiling of "
                     "100,000,000,000 "):
    t5lite.load_hf(str(hf_dir))
  _edit_config(hf_dir, num_layers=2, d_model=32, d_ff=64)
  monkeypatch.setenv(limits.MAX_IMPORT_PARAMS_ENV, "1e4")  # what finetuning's load_hf reads
  with pytest.raises(ConfigError, match="over the import ceiling of 10,000"):
    t5lite.load_hf(str(hf_dir))
  assert cli.main(["import", "hf", "--from", str(hf_dir), "--out", str(hf_dir / "o"),
                   "--max_params", "1000"]) == 2
  assert "over the import ceiling of 1,000 (" in capsys.readouterr().err


@pytest.mark.parametrize("raw, message", [
    ('"vocab_size": 1e12', "vocab_size=1,000,000,000,000 is over the import ceiling"),
    ('"d_model": 32.5', "d_model=32.5 is not an integer size"),
    ('"d_ff": "64"', "d_ff='64' is not an integer size"),
    ('"num_heads": true', "num_heads=True is not an integer size"),
    ('"d_kv": 0', "d_kv=0 must be at least 1"),
], ids=["1e12", "float", "string", "bool", "zero"])
def test_hf_bad_sizes_exit_2_naming_the_field(raw, message, hf_dir, tmp_path, capsys):
  field = raw.split('"')[1]
  text = (hf_dir / "config.json").read_text()
  config = json.loads(text)
  (hf_dir / "config.json").write_text(text.replace(f'"{field}": {config[field]}', raw))
  assert cli.main(["import", "hf", "--from", str(hf_dir), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert f"config.json: {message}" in err, err
  assert not (tmp_path / "o" / "checkpoints").exists()


@contextlib.contextmanager
def fifo_watch(path):
  """A FIFO at `path`; yields an Event set if anything opens it for reading (and then
  hands that reader an empty file, so a regression fails instead of hanging)."""
  os.mkfifo(path)
  opened, done = threading.Event(), threading.Event()

  def writer():
    fd = os.open(path, os.O_WRONLY)  # blocks until a reader opens the FIFO
    if not done.is_set():
      opened.set()
    os.close(fd)

  thread = threading.Thread(target=writer, daemon=True)
  thread.start()
  try:
    yield opened
  finally:
    done.set()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # releases the writer
    thread.join(5)
    os.close(fd)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors",
                                  "model.safetensors.index.json", "spiece.model",
                                  "tokenizer_config.json"])
def test_hf_symlink_out_of_the_directory_is_refused_unopened(name, hf_dir, tmp_path, capsys):
  if name.endswith(".index.json"):  # sharded: the index is read instead of the weights
    os.rename(hf_dir / "model.safetensors", hf_dir / "model-00001-of-00001.safetensors")
  elif (hf_dir / name).exists():
    os.remove(hf_dir / name)
  target = str(tmp_path / "outside")
  with fifo_watch(target) as opened:
    os.symlink(target, hf_dir / name)
    code = cli.main(["import", "hf", "--from", str(hf_dir), "--out", str(tmp_path / "o")])
    assert not opened.is_set(), f"{target} was opened"
  assert code == 2
  err = capsys.readouterr().err
  assert f"{hf_dir / name} points to {target}, outside {hf_dir}; refused" in err, err


def test_hf_symlinks_within_the_directory_are_followed(hf_dir, tmp_path):
  (hf_dir / "files").mkdir()
  for name in ("config.json", "model.safetensors", "spiece.model", "tokenizer_config.json"):
    os.rename(hf_dir / name, hf_dir / "files" / name)
    os.symlink(os.path.join("files", name), hf_dir / name)  # relative, inside
  out = str(tmp_path / "out")
  assert cli.main(["import", "hf", "--from", str(hf_dir), "--out", out]) == 0
  assert '"extra_ids": 100' in open(os.path.join(out, "vocabulary.json")).read()
