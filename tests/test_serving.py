"""`t5lite export serving`: the artifact, reloaded in a fresh process that never imports t5lite,
decodes exactly as the live model (ids and text, greedy and beam, batch sizes 1 and 3)."""
import ast
import hashlib
import inspect
import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import traverse_util

from helpers import tiny
from t5lite import cli
from t5lite.data.vocab.vocabularies import (ByteVocabulary, SentencePieceVocabulary,
                                            train_sentencepiece)
from t5lite.interop.serving import artifact as serving
from t5lite.interop.serving import serving_loader
from t5lite.interop.params_only import cast_params, write_model_dir
from t5lite.models.decoding import search as decoding
from t5lite.models.params import init_params
from t5lite.runtime.model_dir import load_params

INPUT_LENGTH, MAX_DECODE_LENGTH = 16, 8
# The tests that take these (through `live` and `fresh` too) are slow (helpers/durations.py).
SLOW_FIXTURES = ("artifacts",)
CONFIG = tiny(vocab_size=512)  # above the vocabularies' 410 and 359 ids: padded rows get decoded
# Each at most 15 bytes, so that with EOS they fit INPUT_LENGTH under both vocabularies.
TEXTS = ["Return a list", "héllo wörld", "a <extra_id_2>"]
TOO_LONG_TEXT = "a sentence far longer than sixteen tokens " * 3
ALLOWED_IMPORTS = {"__future__", "argparse", "hashlib", "json", "pathlib", "struct", "sys", "typing",
                   "jax", "numpy", "safetensors", "sentencepiece"}


# Runs in `python -I -c`: the loader is imported from the artifact alone, never t5lite.
FRESH_PROCESS = """
import json, sys
job = json.loads(sys.argv[1])
sys.path.insert(0, job["artifacts"]["sentencepiece"])
import numpy as np
from serving_loader import ServingModel

def error_of(call):
  try:
    call()
  except ValueError as error:
    return str(error)

results = {}
for name, path in job["artifacts"].items():
  model = ServingModel.load(path)
  result = results[name] = {}
  for method in model.manifest["methods"]:
    for key, tokens in job["tokens"].items():
      result[method + "/" + key] = model.generate(np.asarray(tokens, np.int32), method).tolist()
    result[method + "/texts"] = model.generate_text(job["texts"], method)
  wide = np.asarray(job["tokens"]["batch3"], np.int32)  # padded past input_length: accepted
  wide = np.pad(wide, ((0, 0), (0, model.input_length + 4 - wide.shape[1])))
  result["greedy/batch3_wide"] = model.generate(wide).tolist()
  result["encoded"] = [model.vocabulary.encode(text) for text in job["texts"]]
  result["decoded"] = [model.vocabulary.decode(ids) for ids in job["ids"]]
  too_long = np.full((1, model.input_length + 1), 5, np.int32)
  result["errors"] = [error_of(lambda: model.generate(too_long)),
                      error_of(lambda: model.generate_text([job["too_long_text"]]))]
results["t5lite_imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "t5lite")
print(json.dumps(results))
"""


def corpus() -> list[str]:
  """Real English text to train a small sentencepiece model on: stdlib docstrings."""
  docs = [getattr(getattr(module, name), "__doc__", None)
          for module in (json, inspect, textwrap, pickle) for name in sorted(dir(module))]
  return [doc for doc in docs if isinstance(doc, str)]


@pytest.fixture(scope="module")
def vocabularies():
  pieces = train_sentencepiece(corpus(), 400)
  return {"sentencepiece": SentencePieceVocabulary(pieces, extra_ids=10),
          "byte": ByteVocabulary(extra_ids=100)}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, vocabularies):
  """{vocabulary kind: (MODEL_DIR, artifact)}, exported through the CLI; the byte one with
  greedy only. Its two exports take seconds even on a warm compilation cache (8 s on a
  2-core Zen 3 EPYC): in SLOW_FIXTURES."""
  params = init_params(CONFIG, 0)
  out = {}
  for kind, vocabulary in vocabularies.items():
    root = tmp_path_factory.mktemp(kind)
    write_model_dir(root / "model", CONFIG, params, step=7, vocabulary=vocabulary)
    argv = ["export", "serving", "--checkpoint", str(root / "model" / "checkpoints" / "7"),
            "--out", str(root / "artifact"), "--input_length", str(INPUT_LENGTH),
            "--max_decode_length", str(MAX_DECODE_LENGTH)]
    assert cli.main(argv + (["--methods", "greedy"] if kind == "byte" else [])) == 0
    out[kind] = (root / "model", root / "artifact")
  return out


@pytest.fixture(scope="module")
def live(artifacts):
  """(config, params) as t5lite loads them from the MODEL_DIR."""
  config, params, _ = load_params(artifacts["sentencepiece"][0])
  return config, params


def batches() -> dict[str, np.ndarray]:
  """Batch 1 at the full input length; batch 3 shorter than it, rows of different lengths."""
  rng = np.random.RandomState(0)
  one = rng.randint(3, 410, size=(1, INPUT_LENGTH)).astype(np.int32)
  one[0, -1] = 1
  three = rng.randint(3, 410, size=(3, 11)).astype(np.int32)
  for row, length in enumerate((11, 6, 2)):
    three[row, length - 1], three[row, length:] = 1, 0
  return {"batch1": one, "batch3": three}


def decode_cases(vocabulary) -> list[list[int]]:
  """Output-like rows: sentinels, ids past the vocabulary (padded embedding rows), pad, EOS."""
  sentinels = [vocabulary.extra_id(0), vocabulary.extra_id(3)]
  return [[40, 41, 42, 1, 43], [0, 50, *sentinels, 60, 0, 70], [409, 410, 450, 511, 12],
          [1, 5, 6], [], [5, 200, 201, 202, 203, 300]]


@pytest.fixture(scope="module")
def fresh(artifacts, vocabularies):
  """What the artifacts' loader returns in a fresh, isolated process (-I: no PYTHONPATH, no
  current folder on sys.path), started in the artifact folder."""
  job = dict(artifacts={kind: str(paths[1]) for kind, paths in artifacts.items()},
             tokens={k: v.tolist() for k, v in batches().items()}, texts=TEXTS,
             ids=decode_cases(vocabularies["sentencepiece"]), too_long_text=TOO_LONG_TEXT)
  result = subprocess.run([sys.executable, "-I", "-B", "-c", FRESH_PROCESS, json.dumps(job)],
                          cwd=artifacts["sentencepiece"][1], env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.splitlines()[-1])


def live_generate(live, tokens, method) -> np.ndarray:
  padded = np.pad(tokens, ((0, 0), (0, INPUT_LENGTH - tokens.shape[1])))
  return decoding.generate(*live, padded, max_decode_length=MAX_DECODE_LENGTH, method=method,
                           num_beams=4, alpha=0.6)


def live_text(live, vocabulary, texts, method) -> list[str]:
  rows = [np.append(vocabulary.encode(text), 1) for text in texts]
  tokens = np.stack([np.pad(row, (0, INPUT_LENGTH - len(row))) for row in rows])
  return vocabulary.decode_batch(live_generate(live, tokens, method))


def test_artifact_layout(artifacts):
  model_dir, artifact = artifacts["sentencepiece"]
  assert sorted(os.listdir(artifact)) == [
      "beam.jax_export", "greedy.jax_export", "params.safetensors", "serving.json",
      "serving_loader.py", "spiece.model", "vocabulary.json"]
  manifest = json.loads((artifact / "serving.json").read_text())
  assert manifest["model_config"] == CONFIG.to_dict()
  assert (manifest["step"], manifest["input_length"], manifest["max_decode_length"]) == (7, 16, 8)
  assert (manifest["methods"], manifest["num_beams"], manifest["alpha"]) == (["greedy", "beam"],
                                                                              4, 0.6)
  assert manifest["platforms"][0] == "cpu"  # and cuda, where jax can lower for it here
  assert sorted(manifest["files"]) == sorted(set(os.listdir(artifact)) - {"serving.json"})
  digest = hashlib.sha256((artifact / "params.safetensors").read_bytes()).hexdigest()
  assert manifest["files"]["params.safetensors"]["sha256"] == digest
  _, params, _ = load_params(model_dir)
  saved = safetensors.numpy.load_file(str(artifact / "params.safetensors"))
  flat = traverse_util.flatten_dict(params, sep="/")
  assert sorted(saved) == sorted(flat)
  for key, value in flat.items():
    assert saved[key].dtype == value.dtype
    np.testing.assert_array_equal(saved[key], np.asarray(value))


def test_loader_imports_no_t5lite():
  source = pathlib.Path(serving_loader.__file__).read_text()
  imported = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      imported |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
      imported.add(node.module.split(".")[0])
  assert imported <= ALLOWED_IMPORTS, imported - ALLOWED_IMPORTS


@pytest.mark.e2e
def test_fresh_process_ids_equal_live_model(fresh, live):
  assert fresh["t5lite_imported"] == []
  for kind, methods in (("sentencepiece", ("greedy", "beam")), ("byte", ("greedy",))):
    for method in methods:
      for key, tokens in batches().items():
        got = np.asarray(fresh[kind][f"{method}/{key}"])
        np.testing.assert_array_equal(got, live_generate(live, tokens, method),
                                      err_msg=f"{kind} {method} {key}")
  assert "beam/batch1" not in fresh["byte"]  # exported greedy only
  assert fresh["byte"]["greedy/batch3_wide"] == fresh["byte"]["greedy/batch3"]


@pytest.mark.e2e
def test_fresh_process_text_equals_live_decode(fresh, live, vocabularies):
  for kind, vocabulary in vocabularies.items():
    assert fresh[kind]["encoded"] == [vocabulary.encode(text).tolist() for text in TEXTS]
    ids = decode_cases(vocabulary)
    assert fresh[kind]["decoded"] == [vocabulary.decode(row) for row in ids]
    for method in ("greedy", "beam") if kind == "sentencepiece" else ("greedy",):
      assert fresh[kind][f"{method}/texts"] == live_text(live, vocabulary, TEXTS, method)
  assert "<extra_id_3>" in fresh["sentencepiece"]["decoded"][1]  # sentinels decode as text


@pytest.mark.e2e
def test_too_long_inputs_are_refused(fresh):
  for kind in ("sentencepiece", "byte"):
    for error in fresh[kind]["errors"]:
      assert error is not None and "input_length 16" in error and "never truncated" in error
  assert "17 tokens" in fresh["sentencepiece"]["errors"][0]


@pytest.mark.e2e
def test_loader_command_line(artifacts, live, vocabularies):
  artifact = artifacts["sentencepiece"][1]
  texts = [arg for text in TEXTS for arg in ("--text", text)]
  result = subprocess.run(
      [sys.executable, "-I", "-B", str(artifact / "serving_loader.py"), str(artifact), *texts,
       "--method", "beam"], cwd=artifact, env=dict(os.environ), capture_output=True, text=True,
      timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  expected = live_text(live, vocabularies["sentencepiece"], TEXTS, "beam")
  assert result.stdout == "".join(text + "\n" for text in expected)


def test_export_refusals(artifacts):
  model_dir, artifact = artifacts["sentencepiece"]
  with pytest.raises(FileExistsError, match="not empty"):
    serving.export_serving(model_dir, artifact, input_length=16, max_decode_length=8)
  with pytest.raises(ValueError, match="methods"):
    serving.export_serving(model_dir, artifact.parent / "new", input_length=16,
                           max_decode_length=8, methods=("sample",))


def test_cpu_only_artifacts_run_on_the_cpu_under_a_gpu_default_backend(artifacts, tmp_path,
                                                                      monkeypatch):
  cpu = jax.devices("cpu")[0]
  assert serving_loader.run_device(["cpu"], "cuda") == cpu
  assert serving_loader.run_device(["cpu", "cuda"], "cuda") is None  # the default device
  assert serving_loader.run_device(["cpu"], "cpu") is None
  artifact = tmp_path / "artifact"
  shutil.copytree(artifacts["byte"][1], artifact)
  manifest = json.loads((artifact / "serving.json").read_text())
  (artifact / "serving.json").write_text(json.dumps({**manifest, "platforms": ["cpu"]}))
  monkeypatch.setattr(jax.export, "default_export_platform", lambda: "cuda")
  model = serving_loader.ServingModel.load(artifact)
  assert model.device == cpu
  assert {device for x in jax.tree.leaves(model.params) for device in x.devices()} == {cpu}


def test_bf16_params_round_trip_through_the_loader(live, tmp_path):
  """A bf16 export's params.safetensors, read by the artifact's loader: dtype and bits kept.
  (A whole bf16 artifact in the fresh process would cost several seconds of compiling.)"""
  params = cast_params(live[1], "bfloat16")
  serving._write_artifact(str(tmp_path), {"exports": {}}, params, {}, None)
  loaded = traverse_util.flatten_dict(
      serving_loader.load_params(tmp_path / serving.PARAMS_FILE), sep="/")
  flat = traverse_util.flatten_dict(params, sep="/")
  assert sorted(loaded) == sorted(flat)
  for key, value in flat.items():
    assert loaded[key].dtype == np.dtype("bfloat16") == value.dtype, key
    assert loaded[key].tobytes() == np.asarray(value).tobytes(), key


# --- an artifact is not trusted whole --------------------------------------------------------

def tampered(artifacts, tmp_path, kind="byte", reseal=True, manifest=None, **files):
  """A copy of an artifact with `files` {name: bytes} rewritten and the manifest updated by
  `manifest` (a function); reseal: serving.json lists the new files' checksums, as if the
  artifact had been exported that way (so the check after the checksums is what refuses)."""
  artifact = tmp_path / "artifact"
  shutil.copytree(artifacts[kind][1], artifact)
  path = artifact / "serving.json"
  listing = json.loads(path.read_text())
  for name, data in files.items():
    (artifact / name).write_bytes(data)
    if reseal:
      listing["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
  path.write_text(json.dumps(manifest(listing) if manifest else listing))
  return artifact


def params_file(artifacts, change) -> bytes:
  """The byte artifact's params.safetensors with change(flat params) applied."""
  flat = safetensors.numpy.load_file(str(artifacts["byte"][1] / "params.safetensors"))
  change(flat)
  return safetensors.numpy.save(flat)


def loader_error(artifact, capfd) -> str:
  """The one line serving_loader.py's command line prints for a refused artifact (exit 2)."""
  capfd.readouterr()
  assert serving_loader.main([str(artifact), "--text", "hello"]) == 2
  err = capfd.readouterr().err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  assert err.startswith("serving_loader: error: ")
  return err


def _nan(flat):
  key = sorted(flat)[0]
  flat[key] = np.full_like(flat[key], np.nan)


def _fp16(flat):
  key = sorted(flat)[0]
  flat[key] = flat[key].astype(np.float16)


def _wrong_shape(flat):
  key = sorted(flat)[0]
  flat[key] = flat[key][:-1]


def _missing(flat):
  del flat[sorted(flat)[0]]


@pytest.mark.parametrize("change, message", [
    (_nan, "holds NaN or inf values"), (_fp16, r"is float16\[.*the functions take float32"),
    (_wrong_shape, r"the functions take float32\["), (_missing, "params missing")])
def test_params_must_be_what_the_functions_take_and_finite(artifacts, tmp_path, capfd, change,
                                                           message):
  artifact = tampered(artifacts, tmp_path, **{"params.safetensors": params_file(artifacts,
                                                                                change)})
  assert re.search(message, loader_error(artifact, capfd))


def test_a_damaged_file_fails_its_checksum_and_a_cut_export_is_named(artifacts, tmp_path, capfd):
  data = bytearray((artifacts["byte"][1] / "params.safetensors").read_bytes())
  data[len(data) // 2] ^= 0x10
  flipped = tampered(artifacts, tmp_path / "a", reseal=False,
                     **{"params.safetensors": bytes(data)})
  assert "params.safetensors fails its SHA-256 check" in loader_error(flipped, capfd)
  export = (artifacts["byte"][1] / "greedy.jax_export").read_bytes()
  cut = tampered(artifacts, tmp_path / "b", reseal=False,
                 **{"greedy.jax_export": export[:len(export) // 2]})
  assert f"has {len(export) // 2} bytes, {len(export)} were written" in loader_error(cut, capfd)
  resealed = tampered(artifacts, tmp_path / "c", **{"greedy.jax_export": export[:100]})
  assert "is not a readable jax.export function" in loader_error(resealed, capfd)


def test_paths_that_leave_the_artifact_are_refused(artifacts, tmp_path, capfd):
  outside = tmp_path / "other"
  outside.mkdir()
  shutil.copy(artifacts["byte"][1] / "params.safetensors", outside)
  escape = tampered(artifacts, tmp_path / "a", manifest=lambda m: {
      **m, "params": "../other/params.safetensors"})
  assert "is outside the artifact's folder" in loader_error(escape, capfd)
  vocabulary = json.loads((artifacts["sentencepiece"][1] / "vocabulary.json").read_text())
  passwd = json.dumps({**vocabulary, "model_file": "/etc/passwd"}).encode()
  absolute = tampered(artifacts, tmp_path / "b", kind="sentencepiece",
                      **{"vocabulary.json": passwd})
  assert "'/etc/passwd' is outside the artifact's folder" in loader_error(absolute, capfd)


def test_a_vocabulary_larger_than_the_model_is_refused_before_it_is_built(artifacts, tmp_path,
                                                                          capfd):
  vocabulary = json.loads((artifacts["byte"][1] / "vocabulary.json").read_text())
  huge = json.dumps({**vocabulary, "extra_ids": 30_000_000}).encode()
  artifact = tampered(artifacts, tmp_path, **{"vocabulary.json": huge})
  assert ("extra_ids 30000000 does not fit the model's 512 embedding rows"
          in loader_error(artifact, capfd))


def test_an_artifact_of_symlinks_loads_when_its_checksums_hold(artifacts, tmp_path):
  """A model hub's cache links each file to a blob elsewhere: the checksums vouch for them."""
  linked = tmp_path / "snapshot"
  linked.mkdir()
  for name in os.listdir(artifacts["byte"][1]):
    (linked / name).symlink_to(artifacts["byte"][1] / name)
  assert serving_loader.ServingModel.load(linked).vocabulary is not None


def test_an_artifact_without_checksums_loads_with_a_warning(artifacts, tmp_path, capfd):
  artifact = tampered(artifacts, tmp_path, manifest=lambda m: {
      k: v for k, v in m.items() if k != "files"})
  capfd.readouterr()
  model = serving_loader.ServingModel.load(artifact)
  assert model.vocabulary is not None
  assert "lists no checksums" in capfd.readouterr().err
