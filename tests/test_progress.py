"""Progress of the long jobs: a tqdm bar on a terminal, one plain line per period in a log,
stage lines for jobs of a few long steps; and eval, infer and cache report through it."""
from __future__ import annotations

import io
import time

import pytest

from t5lite.util import progress


class Terminal(io.StringIO):
  def isatty(self):
    return True


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_a_log_gets_one_line_per_period_and_one_at_the_end(monkeypatch):
  clock = Clock()
  monkeypatch.setattr(progress.time, "monotonic", clock)
  out = io.StringIO()
  bar = progress.Progress("eval copy", 400, "example", stream=out)
  assert bar.period == 30.0
  for now in (10.0, 31.0, 40.0, 61.5, 70.0):  # lines at 31 and 61.5 s, none between
    clock.now = now
    bar.update(80)
  clock.now = 80.0
  bar.close()  # the last count, not written yet
  assert out.getvalue().splitlines() == [
      "eval copy: 160/400 examples (40%), 5.2 examples/s, ETA 46s",
      "eval copy: 320/400 examples (80%), 5.2 examples/s, ETA 15s",
      "eval copy: 400/400 examples (100%), 5.0 examples/s, in 1m20s"]
  bar.close()  # once closed, nothing more
  assert len(out.getvalue().splitlines()) == 3


def test_without_a_total_there_is_no_percentage_or_eta(monkeypatch):
  monkeypatch.setenv(progress.PERIOD_ENV, "0")
  out = io.StringIO()
  with progress.Progress("cache t", None, "example", stream=out) as bar:
    bar.update(3)
  first = out.getvalue().splitlines()[0]
  assert first.startswith("cache t: 3 examples, ") and "ETA" not in first and "%" not in first


def test_a_terminal_gets_tqdms_bar(monkeypatch):
  out = Terminal()
  with progress.Progress("infer", 5, "input", stream=out) as bar:
    bar.update(5)
  text = out.getvalue()
  # Redrawn in place: carriage returns without new lines; a plain line would have neither.
  assert text.count("\r") >= 2 and "\n" not in text.rstrip("\n")
  assert "infer: 100%|" in text and "5/5" in text


@pytest.mark.parametrize("env, enabled", [({"T5LITE_PROGRESS": "0"}, True), ({}, False)])
def test_turned_off_it_writes_nothing(monkeypatch, env, enabled):
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  monkeypatch.setenv(progress.PERIOD_ENV, "0")
  out = io.StringIO()
  with progress.Progress("x", 2, stream=out, enabled=enabled) as bar:
    bar.update(2)
  with progress.stage("y", stream=out, enabled=enabled):
    pass
  assert out.getvalue() == ""


def test_a_long_stage_says_when_it_begins_and_how_long_it_took(monkeypatch):
  clock = Clock()
  monkeypatch.setattr(progress.time, "monotonic", clock)
  out = io.StringIO()
  with progress.stage("export: reading /tmp/run", stream=out, quiet_s=0.01):
    deadline = time.perf_counter() + 30
    while not out.getvalue() and time.perf_counter() < deadline:  # the timer thread's line
      time.sleep(0.01)
    clock.now = 125.0
  assert out.getvalue().splitlines() == ["export: reading /tmp/run ...",
                                         "export: reading /tmp/run: done in 2m05s"]


def test_a_quick_stage_or_one_that_fails_quickly_says_nothing():
  out = io.StringIO()
  with progress.stage("quick", stream=out):
    pass
  with pytest.raises(ValueError), progress.stage("refused", stream=out):
    raise ValueError  # its own one-line error is all a user sees
  time.sleep(progress.STAGE_QUIET_S + 0.2)  # no timer left behind either
  assert out.getvalue() == ""
