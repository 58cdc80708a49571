"""Faults a training run meets in the wild, end to end (2): two trainers on one MODEL_DIR, a
full disk, a read-only MODEL_DIR. Mounts (tmpfs, read-only bind) need root or CAP_SYS_ADMIN;
without them the disk-full and read-only tests inject the same errors instead. The reference
run is helpers/runs.py's; docs/reliability.md says what each outcome promises.
"""
import errno
import json
import os
import shutil
import socket
import time

import pytest

from helpers import assert_trees_equal, tree_digest
from t5lite import cli
from t5lite.runtime import checkpoint_reader
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import integrity
from t5lite.runtime import lease as lease_lib
from helpers.runs import (
    NEWEST, PERIOD, TMP_MARK, assert_same_run_as, committed, listing, mount, one_error_line,
    spawn, train_argv, umount)

# One worker runs the modules that share the session-scoped reliability_reference run
# (helpers/fixtures.py): built once, not once per pytest-xdist worker (`--dist loadgroup`).
pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.xdist_group("reliability_reference")]


@pytest.fixture(scope="module")
def gin_file(reliability_gin_file):
  return reliability_gin_file


@pytest.fixture(scope="module")
def reference(reliability_reference):
  return reliability_reference


@pytest.fixture(scope="module")
def saved(reliability_saved):
  return reliability_saved


# --- 3. two writers -------------------------------------------------------------------------

def test_two_trainers_started_together_one_runs_the_other_exits_2_naming_it(gin_file,
                                                                             reference,
                                                                             tmp_path):
  model_dir = tmp_path / "run"
  model_dir.mkdir()  # exists already: two runs creating a missing one can race on its mkdir
  logs = [tmp_path / "a.log", tmp_path / "b.log"]
  processes = [spawn(gin_file, model_dir, log, "--gin.TRAIN_STEPS=2") for log in logs]
  deadline = time.monotonic() + 300
  while all(p.poll() is None for p in processes):
    assert time.monotonic() < deadline
    time.sleep(0.01)
  loser = next(i for i, p in enumerate(processes) if p.poll() is not None)
  winner = 1 - loser
  still_running = processes[winner].poll() is None  # the loser did not wait for the lease
  assert processes[loser].returncode == 2, logs[loser].read_text()
  assert processes[winner].wait(timeout=300) == 0, logs[winner].read_text()
  assert still_running
  line = one_error_line(logs[loser].read_text(), "t5lite train")
  assert (f"MODEL_DIR {model_dir} is in use by another trainer (host {socket.gethostname()}, "
          f"pid {processes[winner].pid}, heartbeat") in line
  assert_same_run_as(model_dir, reference, last_step=2)
  assert not (model_dir / lease_lib.LEASE_FILE).exists()


# --- 4. disk full ---------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path, monkeypatch):
  """(folder, how): a 3 MiB tmpfs (two of the tiny run's 1.25 MB checkpoints fit, not
  three) or, where mounting is not allowed, a folder whose third checkpoint save fails the way
  orbax's does when the disk is full (TensorStore's ValueError), in this process."""
  folder = tmp_path / "disk"
  folder.mkdir()
  why_not = mount("-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder))
  if why_not is None:
    yield folder, "tmpfs"
    umount(folder)
    return
  real_save = ckpt_lib.ocp.CheckpointManager.save

  def save(self, step, *args, **kwargs):
    if step >= 3 * PERIOD and os.environ.get("T5LITE_TEST_DISK_FULL"):
      raise ValueError(f'RESOURCE_EXHAUSTED: Error writing in OCDBT database: Failed writing: '
                       f'"{self.directory}/{step}.{TMP_MARK}/state/d/x": No space left on '
                       "device [os_error_code='28']")
    return real_save(self, step, *args, **kwargs)
  monkeypatch.setattr(ckpt_lib.ocp.CheckpointManager, "save", save)
  monkeypatch.setenv("T5LITE_TEST_DISK_FULL", "1")
  yield folder, f"injected ({why_not})"


def test_a_full_disk_stops_the_run_and_keeps_the_last_checkpoint(gin_file, reference, saved,
                                                                   small_disk, tmp_path, capfd,
                                                                   monkeypatch):
  folder, how = small_disk
  model_dir = folder / "run"
  if how == "tmpfs":  # a subprocess: orbax's failed background save stays out of pytest
    log = tmp_path / "full.log"
    code = spawn(gin_file, model_dir, log, "--gin.TRAIN_STEPS=12").wait(timeout=300)
    err = log.read_text()
  else:
    capfd.readouterr()
    try:
      code = cli.main(train_argv(gin_file, model_dir, "--gin.TRAIN_STEPS=12"))
    except ValueError as e:
      code = f"an uncaught {type(e).__name__}"
    err = capfd.readouterr().err
  steps = committed(listing(model_dir / "checkpoints"))
  assert steps and steps[-1] < 12, (how, code, err[-3000:])  # it did stop early
  # Space freed: the newest committed step is whole and verified; a rerun resumes from it.
  if how == "tmpfs":
    assert mount("-o", "remount,size=256m", str(folder)) is None
  else:
    monkeypatch.delenv("T5LITE_TEST_DISK_FULL")
  assert integrity.verify(str(model_dir / "checkpoints" / str(steps[-1])), steps[-1])
  trainer, _ = saved
  checkpointer = ckpt_lib.Checkpointer(model_dir)
  assert checkpointer.restore_latest(trainer.abstract_state)[2] == steps[-1]
  checkpointer.close()
  assert not (model_dir / lease_lib.LEASE_FILE).exists()  # released on the way out
  capfd.readouterr()
  assert cli.main(train_argv(gin_file, model_dir, "--gin.TRAIN_STEPS=12")) == 0
  assert f"resuming from step {steps[-1]}" in capfd.readouterr().out
  assert_same_run_as(model_dir, reference, last_step=12)  # resumed exactly
  # The promise: exit 2, one line naming the path and the OS's words.
  assert code == 2 and "Traceback" not in err, (code, err[-3000:])
  line = one_error_line(err, "t5lite train")
  assert "No space left on device" in line and str(model_dir) in line, line


# --- 5. read-only MODEL_DIR -----------------------------------------------------------------

@pytest.fixture
def read_only_copy(reference, tmp_path, monkeypatch):
  """(path, how): the finished reference run behind a read-only bind mount or, where mounting
  is not allowed, a copy whose lease cannot be written (as on a read-only filesystem)."""
  source, target = tmp_path / "source", tmp_path / "ro"
  shutil.copytree(reference, source, ignore=shutil.ignore_patterns("tensorboard"))
  target.mkdir()
  why_not = mount("--bind", str(source), str(target))
  if why_not is None:
    why_not = mount("-o", "remount,ro,bind", str(target))
    if why_not is None:
      yield target, "read-only bind mount"
      umount(target)
      return
    umount(target)

  def write(self):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), f"{self.path}.{self.token}.tmp")
  monkeypatch.setattr(lease_lib.Lease, "_write", write)
  yield source, f"injected ({why_not})"


def test_a_read_only_model_dir_refuses_training_and_still_serves_reads(gin_file, reference,
                                                                       saved, read_only_copy,
                                                                       tmp_path, capfd):
  path, how = read_only_copy
  before = tree_digest(path)
  capfd.readouterr()
  assert cli.main(train_argv(gin_file, path)) == 2, how  # finished: it would write nothing
  assert cli.main(train_argv(gin_file, path, "--gin.TRAIN_STEPS=40")) == 2, how
  err = capfd.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("t5lite train: error: ")]
  assert len(lines) == 2 and "Traceback" not in err, err
  assert all(f"MODEL_DIR {path} is not writable (Read-only file system" in line
             for line in lines)
  assert tree_digest(path) == before
  trainer, states = saved
  params, step = checkpoint_reader.restore_params(path, trainer.abstract_params)
  assert step == NEWEST
  assert_trees_equal(params, states[NEWEST][0].params)
  capfd.readouterr()
  assert cli.main(["export", "hf", "--checkpoint", str(path), "--out",
                   str(tmp_path / "hf")]) == 0
  assert json.loads(capfd.readouterr().out.strip().splitlines()[-1])["step"] == NEWEST
  assert (tmp_path / "hf" / "model.safetensors").exists()
