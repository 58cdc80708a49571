"""The training loop: the host reads the device only when an action needs it, metrics.jsonl
rows (the step's loss, the window's loss_mean, compile_s once), actions own their schedule."""
from __future__ import annotations

import json
import pathlib
import sys

import jax
import numpy as np
import pytest

import train_tasks  # noqa: F401 (registers train_test_copy)
from helpers import BYTE_VOCAB_SIZE, metrics_records, quiet, tiny, train_config
from helpers.cli import run_t5lite
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.train import loop as loop_lib
from t5lite.train.actions import Action, default_actions
from t5lite.train.trainer import train

MODEL = tiny(vocab_size=BYTE_VOCAB_SIZE)


def test_the_host_reads_the_device_only_when_a_log_is_due(tmp_path, monkeypatch):
  """12 steps, a log every 4: three reads of the device in all (steps 4, 8, 12): the host
  dispatches the steps in between without waiting for them."""
  reads = []
  fetch = loop_lib.fetch
  monkeypatch.setattr(loop_lib, "fetch", lambda tree: reads.append(tree) or fetch(tree))
  config = train_config(tmp_path, train_steps=12, log_period=4,
                        checkpoint=CheckpointConfig(period=100, async_save=False))
  result = train(MODEL, config, log=quiet)
  assert result.step == 12 and sorted(result.losses) == [4, 8, 12]
  assert len(reads) == 3


@pytest.mark.e2e
@pytest.mark.slow
def test_rows_hold_the_step_loss_the_window_mean_and_compile_time_once(tmp_path):
  every = train(MODEL, train_config(tmp_path / "every", train_steps=8, log_period=1),
                log=quiet).losses
  train(MODEL, train_config(tmp_path / "four", train_steps=8, log_period=4), log=quiet)
  rows = [r for r in metrics_records(tmp_path / "four") if "loss" in r]
  assert [r["step"] for r in rows] == [4, 8]
  for row, window in zip(rows, ([1, 2, 3, 4], [5, 6, 7, 8])):
    assert row["loss"] == every[row["step"]]  # the logged step's own loss, bitwise
    np.testing.assert_allclose(row["loss_mean"], np.mean([every[s] for s in window]),
                               rtol=1e-6)
    assert row["skipped_steps"] == 0 and row["tokens_per_s"] > 0
  assert rows[0]["compile_s"] > 0 and "compile_s" not in rows[1]
  # Tokens trained on so far: steps x 8 rows x (64 input + 16 target tokens).
  assert [r["tokens"] for r in rows] == [4 * 8 * 80, 8 * 8 * 80]


class CountingAction(Action):
  """Due every third step, reads nothing: proves a new action needs no change to the loop."""

  reads_state = False

  def __init__(self):
    self.steps = []

  def due(self, loop):
    return loop.step % 3 == 0

  def run(self, loop):
    self.steps.append(loop.step)


def test_an_added_action_runs_on_its_own_schedule(tmp_path, monkeypatch):
  counting = CountingAction()
  reads = []
  fetch = loop_lib.fetch
  monkeypatch.setattr(loop_lib, "fetch", lambda tree: reads.append(tree) or fetch(tree))
  config = train_config(tmp_path, train_steps=10, log_period=5,
                        checkpoint=CheckpointConfig(period=100, async_save=False))
  original = loop_lib.run
  monkeypatch.setattr(loop_lib, "run", lambda *a, **k: original(
      *a, actions=default_actions(config) + [counting], **k))
  train(MODEL, config, log=quiet)
  assert counting.steps == [3, 6, 9]
  assert len(reads) == 2  # the logs at 5 and 10; the counting action read nothing


def profiled_run(model_dir, *, train_steps: int, after: int, steps: int) -> list[str]:
  """Trains MODEL with a profile of `steps` steps after `after`; returns the run's log."""
  logs = []
  config = train_config(model_dir, train_steps=train_steps, log_period=3, profile_steps=steps,
                        profile_after_steps=after,
                        checkpoint=CheckpointConfig(period=100, async_save=False))
  train(MODEL, config, log=logs.append)
  return logs


def test_a_profile_traces_the_chosen_steps_and_only_those(tmp_path):
  """profile_after_steps=2, profile_steps=2 of a 6-step run: MODEL_DIR/profile holds one
  trace (an .xplane.pb) in which the compiled step ran exactly twice, and XProf lists its
  session with the step's program."""
  logs = profiled_run(tmp_path, train_steps=6, after=2, steps=2)
  assert f"t5lite: profiled steps 3-4 into {tmp_path / 'profile'}" in logs
  traces = list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert len(traces) == 1
  profile = jax.profiler.ProfileData.from_file(str(traces[0]))
  executions = [event.name for plane in profile.planes for line in plane.lines
                for event in line.events
                if event.name.startswith("CommonPjRtLoadedExecutable::Execute")
                and "train_step" in event.name]
  assert len(executions) == 2, executions
  xprof = pathlib.Path(sys.executable).with_name("xprof")  # the test extra installs it
  listed = run_t5lite("list_hlo_modules", f"--session_id={traces[0].parent.name}",
                      f"--logdir={tmp_path / 'profile'}", script=xprof, timeout=120)
  assert listed.returncode == 0, listed.stderr
  report = json.loads(listed.stdout)
  assert report["status"] == "SUCCESS"
  assert any(name.startswith("jit_windowed_train_step") for name in report["modules"])


def test_a_profile_longer_than_the_run_stops_at_the_last_step(tmp_path):
  logs = profiled_run(tmp_path, train_steps=3, after=0, steps=10)
  assert f"t5lite: profiled steps 1-3 into {tmp_path / 'profile'}" in logs
  assert list((tmp_path / "profile").glob("plugins/profile/*/*.xplane.pb"))
