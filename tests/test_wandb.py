"""The Weights & Biases sink, in W&B's offline mode (its files, no network): every metrics row,
the configs, the run's last figures; a resumed run continues the same W&B run."""
from __future__ import annotations

import sys

import pytest

import train_tasks  # noqa: F401 (registers train_test_copy)
from helpers import BYTE_VOCAB_SIZE, metrics_records, quiet, tiny, train_config, wandb_files
from t5lite.errors import ConfigError
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.runtime.metrics_writer import MetricsWriter
from t5lite.runtime.wandb_sink import RUN_ID_FILE, WandbConfig
from t5lite.train.trainer import train

pytest.importorskip("wandb")  # the test extra installs it
MODEL = tiny(vocab_size=BYTE_VOCAB_SIZE)
OFFLINE = WandbConfig(project="t5lite-tests", mode="offline", tags=("tiny",))


def run_files(model_dir):
  return sorted((model_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_rows_configs_and_figures_reach_the_run_and_a_resumed_run_continues_it(tmp_path):
  config = train_config(tmp_path, train_steps=4, log_period=2, wandb=OFFLINE,
                        checkpoint=CheckpointConfig(period=2, async_save=False))
  result = train(MODEL, config, log=quiet)
  run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
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
  assert [row["step"] for row in wandb_files.history(second)] == [6]
  assert wandb_files.summary(second)["final_step"] == 6


def test_other_processes_log_nothing(tmp_path):
  with MetricsWriter(tmp_path / "run", is_primary=False, wandb=OFFLINE) as writer:
    writer.write(1, {"loss": 1.0})
  assert not (tmp_path / "run").exists()


def test_a_missing_wandb_is_refused_in_one_line_before_any_file(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  with pytest.raises(ConfigError, match=r"pip install 't5lite\[wandb\]'"):
    MetricsWriter(tmp_path, wandb=OFFLINE)
  assert not list(tmp_path.iterdir())


def test_an_unknown_mode_is_refused_by_name():
  with pytest.raises(ConfigError, match="WandbConfig.mode='offlin' is not one of"):
    WandbConfig(mode="offlin")
