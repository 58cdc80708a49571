"""Packaging: the repo's tasks/ folder installs as t5lite_tasks and never claims the name
`tasks`; a wheel built from the tree ships the gin configs (gin/ as t5lite/gin), the launch
recipes and their README; installed (not editable) in a fresh venv, `t5lite train
--gin_file=gin/runs/demo.gin` works from a directory that is not the repo.

Checked from fresh interpreters outside the repo, where only the installation decides
what an import finds (the repo root on sys.path would hide the question).
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from helpers.cli import run_t5lite

from helpers.paths import REPO

PROBE = """
import importlib.util, json
spec = lambda name: importlib.util.find_spec(name)
tasks, ours = spec("tasks"), spec("t5lite_tasks")
print(json.dumps({"tasks": tasks and tasks.origin, "t5lite_tasks": ours and ours.origin}))
"""


def test_installed_names(tmp_path):
  out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True,
                       text=True, check=True).stdout
  origins = json.loads(out)
  assert origins["t5lite_tasks"] == str(REPO / "tasks" / "__init__.py")
  # Either PyPI's `tasks` (if someone installed it) or nothing: never our folder.
  assert origins["tasks"] is None or str(REPO) not in origins["tasks"]


def test_console_script_is_declared():
  from importlib.metadata import entry_points
  scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
  assert scripts["t5lite"] == "t5lite.cli:console_main"


# --- a wheel, installed in a fresh venv ------------------------------------------------------

def tree_files() -> list[str]:
  """The working tree's files that git tracks or would (not ignored), that exist."""
  listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO, capture_output=True, text=True, check=True, timeout=60)
  return sorted({f for f in listed.stdout.split("\0") if f and (REPO / f).is_file()})


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """A wheel of a copy of the tree (building in place would write build/ into the repo)."""
  src = tmp_path_factory.mktemp("src")
  for name in tree_files():
    (src / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / name, src / name)
  run_t5lite("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
             src / "dist", ".", module="pip", cwd=src, timeout=300, expect=0)
  [built] = (src / "dist").glob("t5lite-*.whl")
  return built


@pytest.mark.e2e
@pytest.mark.slow
def test_the_wheel_ships_every_gin_file_the_recipes_and_their_readme(wheel):
  names = set(zipfile.ZipFile(wheel).namelist())
  gin = [f for f in tree_files() if f.startswith("gin/") and f.endswith(".gin")]
  assert len(gin) > 20 and "gin/runs/demo.gin" in gin
  assert {f"t5lite/{f}" for f in gin} <= names, sorted({f"t5lite/{f}" for f in gin} - names)
  recipes = [f for f in tree_files() if f.startswith("t5lite/launch/recipes/")]
  assert {"jobset.yaml", "slurm_gpu.sbatch", "tpu_vm_pod.sh"} <= {os.path.basename(f)
                                                                 for f in recipes}
  assert set(recipes) | {"t5lite/launch/README.md"} <= names


@pytest.mark.e2e
@pytest.mark.slow
def test_pip_install_then_t5lite_train_on_the_demo_config_from_any_directory(wheel, tmp_path):
  """A fresh venv whose only t5lite is the wheel's (its dependencies come from this venv's
  site-packages through a .pth line, which does not run this venv's editable-install hook)."""
  fresh = tmp_path / "fresh"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True,
                 timeout=120)
  python = fresh / "bin" / "python"
  purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                            "'purelib'))"], capture_output=True, text=True, check=True,
                           timeout=60).stdout.strip()
  pathlib.Path(purelib, "deps_from_test_venv.pth").write_text(sysconfig.get_path("purelib")
                                                              + "\n")
  run_t5lite("--python", python, "install", "--no-deps", "--no-index", "-q", wheel,
             module="pip", cwd=tmp_path, timeout=300, expect=0)
  where = tmp_path / "elsewhere"
  where.mkdir()
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  probe = subprocess.run([python, "-c", "import t5lite, t5lite_tasks; print(t5lite.__file__); "
                          "print(t5lite_tasks.__file__)"], cwd=where, env=env,
                         capture_output=True, text=True, timeout=120)
  assert probe.returncode == 0, probe.stderr
  assert all(line.startswith(purelib) for line in probe.stdout.split()), probe.stdout
  run = where / "run"
  done = subprocess.run(
      [fresh / "bin" / "t5lite", "train", "--gin_file=gin/runs/demo.gin",
       f"--gin.MODEL_DIR={run}", "--gin.TRAIN_STEPS=2", "--gin.EVAL_PERIOD=0",
       "--gin.BATCH_SIZE=8", "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
       "--gin.TrainConfig.log_period=1", "--gin.CheckpointConfig.period=2"],
      cwd=where, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
          if "loss" in r] == [1, 2]
  assert "2" in os.listdir(run / "checkpoints")
