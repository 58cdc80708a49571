"""Nothing silently wrong: checksummed checkpoints, fallbacks that repair, refusals that change
nothing, one writer per MODEL_DIR, non-finite accounting, metrics without repeated steps.

The fast tests work on tiny hand-made checkpoints and leases; the end-to-end ones (slow) train
the tiny model of test_trainer.py, cut to one encoder and one decoder layer (they are about
checkpoints and steps, not depth: less to compile), for a few steps.
"""
import asyncio
import dataclasses
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_tasks  # noqa: F401 (registers train_test_sc, train_test_copy)
from helpers import (assert_trees_equal, checkpoint_params, metrics_records, quiet, tiny,
                     train_config, tree_digest)
from t5lite import cli
from t5lite.data.registry import Feature, TaskRegistry, add_task
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError
from t5lite.runtime import checkpoint_reader
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import integrity, lease as lease_lib
from t5lite.runtime.checkpoints import CheckpointConfig, CorruptCheckpointError
from t5lite.runtime.metrics_writer import MetricsWriter
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.step import StepConfig
from t5lite.train.trainer import train

MODEL = tiny(vocab_size=384, dropout_rate=0.1, num_encoder_layers=1, num_decoder_layers=1)
STATE = {"w": jnp.arange(3000, dtype=jnp.float32) / 7, "b": {"c": jnp.ones((30, 40))}}

if "integrity_copy_other_vocab" not in TaskRegistry.names():
  other = ByteVocabulary(extra_ids=50)
  add_task("integrity_copy_other_vocab", train_tasks.SOURCES,
           {"inputs": Feature(other), "targets": Feature(other)},
           [train_tasks.pp.rekey({"inputs": "text", "targets": "text"}), train_tasks.pp.tokenize,
            train_tasks.pp.append_eos_after_trim])


def saved(tmp_path, steps=(1, 2), **config) -> ckpt_lib.Checkpointer:
  """Checkpoints of STATE (times the step) at `steps`, and a Checkpointer over them."""
  checkpointer = ckpt_lib.Checkpointer(tmp_path, CheckpointConfig(**config))
  for step in steps:
    checkpointer.save(step, jax.tree.map(lambda x: x * step, STATE), {"position": step})
  checkpointer.close()
  return ckpt_lib.Checkpointer(tmp_path, CheckpointConfig(**config))


def array_file(step_dir) -> str:
  """The largest array data file of a step (it holds the values of 'w')."""
  files = [os.path.join(root, f) for root, _, names in os.walk(step_dir) for f in names
           if "/d/" in os.path.join(root, f)]
  return max(files, key=os.path.getsize)


def flip_byte(path, offset=None) -> None:
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x10
    f.seek(0)
    f.write(data)


# --- checksums -------------------------------------------------------------------------------

def test_every_committed_step_is_sealed_and_verifies(tmp_path):
  checkpointer = saved(tmp_path)
  for step in (1, 2):
    step_dir = checkpointer.step_dir(step)
    listed = json.load(open(os.path.join(step_dir, integrity.CHECKSUMS_FILE)))["files"]
    assert any(name.startswith("data/") for name in listed)  # the data state too
    assert any("/d/" in f"/{name}" for name in listed)
    assert integrity.verify(step_dir, step) is True


def test_a_save_cut_short_is_cleared_when_the_next_writer_opens_the_folder(tmp_path):
  """A crash mid-save leaves orbax's temporary folder: never listed, removed by the next
  Checkpointer that writes (a reader leaves it alone); the committed steps are untouched."""
  saved(tmp_path).close()
  folder = tmp_path / ckpt_lib.CHECKPOINTS_DIR
  leftover = folder / "3.orbax-checkpoint-tmp-1700000000" / "state"
  leftover.mkdir(parents=True)
  (leftover / "_METADATA").write_text("{}")
  reader = ckpt_lib.Checkpointer(tmp_path, read_only=True)
  assert reader.all_steps() == [1, 2] and leftover.exists()
  writer = ckpt_lib.Checkpointer(tmp_path)
  assert writer.all_steps() == [1, 2] and sorted(os.listdir(folder)) == ["1", "2"]
  assert integrity.verify(writer.step_dir(2), 2) is True
  writer.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damage_to_an_array_file_is_named_by_step_and_file(tmp_path, damage):
  checkpointer = saved(tmp_path)
  path = array_file(checkpointer.step_dir(2))
  if damage == "flip":
    flip_byte(path)
  elif damage == "truncate":
    open(path, "r+b").truncate(10)
  else:
    os.remove(path)
  rel = os.path.relpath(path, checkpointer.step_dir(2))
  with pytest.raises(CorruptCheckpointError, match=f"checkpoint step 2: {rel} \\(array data\\)"):
    integrity.verify(checkpointer.step_dir(2), 2)


def test_a_bit_flip_falls_back_moves_the_step_aside_and_says_so_in_one_line(tmp_path, capfd):
  checkpointer = saved(tmp_path)
  flip_byte(array_file(checkpointer.step_dir(2)))
  abstract = jax.eval_shape(lambda: STATE)
  state, data_state, step = checkpointer.restore_latest(abstract)
  assert step == 1 and data_state == {"position": 1}
  assert_trees_equal(state, STATE)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2.corrupt-1"]
  assert checkpointer.all_steps() == [1]
  err = capfd.readouterr().err
  warnings = [line for line in err.splitlines() if line.strip()]
  assert len(warnings) == 1, err
  assert "checkpoint step 2" in warnings[0] and "CRC32C" in warnings[0]
  assert "moved to checkpoints/2.corrupt-1, falling back to step 1" in warnings[0]
  log = (tmp_path / integrity.LOG_FILE).read_text()
  assert "Traceback" in log and "checkpoint step 2" in log
  # The retrained step is saved in its place; a second damage goes to .corrupt-2.
  checkpointer.save(2, jax.tree.map(lambda x: x * 2, STATE), {"position": 2})
  checkpointer.close()
  again = ckpt_lib.Checkpointer(tmp_path)
  assert again.restore_latest(abstract)[2] == 2
  flip_byte(array_file(again.step_dir(2)))
  assert again.restore_latest(abstract)[2] == 1
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2.corrupt-1", "2.corrupt-2"]
  again.close()


def test_an_unawaited_storage_request_cut_by_a_dropped_connection_goes_to_the_log_file(
    tmp_path, caplog):
  # What aiobotocore leaves when a killed storage server cuts a request it then retries:
  # aiohttp's write task, ended by the dropped connection, that nobody awaits. A bug's
  # unawaited task still reaches the console, traceback and all.
  aiohttp = pytest.importorskip("aiohttp")

  def leave_unawaited(error: BaseException) -> None:
    async def request():
      raise error
    loop = asyncio.new_event_loop()
    task = loop.create_task(request())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    del task
    gc.collect()  # the task's finalizer is what reports it

  with caplog.at_level(logging.ERROR, logger="asyncio"):
    with integrity.orbax_messages_to_log(str(tmp_path)):
      leave_unawaited(aiohttp.ClientConnectionResetError("Cannot write to closing transport"))
      leave_unawaited(TypeError("a bug"))
    leave_unawaited(aiohttp.ClientConnectionResetError("outside a training run"))
  shown = [r.exc_info[1] for r in caplog.records if r.exc_info]
  assert [str(e) for e in shown] == ["a bug", "outside a training run"]
  log = (tmp_path / integrity.LOG_FILE).read_text()
  assert "Task exception was never retrieved" in log
  assert "Cannot write to closing transport" in log and "a bug" not in log


def test_on_corrupt_stop_moves_nothing(tmp_path):
  checkpointer = saved(tmp_path, on_corrupt="stop")
  flip_byte(array_file(checkpointer.step_dir(2)))
  before = tree_digest(tmp_path / "checkpoints")
  with pytest.raises(CorruptCheckpointError, match="step 2.*on_corrupt='stop'"):
    checkpointer.restore_latest(jax.eval_shape(lambda: STATE))
  assert tree_digest(tmp_path / "checkpoints") == before


def test_a_state_of_another_structure_is_a_config_error_and_moves_nothing(tmp_path):
  """E.g. a resume with another optimizer: not damage, so no step is moved aside."""
  checkpointer = saved(tmp_path)
  before = tree_digest(tmp_path / "checkpoints")
  other = jax.eval_shape(lambda: {**STATE, "momentum": jnp.zeros(7)})
  with pytest.raises(ConfigError, match=r"step 2 .* another structure \(2 arrays\) than this "
                     r"run's \(3\)") as error:
    checkpointer.restore_latest(other)
  assert not isinstance(error.value, CorruptCheckpointError)
  assert tree_digest(tmp_path / "checkpoints") == before


def test_a_step_killed_before_its_seal_is_trusted_on_its_first_whole_read(tmp_path):
  checkpointer = saved(tmp_path)
  os.remove(os.path.join(checkpointer.step_dir(2), integrity.CHECKSUMS_FILE))
  state, _, step = checkpointer.restore_latest(jax.eval_shape(lambda: STATE))
  assert step == 2 and integrity.is_sealed(checkpointer.step_dir(2))


def test_restore_params_verifies_checksums_and_finiteness(tmp_path):
  """eval, infer, export and INITIAL_CHECKPOINT_PATH read params through restore_params."""
  abstract = {"params": jax.eval_shape(lambda: STATE)}
  state = {"params": STATE}
  plain = ckpt_lib.Checkpointer(tmp_path / "p", CheckpointConfig(async_save=False))
  plain.save(1, state, {})
  plain.close()
  params, step = checkpoint_reader.restore_params(tmp_path / "p", abstract["params"])
  assert step == 1
  assert_trees_equal(params, STATE)
  flip_byte(array_file(tmp_path / "p" / "checkpoints" / "1"))
  with pytest.raises(CorruptCheckpointError, match="checkpoint step 1 in .*/p/checkpoints/1: .*CRC32C"):
    checkpoint_reader.restore_params(tmp_path / "p", abstract["params"])
  assert os.path.isdir(tmp_path / "p" / "checkpoints" / "1")  # a read path moves nothing
  # NaN saved (not a flip: sealed as is) is refused too.
  nan = ckpt_lib.Checkpointer(tmp_path / "n", CheckpointConfig(async_save=False))
  nan.save(1, {"params": {**STATE, "w": STATE["w"].at[5].set(jnp.nan)}}, {})
  nan.close()
  with pytest.raises(CorruptCheckpointError, match=r"\['w'\] holds non-finite values"):
    checkpoint_reader.restore_params(tmp_path / "n", abstract["params"])


def test_params_only_model_dirs_are_sealed_and_a_flipped_byte_is_refused(tmp_path, capfd):
  """Imports (hf, t5x, peft), `export params` and `export student` all write through
  write_model_dir: the step is sealed like a training step, and every read verifies it."""
  from t5lite.interop import params_only
  from t5lite.models.params import init_params
  config = tiny(vocab_size=300)
  leftover = tmp_path / "m" / "checkpoints" / "0.orbax-checkpoint-tmp-1700000000"
  leftover.mkdir(parents=True)  # what a killed import leaves: no checkpoint, so no refusal
  step_dir = params_only.write_model_dir(tmp_path / "m", config, init_params(config, 0),
                                         step=0, vocabulary=None)
  assert integrity.verify(step_dir, 0) is True
  assert os.listdir(tmp_path / "m" / "checkpoints") == ["0"]
  with pytest.raises(FileExistsError, match=r"already holds checkpoints \(0\)"):
    params_only.write_model_dir(tmp_path / "m", config, {}, step=0, vocabulary=None)
  flip_byte(array_file(step_dir))
  code = cli.main(["export", "params", "--checkpoint", str(tmp_path / "m"),
                   "--out", str(tmp_path / "out")])
  err = capfd.readouterr().err
  assert code == 2, err
  assert f"checkpoint step 0 in {tmp_path}/m/checkpoints/0: state/" in err and "CRC32C" in err and "Traceback" not in err
  assert not os.path.exists(tmp_path / "out" / "checkpoints")


# --- the lease -------------------------------------------------------------------------------

def test_a_second_writer_is_refused_naming_the_first(tmp_path):
  first = lease_lib.Lease(str(tmp_path), settle_s=0)
  first.acquire()
  second = lease_lib.Lease(str(tmp_path), settle_s=0)
  with pytest.raises(ConfigError, match=f"in use by another trainer \\(host "
                     f"{socket.gethostname()}, pid {os.getpid()}"):
    second.acquire()
  first.release()
  assert not os.path.exists(tmp_path / lease_lib.LEASE_FILE)
  second.acquire()
  second.release()


def test_a_dead_holder_or_an_old_heartbeat_is_taken_over(tmp_path):
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  record = {"host": socket.gethostname(), "pid": int(dead.stdout), "token": "x",
            "heartbeat": time.time()}
  (tmp_path / lease_lib.LEASE_FILE).write_text(json.dumps(record))
  taker = lease_lib.Lease(str(tmp_path), settle_s=0)
  taker.acquire()
  assert "no longer running" in taker.taken_over
  taker.release()
  remote = {"host": "elsewhere", "pid": 1, "token": "y", "heartbeat": time.time() - 100}
  (tmp_path / lease_lib.LEASE_FILE).write_text(json.dumps(remote))
  with pytest.raises(ConfigError, match="host elsewhere, pid 1"):
    lease_lib.Lease(str(tmp_path), timeout_s=1000, settle_s=0).acquire()
  taker = lease_lib.Lease(str(tmp_path), timeout_s=50, settle_s=0)
  taker.acquire()
  assert "heartbeat is 100 s old" in taker.taken_over
  taker.release()


def test_a_holder_whose_lease_was_taken_over_stops_writing(tmp_path):
  holder = lease_lib.Lease(str(tmp_path), timeout_s=0.5, settle_s=0)
  holder.acquire()
  usurper = {"host": "elsewhere", "pid": 1, "token": "z", "heartbeat": time.time()}
  (tmp_path / lease_lib.LEASE_FILE).write_text(json.dumps(usurper))
  deadline = time.time() + 5
  while holder.lost is None and time.time() < deadline:  # the heartbeat notices
    time.sleep(0.02)
  assert "another trainer took over its lease (host elsewhere" in holder.lost
  holder.release()
  assert json.loads((tmp_path / lease_lib.LEASE_FILE).read_text())["token"] == "z"
  # A run stalled between beats: check() (before every save) reads the file itself.
  stalled = lease_lib.Lease(str(tmp_path / "b"), timeout_s=1e6, settle_s=0)
  stalled.acquire()
  assert stalled.check() is None
  (tmp_path / "b" / lease_lib.LEASE_FILE).write_text(json.dumps(usurper))
  assert "another trainer took over its lease" in stalled.check()
  stalled.release()


def test_an_unwritable_model_dir_is_named(tmp_path, monkeypatch):
  def read_only(*args, **kwargs):
    raise OSError(30, "Read-only file system", str(tmp_path / "t5lite.lease.tmp"))
  monkeypatch.setattr(lease_lib.Lease, "_write", read_only)
  with pytest.raises(ConfigError, match=f"MODEL_DIR {tmp_path} is not writable "
                     r"\(Read-only file system"):
    with lease_lib.hold(str(tmp_path)):
      pass


def test_a_model_dir_too_long_for_its_checkpoint_files_is_refused_before_training(tmp_path):
  """Long enough to be created, too long for orbax's files below it (PATH_MAX, 4,096 bytes on
  Linux): refused at start, not at the first save after `period` steps."""
  deep = str(tmp_path)
  while len(deep) < 4096 - 100:
    deep = os.path.join(deep, "d" * min(200, 4096 - 101 - len(deep)))
  with pytest.raises(ConfigError, match=r"MODEL_DIR is \d+ bytes long .* limit of 4096 bytes "
                     r"for a path; choose a MODEL_DIR under 3936 bytes"):
    train(MODEL, train_config(deep, train_steps=2), log=quiet)
  assert os.listdir(tmp_path) == []


# --- metrics after a resume ------------------------------------------------------------------

def test_a_resumed_run_drops_the_rows_logged_after_its_checkpoint(tmp_path):
  with MetricsWriter(tmp_path) as writer:
    for step in range(1, 8):
      writer.write(step, {"loss": float(step)})
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "lo')  # a kill mid-write
  with MetricsWriter(tmp_path, resume_step=5) as writer:
    writer.write(6, {"loss": 60.0})
  assert [(r["step"], r["loss"]) for r in metrics_records(tmp_path)] == [
      (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 60.0)]


# --- end to end ------------------------------------------------------------------------------

def run_config(model_dir, **changes):
  base = dict(train_steps=6, mixture_or_task_name="train_test_copy", log_period=1,
              checkpoint=CheckpointConfig(period=3),
              optimizer=OptimizerConfig(schedule=ScheduleConfig(warmup_steps=10, value=0.3)))
  return train_config(model_dir, **{**base, **changes})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  model_dir = tmp_path_factory.mktemp("reference")
  train(MODEL, run_config(model_dir), log=quiet)
  return model_dir


@pytest.mark.e2e
@pytest.mark.slow
def test_a_refused_resume_leaves_model_dir_byte_identical(reference, tmp_path):
  copy = tmp_path / "run"
  import shutil
  shutil.copytree(reference, copy)
  before = tree_digest(copy)
  other_vocab = run_config(copy, train_steps=9, mixture_or_task_name="integrity_copy_other_vocab")
  with pytest.raises(ConfigError, match="was trained with another vocabulary"):
    train(MODEL, other_vocab, log=quiet)
  other_lengths = run_config(copy, train_steps=9, task_feature_lengths={"inputs": 32,
                                                                        "targets": 16})
  with pytest.raises(ConfigError, match="restoring it would skip or repeat examples"):
    train(MODEL, other_lengths, log=quiet)
  assert tree_digest(copy) == before
  # Finetuning from it on a task of another vocabulary: refused, the new MODEL_DIR not made.
  finetune = run_config(tmp_path / "ft", train_steps=9, initial_checkpoint_path=str(reference),
                        mixture_or_task_name="integrity_copy_other_vocab")
  with pytest.raises(ConfigError, match="INITIAL_CHECKPOINT_PATH .* another vocabulary"):
    train(MODEL, finetune, log=quiet)
  assert not os.path.exists(tmp_path / "ft")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_damaged_newest_step_is_retrained_in_place_bitwise(reference, tmp_path):
  import shutil
  copy = tmp_path / "run"
  shutil.copytree(reference, copy)
  ckpt_lib.Checkpointer(copy, read_only=True).close()
  shutil.rmtree(copy / "checkpoints" / "6")  # the run ended at 3 ...
  rows = [r for r in metrics_records(copy) if r["step"] <= 3]  # ... as if killed at 4
  (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) +
                                      '{"step": 4, "loss": 1.0}\n')
  train(MODEL, run_config(copy), log=quiet)  # 3 -> 6
  flip_byte(array_file(copy / "checkpoints" / "6"))
  train(MODEL, run_config(copy, train_steps=6), log=quiet)  # falls back to 3, retrains 6
  assert sorted(os.listdir(copy / "checkpoints")) == ["3", "6", "6.corrupt-1"]
  _, params, step = checkpoint_params(copy)
  _, expected, _ = checkpoint_params(reference)
  assert step == 6
  assert_trees_equal(params, expected)
  steps = [r["step"] for r in metrics_records(copy) if "loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]  # each step once, the retrained ones not repeated
  # The rerun after the repair has nothing to fall back from.
  assert train(MODEL, run_config(copy), log=quiet).step == 6


@pytest.mark.e2e
@pytest.mark.slow
def test_export_of_a_flipped_checkpoint_exits_2_in_one_line(reference, tmp_path, capfd):
  """`t5lite export` through the CLI's entry point in this process (its return value is the
  exit status; capfd reads stderr at the file descriptor, what a subprocess's would hold)."""
  import shutil
  copy = tmp_path / "run"
  shutil.copytree(reference, copy)
  flip_byte(array_file(copy / "checkpoints" / "6"))
  code = cli.main(["export", "hf", "--checkpoint", str(copy), "--out", str(tmp_path / "hf")])
  err = capfd.readouterr().err
  assert code == 2, err
  assert f"checkpoint step 6 in {copy}/checkpoints/6:" in err and "CRC32C" in err
  assert "Traceback" not in err
  assert not os.path.exists(tmp_path / "hf" / "model.safetensors")


@pytest.mark.e2e
@pytest.mark.slow
def test_nonfinite_stop_saves_the_last_good_state_and_skip_stops_past_a_fraction(tmp_path):
  explode = OptimizerConfig(name="adamw", schedule=ScheduleConfig(name="constant", value=1e30,
                                                                   warmup_steps=0))
  stop = run_config(tmp_path / "stop", optimizer=explode, train_steps=12, log_period=4,
                    checkpoint=CheckpointConfig(period=100))
  with pytest.raises(FloatingPointError, match=r"at step (\d+);.*checkpoint \d+ holds the state "
                     r"before it \(saved now, marked") as error:
    train(MODEL, stop, log=quiet)
  first = int(str(error.value).split("at step ")[1].split(";")[0])
  good = first - 1
  assert ckpt_lib.Checkpointer(tmp_path / "stop", read_only=True).all_steps() == [good]
  messages = []
  with pytest.raises(FloatingPointError):  # still exploding: but it resumed from the mark
    train(MODEL, stop, log=messages.append)
  assert any(f"step {good} is the last good state before the non-finite step {first}" in m
             for m in messages)
  skip = run_config(tmp_path / "skip", optimizer=explode, train_steps=30, log_period=5,
                    step=StepConfig(nonfinite="skip", max_skipped_fraction=0.5))
  skip_messages = []
  with pytest.raises(FloatingPointError, match=r"of the 10 steps run up to step 10 .* were "
                     r"skipped, more than StepConfig.max_skipped_fraction=0.5"):
    train(MODEL, skip, log=skip_messages.append)
  rows = [r for r in metrics_records(tmp_path / "skip") if "skipped_steps" in r]
  # Every skip counted, not only those of logged steps; the last row written before stopping.
  assert [(r["step"], r["skipped_steps"]) for r in rows] == [(5, 4), (10, 5)]
  # Skipping goes on past the first non-finite steps (step 5 logged), and says so.
  assert any("skipped in the last" in m for m in skip_messages), skip_messages


def test_step_config_refuses_a_fraction_outside_0_1():
  with pytest.raises(ConfigError, match="max_skipped_fraction=1.5"):
    dataclasses.replace(StepConfig(), max_skipped_fraction=1.5)
  assert np.isclose(StepConfig().max_skipped_fraction, 0.1)
