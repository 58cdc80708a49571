"""`t5lite train` as users run it: gin run files, SIGKILL mid-run, SIGTERM, every run config.

The reference runs go through cli.main in this process; the interrupted ones are real
`python -m t5lite.cli train` subprocesses with the same gin, which must end with the same
losses (bitwise) and params as the reference after a restart.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.cli import run_t5lite
from helpers.paths import REPO
from helpers.runs import run_gin, train_argv
from helpers import assert_trees_equal, checkpoint_params, logged_losses
from t5lite import cli
from t5lite.launch import PREEMPTED_EXIT_CODE
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import model_dir as model_dir_lib

pytestmark = pytest.mark.e2e

# Enough that a subprocess is still training when the test interrupts it (SIGKILL after step
# KILL_AFTER, SIGTERM after step 7: dozens of steps before the end), and no more: every test
# trains the rest of the run in-process after the interruption.
STEPS, PERIOD = 60, 20
KILL_AFTER = PERIOD + 2  # past the checkpoint at PERIOD
RUN_GIN = run_gin(STEPS, period=PERIOD)


def spawn(gin_file, model_dir):
  return run_t5lite(*train_argv(gin_file, model_dir), wait=False, tests_on_path=True)


def wait_for_step(process, model_dir, step, timeout=240):
  """Blocks until metrics.jsonl shows `step`; the process must still be running then."""
  deadline = time.time() + timeout
  path = os.path.join(model_dir, "metrics.jsonl")
  while time.time() < deadline:
    if os.path.exists(path) and max(logged_losses(model_dir), default=0) >= step:
      assert process.poll() is None, "the run ended before the test could interrupt it"
      return
    if process.poll() is not None:
      pytest.fail(f"the run exited early ({process.returncode}):\n{process.stdout.read()}")
    time.sleep(0.05)
  process.kill()
  pytest.fail(f"no step {step} within {timeout}s")


@pytest.fixture(scope="module")
def gin_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("gin") / "run.gin"
  path.write_text(RUN_GIN)
  return str(path)


@pytest.fixture(scope="module")
def reference(gin_file, tmp_path_factory):
  """The uninterrupted run: its model dir."""
  sys.path.insert(0, str(REPO / "tests"))  # MIXTURE_OR_TASK_MODULE = 'train_tasks'
  model_dir = tmp_path_factory.mktemp("reference")
  assert cli.main(train_argv(gin_file, model_dir)) == 0
  return model_dir


@pytest.mark.slow
def test_reference_run_writes_a_self_describing_model_dir(reference):
  names = set(os.listdir(reference))
  assert {"checkpoints", "metrics.jsonl", "model_config.json", "vocabulary.json", "config.gin",
          "tensorboard", "task.json"} <= names
  assert model_dir_lib.load_task_record(reference) == {
      "mixture_or_task_name": "train_test_sc",
      "task_feature_lengths": {"inputs": 64, "targets": 16}}
  assert f"TRAIN_STEPS = {STEPS}" in (reference / "config.gin").read_text()
  steps = logged_losses(reference)
  assert sorted(steps) == list(range(1, STEPS + 1))
  assert np.mean([steps[s] for s in range(STEPS - 9, STEPS + 1)]) < np.mean(
      [steps[s] for s in range(1, 11)])


@pytest.mark.slow
def test_sigkill_mid_run_then_restart_equals_the_uninterrupted_run(gin_file, reference,
                                                                   tmp_path):
  process = spawn(gin_file, tmp_path)
  wait_for_step(process, tmp_path, KILL_AFTER)
  process.send_signal(signal.SIGKILL)
  assert process.wait() == -signal.SIGKILL
  killed_at = max(logged_losses(tmp_path))
  assert killed_at < STEPS
  assert cli.main(train_argv(gin_file, tmp_path)) == 0  # resumes from the last commit
  assert logged_losses(tmp_path) == logged_losses(reference)  # every step, bitwise
  _, resumed, step = checkpoint_params(tmp_path)
  _, expected, _ = checkpoint_params(reference)
  assert step == STEPS
  assert_trees_equal(resumed, expected)


@pytest.mark.slow
def test_sigterm_saves_and_exits_with_the_preempted_code(gin_file, reference, tmp_path):
  process = spawn(gin_file, tmp_path)
  wait_for_step(process, tmp_path, 7)
  process.send_signal(signal.SIGTERM)
  out, _ = process.communicate(timeout=120)
  assert process.returncode == PREEMPTED_EXIT_CODE, out  # 42: schedulers requeue on it
  saved = [int(line.split("saved checkpoint ")[1].split(";")[0]) for line in out.splitlines()
           if "preempted (SIGTERM): saved checkpoint" in line]
  assert len(saved) == 1 and 7 <= saved[0] < STEPS
  assert saved[0] in ckpt_lib.Checkpointer(tmp_path, read_only=True).all_steps()
  assert max(logged_losses(tmp_path)) == saved[0]  # it stopped right after saving
  assert cli.main(train_argv(gin_file, tmp_path)) == 0
  assert logged_losses(tmp_path) == logged_losses(reference)


@pytest.mark.slow
def test_sigterm_during_startup_exits_with_the_preempted_code(gin_file, reference, tmp_path):
  """SIGTERM while the process starts (imports, restore, compiling): the CLI's flag is up
  before the runtime starts, so the run stops before its first step, saves nothing (the
  checkpoint it resumed is still the newest) and exits 42; a rerun resumes from there."""
  model_dir = tmp_path / "run"
  shutil.copytree(reference, model_dir)
  resumed = STEPS - PERIOD  # the checkpoint before the last
  shutil.rmtree(model_dir / "checkpoints" / str(STEPS))  # resume from there
  os.remove(model_dir / "metrics.jsonl")
  process = spawn(gin_file, model_dir)
  for line in process.stdout:  # the first line after the CLI installed its handler
    if "t5lite: single process" in line:
      break
  process.send_signal(signal.SIGTERM)
  out, _ = process.communicate(timeout=120)
  assert process.returncode == PREEMPTED_EXIT_CODE, out
  assert f"preempted (SIGTERM) before the first step, at step {resumed}" in out
  assert ckpt_lib.Checkpointer(model_dir, read_only=True).all_steps() == [resumed - PERIOD,
                                                                           resumed]
  assert cli.main(train_argv(gin_file, model_dir, f"--gin.TRAIN_STEPS={resumed + 2}")) == 0
  assert logged_losses(model_dir) == {s: logged_losses(reference)[s]
                                      for s in (resumed + 1, resumed + 2)}


# The demo model cut to one layer a stack, on short batches: the run files' tasks, objectives,
# optimizers, evals and warm start are what is tested, and XLA compiles (train, eval and
# decode) about a layer's program per layer.
DEMO_SIZE = ("--gin.ModelConfig.num_encoder_layers=1", "--gin.ModelConfig.num_decoder_layers=1",
             "--gin.BATCH_SIZE=8")


@pytest.mark.slow
def test_demo_run_configs_train_end_to_end(tmp_path, capsys):
  """gin/runs/demo.gin and demo_finetune.gin, a few steps each, on the embedded data. The
  finetuning run's inference evals decode one batch (DecodeConfig.batch_size, 32 examples), not
  its 64 (two): the same compiled decode and metrics, half the decoding."""
  pretrain, finetune = tmp_path / "pretrain", tmp_path / "finetune"
  assert cli.main(train_argv("gin/runs/demo.gin", pretrain, *DEMO_SIZE,
                             "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
                             "--gin.TRAIN_STEPS=2", "--gin.EVAL_PERIOD=2",
                             "--gin.TrainConfig.eval_steps=1")) == 0
  assert cli.main(train_argv("gin/runs/demo_finetune.gin", finetune, *DEMO_SIZE,
                             "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 16}",
                             f"--gin.INITIAL_CHECKPOINT_PATH={pretrain}", "--gin.TRAIN_STEPS=4",
                             "--gin.EVAL_PERIOD=2", "--gin.TrainConfig.eval_steps=1",
                             "--gin.TrainConfig.infer_eval_examples=32")) == 0
  out = capsys.readouterr().out
  assert "initialized from" in out and "(step 2); 2 steps to go" in out
  records = [json.loads(line) for line in open(finetune / "metrics.jsonl")]
  assert [r["step"] for r in records if "loss" in r] == [4]  # log_period 20: the last step
  eval_steps = [r["step"] for r in records if "eval/stdlib_docstring_summary/loss" in r]
  assert eval_steps == [2, 4]  # before training (run_eval_before_training) and at the end


def test_missing_required_macros_are_named(capsys):
  assert cli.main(["train", "--gin_file=gin/runs/pretrain.gin",
                   "--gin_file=gin/models/tiny.gin"]) == 2
  err = capsys.readouterr().err
  assert "requires MODEL_DIR, MIXTURE_OR_TASK_NAME" in err and "--gin.MODEL_DIR=" in err


def test_unknown_task_lists_near_names(tmp_path, capsys):
  assert cli.main(train_argv("gin/runs/demo.gin", tmp_path,
                             "--gin.MIXTURE_OR_TASK_NAME=stdlib_span_corruptoin")) == 2
  assert "closest: stdlib_span_corruption" in capsys.readouterr().err
