"""Shared fixtures (a pytest plugin: conftest.py names it in pytest_plugins). Test modules
ask for them by name and never import them."""
import sys

import pytest

from helpers import runs
from helpers.paths import TESTS


# --- the reliability tests' reference run ----------------------------------------------------

@pytest.fixture(scope="module")
def reliability_gin_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("gin") / "run.gin"
  path.write_text(runs.RUN_GIN)
  return str(path)


@pytest.fixture(scope="module")
def reliability_reference(reliability_gin_file, tmp_path_factory):
  """The uninterrupted run's MODEL_DIR."""
  from t5lite import cli
  if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # MIXTURE_OR_TASK_MODULE = 'train_tasks'
  model_dir = tmp_path_factory.mktemp("reference")
  assert cli.main(runs.train_argv(reliability_gin_file, model_dir)) == 0
  assert runs.committed(runs.listing(model_dir / "checkpoints")) == [runs.PREVIOUS, runs.NEWEST]
  return model_dir


@pytest.fixture(scope="module")
def reliability_saved(reliability_gin_file, reliability_reference):
  """The run's abstract state and params, and what the reference's two steps hold."""
  from t5lite.cli import gin_config
  from t5lite.runtime import checkpoints as ckpt_lib
  from t5lite.train.trainer import Trainer
  gin_config.parse([reliability_gin_file], [f"MODEL_DIR='{reliability_reference}'"])
  trainer = Trainer(gin_config.model_config(), gin_config.train_config())
  checkpointer = ckpt_lib.Checkpointer(reliability_reference, read_only=True)
  states = {step: checkpointer.restore(step, trainer.abstract_state)
            for step in (runs.PREVIOUS, runs.NEWEST)}
  checkpointer.close()
  return trainer, states


# --- CLI subprocesses ------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def cli_processes():
  """Kills, at teardown, the processes a test started with run_t5lite(..., wait=False) and left
  running."""
  from helpers import cli
  yield
  cli.kill_leftovers()
