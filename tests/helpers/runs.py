"""What the reliability tests share: a tiny training run (RUN_GIN, a checkpoint every PERIOD
steps, KEEP kept), and helpers to spawn `t5lite train`, list checkpoint folders, read a run's
console and mount test disks. Its uninterrupted reference MODEL_DIR is a fixture
(helpers/fixtures.py: reliability_reference). Used by test_reliability and test_reliability_env.
"""
import os
import re
import shutil
import subprocess

from helpers import logged_losses, metrics_records
from helpers.cli import run_t5lite

STEPS, PERIOD, KEEP = 20, 2, 2
NEWEST, PREVIOUS = STEPS, STEPS - PERIOD  # the steps a finished run keeps


def run_gin(steps: int, period: int, keep: int | None = None) -> str:
  """The tiny span-corruption run the CLI tests train: `steps` steps, a checkpoint every
  `period` (the newest `keep` kept; None: orbax's default). One layer a stack: nothing here
  depends on depth, and each unscanned layer is compiled anew (a cold run compiles for 15-21 s
  with one, 26-27 s with two)."""
  keep_line = f"CheckpointConfig.keep = {keep}\n" if keep is not None else ""
  return f"""
include 'runs/pretrain.gin'
include 'models/tiny.gin'
ModelConfig.vocab_size = 384
ModelConfig.num_encoder_layers = 1
ModelConfig.num_decoder_layers = 1
ModelConfig.dropout_rate = 0.1
MIXTURE_OR_TASK_MODULE = 'train_tasks'
MIXTURE_OR_TASK_NAME = 'train_test_sc'
TASK_FEATURE_LENGTHS = {{'inputs': 64, 'targets': 16}}
BATCH_SIZE = 8
TRAIN_STEPS = {steps}
EVAL_PERIOD = 0
TrainConfig.log_period = 1
CheckpointConfig.period = {period}
{keep_line}ScheduleConfig.warmup_steps = 10
ScheduleConfig.value = 0.1
"""


RUN_GIN = run_gin(STEPS, PERIOD, KEEP)
TMP_MARK = "orbax-checkpoint-tmp"  # orbax writes a step into <step>.orbax-checkpoint-tmp*


# --- helpers -------------------------------------------------------------------------------

def train_argv(gin_file, model_dir, *more):
  return ["train", f"--gin_file={gin_file}", f"--gin.MODEL_DIR={model_dir}", *more]


def spawn(gin_file, model_dir, log_path, *more):
  """`python -m t5lite.cli train` with stdout and stderr in log_path."""
  return run_t5lite(*train_argv(gin_file, model_dir, *more), wait=False, tests_on_path=True,
                    log=log_path)


def listing(folder) -> list[str]:
  try:
    return os.listdir(folder)
  except FileNotFoundError:
    return []


def committed(names) -> list[int]:
  return sorted(int(n) for n in names if n.isdigit())


def tmp_folders(folder) -> set[tuple[str, int]]:
  """(name, inode) of the saves in flight: a restart re-creates a killed save's folder under
  the same name, the inode tells them apart."""
  found = set()
  for name in listing(folder):
    if TMP_MARK in name:
      try:
        found.add((name, os.stat(os.path.join(folder, name)).st_ino))
      except FileNotFoundError:
        pass  # committed (renamed) or removed meanwhile
  return found


def logged_steps(text: str) -> list[int]:
  """The steps of the progress lines ('step 12/30  loss ...') in a run's output."""
  return [int(s) for s in re.findall(r"^step (\d+)/", text, re.M)]


def one_error_line(err: str, prog: str) -> str:
  """The one `t5lite VERB: error:` line of a run that exited 2; no traceback."""
  assert "Traceback" not in err, err
  lines = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
  assert len(lines) == 1, err
  return lines[0]


def console_noise(err: str) -> list[str]:
  """stderr lines other than t5lite's own (orbax/absl logs, tracebacks)."""
  return [line for line in err.splitlines() if line.strip() and not line.startswith("t5lite")
          and not line.startswith(("step ", "W0000", "I0000"))]


def mount(*args) -> str | None:
  """Runs `mount ARGS`; None when it worked, else why not (the test injects the error then)."""
  if shutil.which("mount") is None:
    return "no mount command"
  done = subprocess.run(["mount", *args], capture_output=True, text=True)
  return None if done.returncode == 0 else (done.stderr.strip() or f"mount: exit "
                                            f"{done.returncode}")


def umount(path) -> None:
  if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def assert_same_run_as(model_dir, reference, last_step=STEPS):
  """Every step 1..last_step logged exactly once, with the reference's losses (bitwise)."""
  rows = [r for r in metrics_records(model_dir) if "loss" in r]
  assert [r["step"] for r in rows] == list(range(1, last_step + 1))
  expected = logged_losses(reference)
  assert {r["step"]: r["loss"] for r in rows} == {s: expected[s] for s in range(1, last_step + 1)}
