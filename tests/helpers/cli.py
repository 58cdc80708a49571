"""The one way tests run the CLI (or a `python -c` probe) in a subprocess: `run_t5lite(...)`.

Every call has a timeout. The environment is the test process's (conftest.py set the
compilation cache, JAX_PLATFORMS=cpu and 8 fake devices before JAX was imported), plus what
the call asks for. Processes started with wait=False are remembered; the `cli_processes`
fixture (helpers/fixtures.py, autouse) kills any a test left running.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers.paths import REPO, TESTS

DEFAULT_TIMEOUT = 300
_STARTED: list[subprocess.Popen] = []


def environment(devices: int | None = None, tests_on_path: bool = False,
                env: dict | None = None) -> dict:
  """os.environ, with XLA's fake CPU device count set to `devices`, tests/ first on
  PYTHONPATH (for MIXTURE_OR_TASK_MODULE = 'train_tasks'), then `env`."""
  out = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  if devices is not None:
    flags = [f for f in out.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    out["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  if tests_on_path:
    out["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), out.get("PYTHONPATH", "")] if p)
  out.update({k: str(v) for k, v in (env or {}).items()})
  return out


def argv(*args, python: str | None = None, script=None, module: str | None = None,
         console: bool = False) -> list[str]:
  """[bin/t5lite] if console, [python, -c, code] for python=code, [python, script] for a
  script, [python, -m, module] for a module (pip), else [python, -m, t5lite.cli]; then args,
  str()-ed."""
  if console:
    head = [os.path.join(os.path.dirname(sys.executable), "t5lite")]
  elif python is not None:
    head = [sys.executable, "-c", python]
  elif script is not None:
    head = [sys.executable, str(script)]
  elif module is not None:
    head = [sys.executable, "-m", module]
  else:
    head = [sys.executable, "-m", "t5lite.cli"]
  return head + [str(a) for a in args]


def run_t5lite(*args, wait: bool = True, python: str | None = None, script=None,
               module: str | None = None, console: bool = False, devices: int | None = None,
               tests_on_path: bool = False, env: dict | None = None, input: str | None = None,
               log=None, cwd=REPO, timeout: float = DEFAULT_TIMEOUT, expect: int | None = None):
  """Runs `t5lite ARGS` (see argv() for the other forms) in a subprocess.

  wait=True: returns the CompletedProcess (text stdout/stderr, or both in `log` when given),
  with .seconds, the wall time; raises subprocess.TimeoutExpired after `timeout` seconds
  (the process is killed) and AssertionError, with stderr's tail, when `expect` is set and
  the exit code differs. wait=False: returns the Popen (output to `log`, a path, stderr
  folded in; else pipes), killed at the test's teardown if still running."""
  command = argv(*args, python=python, script=script, module=module, console=console)
  environ = environment(devices, tests_on_path, env)
  if not wait:
    if log is not None:
      with open(log, "w") as handle:
        process = subprocess.Popen(command, cwd=cwd, env=environ, stdout=handle,
                                   stderr=subprocess.STDOUT, text=True)
    else:
      process = subprocess.Popen(command, cwd=cwd, env=environ, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    _STARTED.append(process)
    return process
  start = time.monotonic()
  if log is not None:
    with open(log, "w") as handle:
      result = subprocess.run(command, cwd=cwd, env=environ, stdout=handle,
                              stderr=subprocess.STDOUT, text=True, input=input, timeout=timeout)
  else:
    result = subprocess.run(command, cwd=cwd, env=environ, capture_output=True, text=True,
                            input=input, timeout=timeout)
  result.seconds = time.monotonic() - start
  if expect is not None:
    assert result.returncode == expect, (
        f"{' '.join(command[:6])}... exited {result.returncode}, not {expect}:\n"
        f"{(result.stderr or '')[-3000:]}")
  return result


def kill_leftovers() -> None:
  """Kills the wait=False processes still running (a failed test's), then forgets them all."""
  while _STARTED:
    process = _STARTED.pop()
    if process.poll() is None:
      process.kill()
      try:
        process.wait(timeout=30)
      except subprocess.TimeoutExpired:
        pass
