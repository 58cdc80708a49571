"""The repo's tasks/ folder installs as t5lite_tasks and never claims the name `tasks`."""
import importlib
import importlib.metadata
import pathlib

from conftest import REPO


def test_tasks_folder_is_importable_as_t5lite_tasks():
  module = importlib.import_module("t5lite_tasks")
  assert pathlib.Path(module.__file__).resolve().parent == REPO / "tasks"


def test_distribution_does_not_install_a_top_level_tasks_package():
  dist = importlib.metadata.distribution("t5lite")
  top_level = set()
  for f in dist.files or []:
    parts = pathlib.PurePosixPath(str(f)).parts
    if parts and not parts[0].endswith((".dist-info", ".pth")) and parts[0] != "__editable__":
      top_level.add(parts[0])
  assert "tasks" not in top_level
  # The console script is declared.
  scripts = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
  assert scripts["t5lite"] == "t5lite.cli:main"
