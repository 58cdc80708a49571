"""The repo's tasks/ folder installs as t5lite_tasks and never claims the name `tasks`.

Checked from a fresh interpreter outside the repo, where only the installation decides
what an import finds (the repo root on sys.path would hide the question).
"""
import json
import subprocess
import sys

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
