"""How pytest-xdist deals the suite to its workers: whole modules, the longest first.

Under `--dist loadgroup` a test without an `xdist_group` is a unit of its own, so xdist deals
a module's tests out to every worker in turn: each worker then builds the module's
module-scoped fixtures and compiles the programs its tests share (each worker has its own
compilation cache). Here every test without a group gets its module as its group, so a module
runs on one worker, as under `--dist loadscope`; explicit groups (a reference run shared by
several modules) stay as they are.

xdist hands the units out in collection order once its reordering (by test count) is off, so
the collection is sorted by each unit's recorded time on a cold cache, longest first: with
the large units started first, the small ones fill in at the end and the workers finish
close together (the longest-processing-time-first rule). The times live in
tests/unit_times.json, written by `--record-unit-times` from a run on a cold cache (as CI
runs); a unit not recorded there is estimated from its number of tests.
"""
from __future__ import annotations

import collections
import json
import pathlib

import pytest

from helpers.durations import merge_into, unsuffixed_id

FILE = pathlib.Path(__file__).resolve().parents[1] / "unit_times.json"
# A unit not yet recorded: this many seconds a test (about the suite's mean, cold).
UNRECORDED_S_PER_TEST = 3.0


def pytest_addoption(parser):
  parser.addoption("--record-unit-times", action="store_true",
                   help="write each scheduling unit's time (its tests' setup + call + "
                   "teardown, in seconds) to tests/unit_times.json; run it on a cold "
                   "compilation cache, as CI runs")


def pytest_configure(config):
  # xdist's own order (the units with the most tests first) would undo the sort below.
  if getattr(config.option, "loadscopereorder", None) is not None:
    config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the groups into node ids
def pytest_collection_modifyitems(items):
  group_by_module_longest_first(items)


def unit_of(item) -> str:
  """The item's explicit xdist group(s), joined as xdist joins them, else its module's name
  (`test_models`)."""
  groups = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                   for m in item.iter_markers("xdist_group")})
  return "_".join(groups) or module_of(item.nodeid)


def module_of(nodeid: str) -> str:
  return pathlib.PurePath(nodeid.split("::")[0]).stem


def group_by_module_longest_first(items) -> None:
  """Gives ungrouped items their module's group and sorts `items` (in place) by unit, the
  longest recorded unit first; items keep their order within a unit."""
  recorded = json.loads(FILE.read_text(encoding="utf-8")) if FILE.exists() else {}
  units = [unit_of(item) for item in items]
  counts = collections.Counter(units)
  for item, unit in zip(items, units):
    if not item.get_closest_marker("xdist_group"):
      item.add_marker(pytest.mark.xdist_group(unit))
  estimate = {u: recorded.get(u, n * UNRECORDED_S_PER_TEST) for u, n in counts.items()}
  first_seen = {u: i for i, u in reversed(list(enumerate(units)))}
  order = sorted(range(len(items)),
                 key=lambda i: (-estimate[units[i]], first_seen[units[i]], i))
  items[:] = [items[i] for i in order]


_times: dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report):
  """On the controller, which sees the node ids that xdist's workers suffixed with @GROUP."""
  nodeid = report.nodeid
  unit = nodeid[len(unsuffixed_id(nodeid)) + 1:] or module_of(nodeid)
  _times[unit] += report.duration


def pytest_sessionfinish(session):
  if (not session.config.getoption("--record-unit-times")
      or hasattr(session.config, "workerinput")):
    return
  merge_into(FILE, {k: round(v, 1) for k, v in _times.items()})
