"""The Weights & Biases sink, in W&B's offline mode (its files, no network): every metrics row,
the configs, the run's last figures; a resumed run continues the same W&B run."""
from __future__ import annotations

import json
import signal
import sys
import time

import pytest
import wandb  # noqa: F401 (the test extra installs it: without it these fail, not skip)

import train_tasks  # noqa: F401 (registers train_test_copy)
from helpers import BYTE_VOCAB_SIZE, metrics_records, quiet, runs, tiny, train_config, wandb_files
from helpers.cli import run_t5lite
from t5lite.errors import ConfigError
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.runtime.metrics_writer import MetricsWriter
from t5lite.runtime.wandb_sink import STATE_FILE, WandbConfig
from t5lite.train.trainer import train

MODEL = tiny(vocab_size=BYTE_VOCAB_SIZE)
OFFLINE = WandbConfig(project="t5lite-tests", mode="offline", tags=("tiny",))


@pytest.fixture(autouse=True)
def own_wandb_service(monkeypatch):
  """wandb.init saves its service's address in WANDB_SERVICE, which the test's subprocesses
  would inherit and share: a killed trainer's run would stay open in this process's service
  ("run ID ... is in use" for the rerun). Each test and each trainer starts its own; the
  variable is removed after the test."""
  monkeypatch.setenv("WANDB_SERVICE", "")


def _text(path) -> str:
  return path.read_text() if path.exists() else ""


def run_files(model_dir):
  return sorted((model_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_rows_configs_and_figures_reach_the_run_and_a_resumed_run_continues_it(tmp_path):
  config = train_config(tmp_path, train_steps=4, log_period=2, wandb=OFFLINE,
                        checkpoint=CheckpointConfig(period=2, async_save=False))
  result = train(MODEL, config, log=quiet)
  run_id = json.loads((tmp_path / STATE_FILE).read_text())["id"]
  [first] = run_files(tmp_path)
  assert first.name == f"run-{run_id}.wandb"
  rows = metrics_records(tmp_path)
  assert [r["step"] for r in rows] == [2, 4]
  logged = wandb_files.history(first)
  assert len(logged) == 2
  for row, got in zip(rows, logged):  # every key and value of metrics.jsonl
    assert got == pytest.approx(row), (got, row)
  settings = wandb_files.config(first)
  assert settings["model"]["d_model"] == MODEL.d_model
  assert settings["train"]["train_steps"] == 4 and settings["train"]["batch_size"] == 8
  figures = wandb_files.summary(first)
  assert figures["final_step"] == 4 and figures["final_loss"] == pytest.approx(result.losses[4])
  assert figures["preempted"] is False

  train(MODEL, train_config(tmp_path, train_steps=6, log_period=2, wandb=OFFLINE,
                            checkpoint=CheckpointConfig(period=2, async_save=False)), log=quiet)
  runs = run_files(tmp_path)
  assert len(runs) == 2 and all(r.name == f"run-{run_id}.wandb" for r in runs)
  [second] = [r for r in runs if r != first]
  # The first session ended after sending step 4 (wandb_run.json keeps it): the second sends
  # what comes after; the two files, synced, are each step once.
  assert [row["step"] for row in wandb_files.history(second)] == [6]
  assert json.loads((tmp_path / STATE_FILE).read_text()) == {"id": run_id, "sent": 6}
  assert wandb_files.summary(second)["final_step"] == 6


def test_other_processes_log_nothing(tmp_path):
  with MetricsWriter(tmp_path / "run", is_primary=False, wandb=OFFLINE) as writer:
    writer.write(1, {"loss": 1.0})
  assert not (tmp_path / "run").exists()


def test_a_missing_wandb_is_refused_in_one_line_when_the_config_is_built(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  with pytest.raises(ConfigError, match=r"pip install 't5lite\[wandb\]'"):
    WandbConfig(project="p")


def test_an_unknown_mode_is_refused_by_name():
  with pytest.raises(ConfigError, match="WandbConfig.mode='offlin' is not one of"):
    WandbConfig(mode="offlin")


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_run_resumed_is_one_wandb_run_with_every_step_once(tmp_path):
  """`t5lite train` with gin/runs/wandb.gin (offline), SIGKILLed past its checkpoint at step 4,
  rerun to step 12: the two W&B run files are one run (one id), and together they hold each
  step's row once, with the losses of the resumed run's metrics.jsonl."""
  gin_file = tmp_path / "run.gin"
  gin_file.write_text(runs.run_gin(steps=12, period=4) + "WandbConfig.mode = 'offline'\n")
  model_dir = tmp_path / "run"
  wandb_gin = "--gin_file=gin/runs/wandb.gin"
  process = runs.spawn(gin_file, model_dir, tmp_path / "first.log", wandb_gin)
  deadline = time.monotonic() + 240
  while runs.logged_steps(_text(tmp_path / "first.log"))[-1:] < [6]:  # past checkpoint 4
    assert process.poll() is None and time.monotonic() < deadline, (
        tmp_path / "first.log").read_text()[-3000:]
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait(timeout=60)

  done = run_t5lite(*runs.train_argv(gin_file, model_dir, wandb_gin), tests_on_path=True,
                    timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  sessions = sorted(run_files(model_dir), key=lambda f: f.stat().st_mtime)
  assert len(sessions) == 2
  run_id = json.loads((model_dir / STATE_FILE).read_text())["id"]
  assert all(f.name == f"run-{run_id}.wandb" for f in sessions)
  # The killed session's service wrote what it had flushed, maybe nothing; the resumed
  # offline session starts from step 0 (offline, nothing tells it more), so it sends every
  # row of metrics.jsonl, then its own. `wandb sync` of the two, in order, is one run in
  # which W&B ignores a row below the last step it holds: that run holds each step once.
  synced, last = [], 0
  for session in sessions:
    for row in wandb_files.history(session):
      if row["step"] > last:
        synced.append(row)
        last = row["step"]
  assert [row["step"] for row in synced] == list(range(1, 13))
  assert [row["step"] for row in wandb_files.history(sessions[1])] == list(range(1, 13))
  losses = {r["step"]: r["loss"] for r in metrics_records(model_dir) if "loss" in r}
  assert {row["step"]: row["loss"] for row in synced} == pytest.approx(losses)
