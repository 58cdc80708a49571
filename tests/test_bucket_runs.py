"""Training runs whose MODEL_DIR is a bucket (gs://, s3://), against the local storage servers
of helpers/storage_servers.py: the same run as on a local disk, bitwise, through SIGKILLs,
damage, a second trainer and a storage server that goes away mid-save.
"""
import collections
import importlib
import json
import random
import re
import signal
import socket
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers import assert_trees_equal, checkpoint_params, logged_losses
from helpers.cli import run_t5lite
from helpers.storage_servers import upload_tree
from helpers.runs import (
    NEWEST, PREVIOUS, STEPS, assert_same_run_as, logged_steps, one_error_line, train_argv)
from t5lite import cli
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import integrity
from t5lite.runtime import lease as lease_lib
from t5lite.util import atomic, paths

# One worker runs the modules that share the session-scoped reliability_reference run
# (helpers/fixtures.py): built once, not once per pytest-xdist worker (`--dist loadgroup`).
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("reliability_reference")]


def _steps_on(url: str) -> list[int]:
  listed = paths.files_under(paths.join(url, "checkpoints"))
  return sorted({int(rel.split("/")[0]) for rel in listed if rel.split("/")[0].isdigit()})


def _flip_a_byte_of_the_largest_array_file(step_dir: str) -> str:
  files = [rel for rel in paths.files_under(step_dir) if "/d/" in f"/{rel}"]
  rel = max(files, key=lambda rel: (paths.size(paths.join(step_dir, rel)), rel))
  data = bytearray(paths.read_bytes(paths.join(step_dir, rel)))
  data[len(data) // 2] ^= 0x01
  atomic.write_file(paths.join(step_dir, rel), bytes(data))
  return rel


def test_a_run_on_a_bucket_equals_the_local_run_and_a_damaged_step_is_set_aside_and_retrained(
    bucket, reliability_gin_file, reliability_reference, capsys, tmp_path):
  """The whole run on a gs:// or s3:// bucket (s3://: orbax writes a local mirror of its
  checkpoints, t5lite/runtime/checkpoint_mirror.py): checkpoints sealed there, metrics and
  TensorBoard events, losses and params bitwise the local run's. Then a byte flipped in the newest step's largest
  array object: the rerun names it, copies the step aside to checkpoints/20.corrupt-1 (a
  bucket has no rename), falls back to step 18 and trains steps 19-20 to the same params.
  Last, LoRA with that bucket run as its BASE trains as with the local run as BASE."""
  _, expected, _ = checkpoint_params(reliability_reference)
  model_dir = paths.join(bucket[1], "runs/one")
  assert cli.main(train_argv(reliability_gin_file, model_dir)) == 0
  assert _steps_on(model_dir) == [PREVIOUS, NEWEST]
  for step in (PREVIOUS, NEWEST):
    assert integrity.verify(paths.join(model_dir, "checkpoints", str(step)), step)
  for name in ("model_config.json", "config.gin", "vocabulary.json"):
    assert paths.isfile(paths.join(model_dir, name)), name
  assert any(rel.startswith("events.out.tfevents")
             for rel in paths.files_under(paths.join(model_dir, "tensorboard")))
  assert_same_run_as(model_dir, reliability_reference)
  _, params, step = checkpoint_params(model_dir)
  assert step == STEPS
  assert_trees_equal(params, expected)
  capsys.readouterr()

  newest = paths.join(model_dir, "checkpoints", str(NEWEST))
  damaged = _flip_a_byte_of_the_largest_array_file(newest)
  assert cli.main(train_argv(reliability_gin_file, model_dir)) == 0
  err = capsys.readouterr().err
  assert (f"t5lite: warning: checkpoint step {NEWEST}: {damaged} (array data) fails its "
          f"CRC32C check") in err, err
  assert (f"moved to checkpoints/{NEWEST}.corrupt-1, falling back to step {PREVIOUS}") in err
  aside = paths.join(model_dir, "checkpoints", f"{NEWEST}.corrupt-1")
  assert damaged in paths.files_under(aside)  # kept for a post-mortem
  assert paths.isfile(paths.join(model_dir, integrity.LOG_FILE))
  assert _steps_on(model_dir) == [PREVIOUS, NEWEST]
  assert integrity.verify(newest, NEWEST)
  assert_same_run_as(model_dir, reliability_reference)
  _, params, step = checkpoint_params(model_dir)
  assert step == STEPS
  assert_trees_equal(params, expected)

  # LoRA on the bucket's run as its frozen BASE trains as on the local copy of that run.
  lora_gin = tmp_path / "lora.gin"
  lora_gin.write_text(LORA_GIN.format(run=reliability_gin_file))
  runs = {}
  for where, base in (("bucket", model_dir), ("local", str(reliability_reference))):
    runs[where] = tmp_path / f"lora-{where}"
    assert cli.main(train_argv(lora_gin, runs[where], f"--gin.BASE='{base}'")) == 0
  assert logged_losses(runs["bucket"]) == logged_losses(runs["local"])
  records = [json.loads((runs[w] / "peft.json").read_text()) for w in ("bucket", "local")]
  assert records[0]["base"] == model_dir
  assert records[0]["base_fingerprint"] == records[1]["base_fingerprint"]
  assert_trees_equal(*(checkpoint_states(runs[w]) for w in ("bucket", "local")))


LORA_GIN = """
include '{run}'
TRAIN_STEPS = 3
CheckpointConfig.period = 3
BASE = ''
TrainConfig.peft = @PeftConfig()
PeftConfig.base = %BASE
PeftConfig.adapter = @AdapterConfig()
AdapterConfig.method = 'lora'
AdapterConfig.r = 4
AdapterConfig.target_modules = ('query', 'value')
"""


def checkpoint_states(model_dir):
  """The newest checkpoint's saved arrays (a PEFT run's: its adapters), as numpy."""
  checkpointer = ckpt_lib.Checkpointer(model_dir, read_only=True)
  step = checkpointer.latest_step()
  checkpointer.fetch(step)
  restored = ocp.PyTreeCheckpointer().restore(paths.join(checkpointer.step_dir(step), "state"))
  checkpointer.close()
  return restored


def test_a_missing_bucket_is_refused_in_one_line(bucket, capsys):
  server, _ = bucket
  missing = f"{server.scheme}://no-such-bucket-t5lite/run"
  assert cli.main(["train", "--gin_file=gin/runs/demo.gin", f"--gin.MODEL_DIR={missing}",
                   "--gin.TRAIN_STEPS=1"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err
  line = one_error_line(err, "t5lite train")
  assert missing in line and "check that the bucket exists" in line, err


# --- SIGKILLs of a run on a bucket ----------------------------------------------------------

COMMIT = integrity.COMMIT_MARKER
# What each kill waits for (as test_reliability's, seen through the bucket's listing), one
# restart each (every restart costs a whole startup): the first save in flight (a step folder
# without orbax's commit marker, nothing committed yet), a step just committed (its seal and
# retention cleanup follow), a random delay from the spawn (restore from the bucket, the
# lease), a random point in the steps. The first attempt races a second trainer for the lease.
# On gs:// six more: four random delays from the spawn (the cheapest kills: a restart killed
# again while it restores), a later save in flight and a step, ten in all.
BUCKET_PLAN = ["save", "commit", "startup", "step"]
MORE_ON_GCS = ["startup", "save", "startup", "step", "startup", "startup"]


def _step_folders(ckpts: str) -> tuple[set[int], set[int]]:
  """(committed steps, steps being saved) under a bucket's checkpoints/ prefix."""
  try:
    listed = paths.files_under(ckpts)
  except FileNotFoundError:
    return set(), set()
  steps = {int(rel.split("/")[0]) for rel in listed if rel.split("/")[0].isdigit()}
  done = {s for s in steps if f"{s}/{COMMIT}" in listed}
  return done, steps - done


def _kill_at(process, log_path, ckpts, mode, rng, limit):
  """SIGKILLs the run at `mode`'s moment (or once it logs step `limit`); returns what the
  bucket held then: (committed, in flight, trained)."""
  deadline = time.monotonic() + 180
  fire_at = time.monotonic() + rng.uniform(0.2, 6.0) if mode == "startup" else None
  at_start = _step_folders(ckpts)[0]
  while True:
    if process.poll() is not None:
      pytest.fail(f"the run ended (exit {process.returncode}) before its {mode!r} kill:\n"
                  f"{log_path.read_text()[-4000:]}")
    assert time.monotonic() < deadline, f"no {mode!r} moment within 180 s"
    done, saving = _step_folders(ckpts)
    steps = logged_steps(log_path.read_text())
    if steps and max(steps) >= limit:
      break
    if mode == "startup" and time.monotonic() >= fire_at:
      break
    if steps and mode == "save" and saving:
      break
    if steps and mode == "commit" and done - at_start:
      break
    if steps and mode == "step":
      fire_at = fire_at or time.monotonic() + rng.uniform(0, 1.5)
      if time.monotonic() >= fire_at:
        break
    time.sleep(0.01)
  done, saving = _step_folders(ckpts)
  process.send_signal(signal.SIGKILL)
  assert process.wait() == -signal.SIGKILL
  return done, saving, bool(steps)


def _first_to_exit(a, b, timeout: float = 180):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    for one, other in ((a, b), (b, a)):
      if one.poll() is not None:
        return one, other
    time.sleep(0.05)
  pytest.fail("neither of two trainers started together exited")


def test_sigkills_at_chosen_points_of_a_run_on_a_bucket_then_it_equals_the_local_run(
    bucket, reliability_gin_file, reliability_reference, tmp_path):
  """Two trainers started together on the bucket: one exits 2 naming the lease, the other
  runs. Then SIGKILLs of `t5lite train` with MODEL_DIR on the bucket at the moments of
  BUCKET_PLAN (the first save in flight, a fresh commit, startup, a step; on gs:// ten kills
  in all), each followed by a restart that resumes from the newest committed step; the last run finishes. Losses and
  params equal the local uninterrupted run's, bitwise, each step logged once; nothing damaged
  was found, no lease is left."""
  rng = random.Random(20261127)
  server, url = bucket
  model_dir = paths.join(url, "runs/killed")
  ckpts = paths.join(model_dir, "checkpoints")
  env = server.env
  landed = collections.Counter()
  logs = []
  plan = BUCKET_PLAN + (MORE_ON_GCS if server.scheme == "gs" else [])
  for attempt, mode in enumerate(plan):
    latest = max(_step_folders(ckpts)[0] or {0})
    log_path = tmp_path / f"attempt{attempt:02d}.log"
    logs.append(log_path)
    process = run_t5lite(*train_argv(reliability_gin_file, model_dir), wait=False,
                         tests_on_path=True, env=env, log=log_path)
    if attempt == 0:  # a second trainer started at the same moment: one of them runs
      rival_log = tmp_path / "rival.log"
      rival = run_t5lite(*train_argv(reliability_gin_file, model_dir), wait=False,
                         tests_on_path=True, env=env, log=rival_log)
      loser, winner = _first_to_exit(process, rival)
      assert loser.wait() == 2, (log_path.read_text(), rival_log.read_text())
      out = (log_path if loser is process else rival_log).read_text()
      line = one_error_line(out, "t5lite train")
      assert f"MODEL_DIR {model_dir} is in use by another trainer" in line, out
      process, log_path = winner, (rival_log if winner is rival else log_path)
      logs[-1] = log_path
    done, saving, trained = _kill_at(process, log_path, ckpts, mode, rng,
                                     min(latest + 7, STEPS - 1))
    landed[mode] += 1
    landed["a save in flight"] += bool(saving and trained)
    landed["the first save in flight"] += bool(mode == "save" and saving and not done)
    landed["a fresh commit"] += bool(mode == "commit" and max(done or {0}) > latest)
    newest = max(done or {0})
    if newest and not integrity.is_sealed(paths.join(ckpts, str(newest))):
      landed["newest step committed, not sealed"] += 1
    out = log_path.read_text()
    resumed = re.findall(r"t5lite: resuming from step (\d+)", out)
    if resumed:
      assert int(resumed[0]) == latest, out
    if logged_steps(out):
      assert logged_steps(out)[0] == latest + 1, out
  final_log = tmp_path / "final.log"
  logs.append(final_log)
  done = run_t5lite(*train_argv(reliability_gin_file, model_dir), tests_on_path=True, env=env,
                    log=final_log, timeout=300)
  assert done.returncode == 0, final_log.read_text()
  print("where the kills landed:", dict(landed))
  assert sum(landed[m] for m in set(plan)) == len(plan) == (10 if server.scheme == "gs" else 4)
  assert landed["a save in flight"] >= 1, dict(landed)
  assert landed["the first save in flight"] == landed["a fresh commit"] == 1, dict(landed)
  for log_path in logs:
    text = log_path.read_text()
    assert "Traceback" not in text and "t5lite: warning" not in text, text
  assert not paths.exists(paths.join(model_dir, integrity.LOG_FILE))  # no damage found
  assert _step_folders(ckpts) == ({PREVIOUS, NEWEST}, set())
  assert not paths.exists(paths.join(model_dir, lease_lib.LEASE_FILE))
  assert_same_run_as(model_dir, reliability_reference)
  _, params, step = checkpoint_params(model_dir)
  _, expected, _ = checkpoint_params(reliability_reference)
  assert step == STEPS
  assert_trees_equal(params, expected)


def test_eval_and_infer_read_a_checkpoint_in_a_bucket_and_write_their_outputs_there(
    bucket, reliability_reference, tmp_path):
  """The local reference run copied to the bucket: eval and infer read it there (verified
  against its checksums) and write their outputs there, the same bytes as from disk."""
  importlib.import_module("train_tasks")  # registers train_test_copy
  from t5lite.data.registry import TaskRegistry
  from t5lite.eval import metrics as metrics_lib
  from t5lite.eval import run
  from t5lite.eval.evaluator import DecodeConfig
  task = TaskRegistry.get("train_test_copy")
  saved = task.metric_fns
  object.__setattr__(task, "metric_fns", (metrics_lib.sequence_accuracy,))
  try:
    _eval_and_infer_on_a_bucket_and_on_disk(bucket[1], reliability_reference, tmp_path, run,
                                            DecodeConfig)
  finally:
    object.__setattr__(task, "metric_fns", saved)


def _eval_and_infer_on_a_bucket_and_on_disk(bucket_url, reliability_reference, tmp_path, run,
                                            DecodeConfig):
  decode = DecodeConfig(max_decode_length=8, batch_size=2)
  lengths = {"inputs": 64, "targets": 16}
  inputs = tmp_path / "inputs.txt"
  inputs.write_text("alpha beta\n\ngamma \u00e9\n{\"inputs\": \"delta\"}\n", encoding="utf-8")
  url = paths.join(bucket_url, "copied")
  upload_tree(reliability_reference, f"{url}/run")
  atomic.write_file(f"{url}/inputs.txt", inputs.read_bytes())
  outputs = {}
  for where, model_dir, source, target in (
      ("bucket", f"{url}/run", f"{url}/inputs.txt", f"{url}/out/predictions.jsonl"),
      ("local", str(reliability_reference), str(inputs), str(tmp_path / "predictions.jsonl"))):
    assert run.infer(run.InferConfig(checkpoint_path=model_dir, input_path=source,
                                     output_path=target, inputs_length=64, decode=decode)) == 3
    eval_dir = f"{url}/eval" if where == "bucket" else str(tmp_path / "eval")
    metrics = run.evaluate_checkpoint(run.EvalConfig(
        checkpoint_path=model_dir, mixture_or_task_name="train_test_copy",
        task_feature_lengths=lengths, output_dir=eval_dir, max_examples=4, decode=decode))
    outputs[where] = (paths.read_text(target), metrics,
                      paths.read_text(paths.join(eval_dir, f"train_test_copy-{STEPS}.jsonl")),
                      json.loads(paths.read_text(paths.join(eval_dir, f"metrics-{STEPS}.json"))))
  assert outputs["bucket"] == outputs["local"]
  assert len(outputs["bucket"][0].splitlines()) == 3


def test_export_hf_and_import_hf_from_and_to_a_bucket_give_the_same_files_and_params(
    bucket, reliability_reference, tmp_path, capsys):
  server, bucket_url = bucket
  url = paths.join(bucket_url, "models")
  upload_tree(reliability_reference, f"{url}/run")
  for where, run_dir, hf_dir, imported in (
      ("bucket", f"{url}/run", f"{url}/hf", f"{url}/imported"),
      ("local", str(reliability_reference), str(tmp_path / "hf"), str(tmp_path / "imported"))):
    assert cli.main(["export", "hf", "--checkpoint", run_dir, "--out", hf_dir]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["out"] == hf_dir, report
    assert cli.main(["import", "hf", "--from", hf_dir, "--out", imported]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (report["from"], report["out"]) == (hf_dir, imported), report
  exported = paths.files_under(f"{url}/hf")
  assert exported == paths.files_under(str(tmp_path / "hf")) and "config.json" in exported
  for rel in exported:
    assert paths.read_bytes(f"{url}/hf/{rel}") == (tmp_path / "hf" / rel).read_bytes(), rel
  config, params, step = checkpoint_params(f"{url}/imported")
  # A second export into the now non-empty prefix is refused, nothing written.
  assert cli.main(["export", "hf", "--checkpoint", f"{url}/run", "--out", f"{url}/hf"]) == 2
  assert f"--out {server.scheme}://" in capsys.readouterr().err
  expected_config, expected, expected_step = checkpoint_params(tmp_path / "imported")
  assert config == expected_config and step == expected_step == 0
  assert_trees_equal(params, expected)


def test_bench_checkpoint_measures_a_bucket_beside_the_local_disk(bucket, capsys):
  from t5lite.bench import checkpoint as bench_checkpoint
  url = paths.join(bucket[1], "bench")
  assert bench_checkpoint.main(["--model", "tiny", "--repeats", "1", "--dir", url]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith("bucket: save ") and out[1].startswith("local: save "), out
  report = json.loads(out[-1])
  for where in ("bucket", "local"):
    figures = report[where]
    assert figures["step_disk_bytes"] > 0 and figures["state_bytes"] > 0
    assert figures["save_mb_per_s"] > 0 and figures["restore_mb_per_s"] > 0
    assert 0 <= figures["async_overlap"] < 1
  assert report["bucket_over_local_save"] > 0 and report["bucket_over_local_restore"] > 0


def test_a_storage_server_killed_mid_save_and_restarted_keeps_the_committed_steps_and_the_rerun_resumes_bitwise(
    restartable_server, reliability_gin_file, reliability_reference, tmp_path):
  """The storage server SIGKILLed while a save is in flight (on s3://, its upload), back a
  second later with the objects it had: the run either finishes that save once the server
  answers again (the clients retry) and trains on, or stops in one line (exit 2); the steps
  committed before are intact either way, and the rerun ends as the uninterrupted local run,
  bitwise."""
  server = restartable_server
  with server.activated():
    model_dir = server.url(server.new_bucket(), "run")
    ckpts = paths.join(model_dir, "checkpoints")
    log_path = tmp_path / "crashed.log"
    process = run_t5lite(*train_argv(reliability_gin_file, model_dir), wait=False,
                         tests_on_path=True, env=server.env, log=log_path)
    deadline = time.monotonic() + 180
    while True:
      assert process.poll() is None, log_path.read_text()
      assert time.monotonic() < deadline, "no save in flight after a committed step"
      done, saving = _step_folders(ckpts)
      if done and saving:
        break
      time.sleep(0.01)
    server.kill()
    time.sleep(1.0)
    server.restart()
    code = process.wait(timeout=400)
    out = log_path.read_text()
    print(f"killed with {sorted(done)} committed and {sorted(saving)} in flight; the run "
          f"exited {code}:", out.strip().splitlines()[-1])
    assert code in (0, 2), out
    if code == 2:
      one_error_line(out, "t5lite train")
    assert "Traceback" not in out, out
    after = _step_folders(ckpts)[0]
    if code == 2:  # stopped: what was committed before the crash is all there
      assert done <= after, (done, after)
    else:  # went on to the end (retention then dropped the older steps)
      assert after == {PREVIOUS, NEWEST}, after
    for step in after:  # intact: verify raises on a damaged one (an unsealed one: False)
      integrity.verify(paths.join(ckpts, str(step)), step)
    rerun = tmp_path / "rerun.log"
    assert run_t5lite(*train_argv(reliability_gin_file, model_dir), tests_on_path=True,
                      env=server.env, log=rerun, timeout=300).returncode == 0, rerun.read_text()
    assert_same_run_as(model_dir, reliability_reference)
    _, params, _ = checkpoint_params(model_dir)
  assert_trees_equal(params, checkpoint_params(reliability_reference)[1])


def _two_process_job(server, gin_file, model_dir, tmp_path) -> list[tuple[int, str]]:
  """`t5lite train --num_processes=2` on `model_dir` (one device each): (exit code, output)
  of each process."""
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
  processes = [run_t5lite(*train_argv(gin_file, model_dir),
                          f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                          f"--process_id={i}", wait=False, devices=1, tests_on_path=True,
                          env=server.env, log=tmp_path / f"process{i}.log")
               for i in range(2)]
  return [(process.wait(timeout=300), (tmp_path / f"process{i}.log").read_text())
          for i, process in enumerate(processes)]


def test_a_two_process_job_trains_into_one_bucket_model_dir(gcs_server, reliability_gin_file,
                                                            reliability_reference, tmp_path):
  """`--num_processes=2` with MODEL_DIR on the bucket: each process writes its own shards of
  each step, process 0 commits and seals them (no shared-folder check: a bucket is one
  namespace). The losses are the one-process run's (to float summation order), and the final
  step verifies and restores in one process."""
  with gcs_server.activated():
    model_dir = gcs_server.url(gcs_server.new_bucket(), "pod-run")
    for code, out in _two_process_job(gcs_server, reliability_gin_file, model_dir, tmp_path):
      assert code == 0, out
    ckpts = paths.join(model_dir, "checkpoints")
    assert _step_folders(ckpts) == ({PREVIOUS, NEWEST}, set())
    assert integrity.verify(paths.join(ckpts, str(NEWEST)), NEWEST)
    assert not paths.exists(paths.join(model_dir, lease_lib.LEASE_FILE))
    losses, expected = logged_losses(model_dir), logged_losses(reliability_reference)
    assert sorted(losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                               [expected[s] for s in sorted(losses)], rtol=2e-5)
    _, params, step = checkpoint_params(model_dir)
  assert step == STEPS
  for got, want in zip(jax.tree.leaves(params),
                       jax.tree.leaves(checkpoint_params(reliability_reference)[1])):
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)


def test_a_two_process_job_is_refused_an_s3_model_dir_before_writing_there(
    s3_server, reliability_gin_file, tmp_path):
  """Checkpoints on s3:// go through one host's disk: a job of several processes is refused
  there, by every process, in one line naming gs:// instead, and nothing is written."""
  with s3_server.activated():
    model_dir = s3_server.url(s3_server.new_bucket(), "pod-run")
    for code, out in _two_process_job(s3_server, reliability_gin_file, model_dir, tmp_path):
      assert code == 2, out
      line = one_error_line(out, "t5lite train")
      assert (f"{model_dir}: a job of 2 processes cannot keep its checkpoints on s3://" in line
              and "use gs://" in line), line
    assert paths.files_under(model_dir) == []
