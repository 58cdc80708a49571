"""The interchange verbs with a bucket on either side, against the local GCS server of
helpers/storage_servers.py: `import t5x` from a T5X model dir in a bucket (only the step read
is fetched), `import peft` of an adapter in a bucket onto a base in a bucket, and `export
serving` into a bucket, each giving what the same verb gives on local folders.
"""
import hashlib
import json
import os

import jax
import numpy as np
import pytest

from helpers import assert_trees_equal, checkpoint_params
from helpers.storage_servers import upload_tree
from helpers.t5x_checkpoints import V11, t5x_target, write_msgpack_checkpoint
from t5lite import cli
from t5lite.data.vocab.vocabularies import train_sentencepiece
from t5lite.families import family_of
from t5lite.interop.peft import lora as peft_format
from t5lite.interop.peft import record as peft_record
from t5lite.models import adapters
from t5lite.models.adapters import AdapterConfig
from t5lite.models.params import init_params
from t5lite.util import paths, staging

# One worker runs the modules that share the session-scoped reliability_reference run
# (helpers/fixtures.py): built once, not once per pytest-xdist worker (`--dist loadgroup`).
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("reliability_reference")]

# T5X's operative config.gin, naming the SentencePiece model beside it (a relative path).
T5X_GIN = """network.T5Config.mlp_activations = ('gelu', 'linear')
network.T5Config.logits_via_embedding = False
seqio.SentencePieceVocabulary.sentencepiece_model_file = 'spiece.model'
seqio.SentencePieceVocabulary.extra_ids = 7
"""


@pytest.fixture(scope="module")
def spm_bytes() -> bytes:
  texts = ["the cat sat on the mat", "a dog and a cat", "tea at ten to two"] * 20
  return train_sentencepiece(texts, 20, byte_fallback=False)


def _last_json(capsys) -> dict:
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_import_t5x_from_a_bucket_reads_only_the_chosen_step_and_equals_a_local_import(
    gcs_server, spm_bytes, tmp_path, capsys, monkeypatch):
  """A T5X model dir with two steps, config.gin naming the SentencePiece model beside it: the
  bucket import (newest step; --step 10; one step's folder as --from) writes the MODEL_DIR of
  the local import, and fetches the chosen step's objects and the model dir's own files only."""
  params = init_params(V11, 3)
  newest = t5x_target(V11, params)
  t5x_dir = tmp_path / "t5x"
  write_msgpack_checkpoint(str(t5x_dir / "checkpoint_10"), {k: v + 1 for k, v in newest.items()},
                           10)
  write_msgpack_checkpoint(str(t5x_dir / "checkpoint_20"), newest, 20)
  (t5x_dir / "spiece.model").write_bytes(spm_bytes)
  (t5x_dir / "config.gin").write_text(T5X_GIN)
  fetched = []
  download = staging.download

  def counting(source, keep=None, keep_name=False):
    pick = (lambda names: fetched.extend(keep(names)) or keep(names)) if keep else None
    return download(source, keep=pick, keep_name=keep_name)

  monkeypatch.setattr(staging, "download", counting)
  with gcs_server.activated():
    url = gcs_server.url(gcs_server.new_bucket(), "t5x")
    upload_tree(t5x_dir, url)
    for args, want_step in (([], 20), (["--step", "10"], 10)):
      local_out, bucket_out = str(tmp_path / f"local{want_step}"), f"{url}-out/{want_step}"
      assert cli.main(["import", "t5x", "--from", str(t5x_dir), "--out", local_out] + args) == 0
      capsys.readouterr()
      fetched.clear()
      assert cli.main(["import", "t5x", "--from", url, "--out", bucket_out] + args) == 0
      report = _last_json(capsys)
      assert (report["from"], report["out"], report["step"]) == (url, bucket_out, want_step)
      assert report["checkpoint"].startswith(bucket_out + "/"), report
      assert sorted({n.split("/")[0] for n in fetched}) == sorted(
          [f"checkpoint_{want_step}", "config.gin", "spiece.model"]), fetched
      got_config, got, got_step = checkpoint_params(bucket_out)
      want_config, want, _ = checkpoint_params(local_out)
      assert got_config == want_config and got_step == want_step
      assert_trees_equal(got, want)
      assert paths.read_text(f"{bucket_out}/vocabulary.json") == open(
          os.path.join(local_out, "vocabulary.json")).read()
    assert_trees_equal(checkpoint_params(f"{url}-out/20")[1], params)
    # One step's folder as --from: the model dir's config.gin still names the vocabulary.
    assert cli.main(["import", "t5x", "--from", f"{url}/checkpoint_20", "--out",
                     f"{url}-out/folder"]) == 0
    assert _last_json(capsys)["step"] == 20
    assert_trees_equal(checkpoint_params(f"{url}-out/folder")[1], params)
    assert '"extra_ids": 7' in paths.read_text(f"{url}-out/folder/vocabulary.json")
    # A missing step is named with the steps there; nothing is written.
    assert cli.main(["import", "t5x", "--from", url, "--out", f"{url}-out/none",
                     "--step", "15"]) == 2
    assert f"{url} has no checkpoint_15; steps there: [10, 20]" in capsys.readouterr().err
    assert not paths.files_under(f"{url}-out/none")


def test_import_peft_and_export_serving_with_a_bucket_on_each_side(
    gcs_server, reliability_reference, tmp_path, capsys):
  """The tiny reference run in a bucket as the base: a peft adapter from the bucket imports
  into a RUN_DIR in the bucket with the params of the local import; `export serving` of the
  base into the bucket writes the local export's files, byte for byte."""
  base_config, base_params, _ = checkpoint_params(reliability_reference)
  adapted = base_config.replace(adapter=AdapterConfig(r=2, lora_alpha=4,
                                                      target_modules=("query", "value")))
  rng = np.random.RandomState(0)
  half = adapters.split(family_of(adapted).abstract_params(), ())[1]
  half = jax.tree.map(lambda s: rng.normal(0, 0.5, s.shape).astype(s.dtype), half)
  peft_format.save_peft(adapted, half, str(tmp_path / "adapter"))
  with gcs_server.activated():
    url = gcs_server.url(gcs_server.new_bucket(), "peft")
    upload_tree(reliability_reference, f"{url}/base")
    upload_tree(tmp_path / "adapter", f"{url}/adapter")
    for source, base, out in (
        (f"{url}/adapter", f"{url}/base", f"{url}/run"),
        (str(tmp_path / "adapter"), str(reliability_reference), str(tmp_path / "run"))):
      assert cli.main(["import", "peft", "--from", source, "--base", base, "--out", out]) == 0
      report = _last_json(capsys)
      assert (report["from"], report["base"], report["out"]) == (source, base, out), report
    assert json.loads(paths.read_text(f"{url}/run/peft.json"))["base"] == f"{url}/base"
    # Joined with its base, read from the bucket (fingerprint checked), as the local one.
    got_config, got, got_step = peft_record.load_run(f"{url}/run")
    want_config, want, want_step = peft_record.load_run(str(tmp_path / "run"))
    assert got_config == want_config and got_step == want_step == 0
    assert got_config.adapter.r == 2
    assert_trees_equal(jax.device_get(got), jax.device_get(want))

    serving = ["--input_length", "16", "--max_decode_length", "4", "--methods", "greedy"]
    for checkpoint, out in ((f"{url}/base", f"{url}/serving"),
                            (str(reliability_reference), str(tmp_path / "serving"))):
      assert cli.main(["export", "serving", "--checkpoint", checkpoint, "--out", out]
                      + serving) == 0
      assert f"wrote serving artifact {out}:" in capsys.readouterr().out
    names = paths.files_under(f"{url}/serving")
    assert names == paths.files_under(str(tmp_path / "serving")) and "serving.json" in names
    for rel in names:
      got = paths.read_bytes(f"{url}/serving/{rel}")
      want = (tmp_path / "serving" / rel).read_bytes()
      if rel.endswith(".safetensors"):  # its header's metadata comes in any order: parse it
        got, want = _safetensors(got), _safetensors(want)
      if rel == "serving.json":  # and so its SHA-256 differs: each matches its own file
        got, want = json.loads(got), json.loads(want)
        for manifest, where in ((got, f"{url}/serving"), (want, str(tmp_path / "serving"))):
          params = paths.read_bytes(f"{where}/params.safetensors")
          listed = manifest["files"].pop("params.safetensors")
          assert listed == {"size": len(params),
                            "sha256": hashlib.sha256(params).hexdigest()}, where
      assert got == want, rel
    # Into a prefix that holds files: refused, nothing written over.
    assert cli.main(["export", "serving", "--checkpoint", f"{url}/base", "--out",
                     f"{url}/serving"] + serving) == 2
    assert f"--out {url}/serving is not empty" in capsys.readouterr().err


def test_compile_writes_its_hlo_report_into_a_bucket(gcs_server, capsys, tmp_path):
  """`t5lite compile --emit_hlo gs://...` (the CUDA lowering: no libtpu needed) writes the text
  the same command writes into a local folder."""
  argv = ["compile", "--platform", "cuda", "--devices", "2", "--gin_file=gin/runs/pretrain.gin",
          "--gin_file=gin/models/tiny.gin", "--gin.BATCH_SIZE=4",
          "--gin.TASK_FEATURE_LENGTHS={'inputs': 16, 'targets': 8}"]
  name = "train_step.cuda.stablehlo.txt"
  with gcs_server.activated():
    url = gcs_server.url(gcs_server.new_bucket(), "reports")
    for where in (url, str(tmp_path)):
      assert cli.main(argv + ["--emit_hlo", where]) == 0
      report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
      assert report["hlo_path"] == paths.join(where, name)
    assert paths.read_text(f"{url}/{name}") == (tmp_path / name).read_text()
  assert cli.main(argv + ["--emit_hlo", "hdfs://nn/reports"]) == 2
  assert "--emit_hlo='hdfs://nn/reports'" in capsys.readouterr().err


def _safetensors(data: bytes) -> tuple[dict, dict]:
  """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file's bytes."""
  import struct
  size = struct.unpack("<Q", data[:8])[0]
  header = json.loads(data[8:8 + size])
  metadata = header.pop("__metadata__", {})
  body = data[8 + size:]
  return metadata, {k: (v["dtype"], v["shape"], body[slice(*v["data_offsets"])])
                    for k, v in header.items()}
