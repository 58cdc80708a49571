"""The fast tier by measurement: tests recorded slower than FAST_LIMIT_S get the `slow` marker.

`tests/durations.json` holds each test's measured time (setup + call + teardown, in seconds,
on a warm compilation cache), written by `make durations` (pytest's --record-durations, this
plugin's option). At collection every test recorded over FAST_LIMIT_S is marked slow, so
`make test-fast` (`-m "unit and not slow"`) keeps to its budget as the suite grows: a new test
is fast until a recording says otherwise. The full suite (`make test`) runs them all either way.
"""
from __future__ import annotations

import collections
import json
import pathlib

import pytest

FILE = pathlib.Path(__file__).resolve().parents[1] / "durations.json"
# With this limit the fast tier took about 2 minutes on 2 cores, warm
# (docs/development.md, "Test tiers").
FAST_LIMIT_S = 2.0


def pytest_addoption(parser):
  parser.addoption("--record-durations", action="store_true",
                   help="write each test's time (setup + call + teardown) to "
                   "tests/durations.json, merged with the times already there")


def unsuffixed_id(nodeid: str) -> str:
  """nodeid without the `@GROUP` that pytest-xdist's --dist loadgroup appends on its workers
  (as xdist reads it: an @ after the parameters' closing bracket)."""
  at = nodeid.rfind("@")
  return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def _takes_a_slow_fixture(item) -> bool:
  """A module-scoped fixture's cost is recorded against whichever of its tests ran first, so a
  recording would move its tests out of the fast tier one at a time: a module names such
  fixtures in SLOW_FIXTURES, and every test that takes one (directly or through another
  fixture) is slow."""
  slow_fixtures = getattr(getattr(item, "module", None), "SLOW_FIXTURES", ())
  return bool(set(slow_fixtures) & set(getattr(item, "fixturenames", ())))


def mark_measured_slow(items) -> int:
  """Adds `slow` to the items recorded over FAST_LIMIT_S and to those that take one of their
  module's SLOW_FIXTURES; returns how many."""
  recorded = json.loads(FILE.read_text(encoding="utf-8")) if FILE.exists() else {}
  count = 0
  for item in items:
    if item.get_closest_marker("slow"):
      continue
    if (recorded.get(unsuffixed_id(item.nodeid), 0.0) > FAST_LIMIT_S
        or _takes_a_slow_fixture(item)):
      item.add_marker(pytest.mark.slow)
      count += 1
  return count


_times: dict[str, float] = collections.defaultdict(float)


def pytest_runtest_logreport(report):
  """On the controller (also with pytest-xdist, whose workers send their reports there)."""
  _times[unsuffixed_id(report.nodeid)] += report.duration


def pytest_sessionfinish(session):
  if not session.config.getoption("--record-durations") or hasattr(session.config,
                                                                   "workerinput"):
    return
  merge_into(FILE, {k: round(v, 3) for k, v in _times.items()})


def merge_into(path: pathlib.Path, times: dict[str, float]) -> None:
  """Writes `times` into the JSON file at `path`, over the entries it already has."""
  recorded = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
  recorded.update(times)
  path.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n", encoding="utf-8")
