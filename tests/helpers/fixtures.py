"""Shared fixtures (a pytest plugin: conftest.py names it in pytest_plugins). Test modules
ask for them by name and never import them."""
import functools
import os
import pathlib
import shutil
import sys

import pytest

from helpers import runs
from t5lite.bench import machine
from helpers.paths import TESTS


# --- the reliability tests' reference run ----------------------------------------------------
# Built once per test session: under pytest-xdist every worker is a session of its own, so the
# first worker to get here builds it into a folder all workers share, under a file lock; the
# others wait, then reuse it. Consumers copy it before changing anything.

def shared_dir(tmp_path_factory, name: str) -> pathlib.Path:
  """A folder for `name` that every xdist worker of this run sees (the workers' basetemps are
  siblings); without xdist, under this session's basetemp."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  return base / name


@pytest.fixture(scope="session")
def reliability_gin_file(reliability_reference):
  return str(reliability_reference.parent / "run.gin")


@pytest.fixture(scope="session")
def reliability_reference(tmp_path_factory):
  """The uninterrupted run's MODEL_DIR (RUN_GIN in helpers/runs.py)."""
  from filelock import FileLock
  root = shared_dir(tmp_path_factory, "reliability_reference")
  root.mkdir(parents=True, exist_ok=True)
  model_dir, done = root / "reference", root / "done"
  with FileLock(str(root / "lock")):
    if not done.exists():
      from t5lite import cli
      if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))  # MIXTURE_OR_TASK_MODULE = 'train_tasks'
      shutil.rmtree(model_dir, ignore_errors=True)  # a worker that died halfway
      (root / "run.gin").write_text(runs.RUN_GIN)
      assert cli.main(runs.train_argv(root / "run.gin", model_dir)) == 0
      done.touch()
  assert runs.committed(runs.listing(model_dir / "checkpoints")) == [runs.PREVIOUS, runs.NEWEST]
  return model_dir


@pytest.fixture(scope="session")
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


# --- benches -------------------------------------------------------------------------------

@pytest.fixture
def quick_matmul_rate(monkeypatch):
  """The bench's matmul-rate probe (machine.matmul_flops_per_s) timed over its fewest calls
  rather than 2 s of them: the tests check how its figures relate, not the rate itself."""
  monkeypatch.setattr(machine, "matmul_flops_per_s",
                      functools.partial(machine.matmul_flops_per_s, seconds=0.0))
