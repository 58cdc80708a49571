"""The suite's own layout: no test module imports another test module or conftest (shared
code lives in tests/helpers/, shared fixtures in helpers/fixtures.py); and the order in which
pytest-xdist is dealt the tests (helpers/scheduling.py); which tests the fast tier leaves out
(helpers/durations.py)."""
import ast
import json
import pathlib
import types

import pytest

from helpers import durations, scheduling

TESTS = pathlib.Path(__file__).resolve().parent
MODULES = sorted(TESTS.glob("test_*.py"))


def forbidden_imports(source: str) -> list[str]:
  """`import test_x`, `from test_x import ...`, `import conftest`, `from conftest import ...`
  anywhere in a module (inside functions too), as 'line N: name'."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module]
    else:
      continue
    for name in names:
      top = name.split(".")[0]
      if top.startswith("test_") or top == "conftest":
        found.append(f"line {node.lineno}: {name}")
  return found


def test_no_test_module_imports_another_or_conftest():
  found = {path.name: forbidden_imports(path.read_text()) for path in MODULES}
  assert not {name: lines for name, lines in found.items() if lines}, (
      "move what is shared to tests/helpers/ (fixtures: helpers/fixtures.py)")


def test_the_check_sees_every_form():
  assert forbidden_imports("import test_gin\nfrom conftest import REPO\n"
                           "def f():\n  from test_x import y\n") == [
      "line 1: test_gin", "line 2: conftest", "line 4: test_x"]
  assert forbidden_imports("from helpers import tiny\nimport testing\n") == []


class _Item:
  """What the scheduler reads of a pytest item: its node id and its xdist_group markers."""

  def __init__(self, nodeid, group=None):
    self.nodeid = nodeid
    self.markers = [pytest.mark.xdist_group(group).mark] if group else []

  def iter_markers(self, name):
    return [m for m in self.markers if m.name == name]

  def get_closest_marker(self, name):
    return next(iter(self.iter_markers(name)), None)

  def add_marker(self, marker):
    self.markers.append(marker.mark)


def test_whole_units_are_dealt_longest_first_and_keep_their_order(monkeypatch, tmp_path):
  times = tmp_path / "unit_times.json"
  times.write_text(json.dumps({"test_a": 5.0, "test_b": 50.0, "shared": 20.0}))
  monkeypatch.setattr(scheduling, "FILE", times)
  items = [_Item("tests/test_a.py::one"), _Item("tests/test_a.py::two", "shared"),
           _Item("tests/test_b.py::one"), _Item("tests/test_a.py::three"),
           _Item("tests/test_new.py::one"), _Item("tests/test_new.py::two"),
           _Item("tests/test_b.py::two", "shared")]
  scheduling.group_by_module_longest_first(items)
  # test_new is unrecorded: 2 tests at UNRECORDED_S_PER_TEST each, longer than test_a's 5 s
  assert 2 * scheduling.UNRECORDED_S_PER_TEST > 5.0
  assert [(i.nodeid, scheduling.unit_of(i)) for i in items] == [
      ("tests/test_b.py::one", "test_b"), ("tests/test_a.py::two", "shared"),
      ("tests/test_b.py::two", "shared"), ("tests/test_new.py::one", "test_new"),
      ("tests/test_new.py::two", "test_new"), ("tests/test_a.py::one", "test_a"),
      ("tests/test_a.py::three", "test_a")]
  assert all(len(i.iter_markers("xdist_group")) == 1 for i in items)


def test_recorded_times_and_a_modules_slow_fixtures_make_tests_slow(monkeypatch, tmp_path):
  """Over FAST_LIMIT_S as recorded, or taking a fixture the module lists in SLOW_FIXTURES
  (fixturenames holds the fixtures a test takes through others too): slow."""
  module = types.SimpleNamespace(SLOW_FIXTURES=("exports",))

  class Item:  # what the plugin reads of a pytest item
    def __init__(self, name, fixturenames):
      self.nodeid, self.module, self.fixturenames = f"tests/test_x.py::{name}", module, fixturenames
      self.marks = []

    def get_closest_marker(self, name):
      return next((mark for mark in self.marks if mark.name == name), None)

    def add_marker(self, marker):
      self.marks.append(marker.mark)

  recorded = tmp_path / "durations.json"
  recorded.write_text(json.dumps({"tests/test_x.py::test_long": 9.0,
                                  "tests/test_x.py::test_quick": 0.1}))
  monkeypatch.setattr(durations, "FILE", recorded)
  items = [Item("test_direct", ["exports", "tmp_path"]), Item("test_through", ["live", "exports"]),
           Item("test_long", ["tmp_path"]), Item("test_quick", ["tmp_path"])]
  assert durations.mark_measured_slow(items) == 3
  assert [bool(item.get_closest_marker("slow")) for item in items] == [True, True, True, False]
