"""`t5lite export serving`: the artifact, reloaded in a fresh process that never imports t5lite,
decodes exactly as the live model (ids and text, greedy and beam, batch sizes 1 and 3)."""
import ast
import inspect
import json
import os
import pathlib
import pickle
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
CONFIG = tiny(vocab_size=512)  # above the vocabularies' 410 and 359 ids: padded rows get decoded
# Each at most 15 bytes, so that with EOS they fit INPUT_LENGTH under both vocabularies.
TEXTS = ["Return a list", "héllo wörld", "a <extra_id_2>"]
TOO_LONG_TEXT = "a sentence far longer than sixteen tokens " * 3
ALLOWED_IMPORTS = {"__future__", "argparse", "json", "pathlib", "struct", "sys", "typing",
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
  greedy only."""
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
@pytest.mark.slow
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
@pytest.mark.slow
def test_fresh_process_text_equals_live_decode(fresh, live, vocabularies):
  for kind, vocabulary in vocabularies.items():
    assert fresh[kind]["encoded"] == [vocabulary.encode(text).tolist() for text in TEXTS]
    ids = decode_cases(vocabulary)
    assert fresh[kind]["decoded"] == [vocabulary.decode(row) for row in ids]
    for method in ("greedy", "beam") if kind == "sentencepiece" else ("greedy",):
      assert fresh[kind][f"{method}/texts"] == live_text(live, vocabulary, TEXTS, method)
  assert "<extra_id_3>" in fresh["sentencepiece"]["decoded"][1]  # sentinels decode as text


@pytest.mark.e2e
@pytest.mark.slow
def test_too_long_inputs_are_refused(fresh):
  for kind in ("sentencepiece", "byte"):
    for error in fresh[kind]["errors"]:
      assert error is not None and "input_length 16" in error and "never truncated" in error
  assert "17 tokens" in fresh["sentencepiece"]["errors"][0]


@pytest.mark.e2e
@pytest.mark.slow
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
