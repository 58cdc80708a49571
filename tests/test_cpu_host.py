"""t5lite.runtime.cpu_host: the `t5lite` command's CPU process settings (synchronous dispatch,
a heap that keeps freed memory), each in a fresh process since they are per process."""
import json
import os
import platform
import subprocess
import sys

import pytest

from helpers.cli import run_t5lite

PROBE = """
import json, os, sys
import jax
from t5lite.runtime import cpu_host
if sys.argv[1] == "late":
  jax.devices()  # backends made before tune(): too late to choose the dispatch
print(json.dumps({"tuned": cpu_host.tune(), "again": cpu_host.tune(),
                  "async": jax.config.read("jax_cpu_enable_async_dispatch")}))
"""


def _probe(mode="early", **env):
  out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", **env}, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_tune_sets_sync_dispatch_and_keeps_the_heap():
  result = _probe()
  assert result["tuned"] == result["again"]  # once per process
  assert result["tuned"]["enabled"] is True and result["async"] is False
  assert result["tuned"]["async_dispatch"] is False
  if platform.libc_ver()[0] == "glibc":
    assert result["tuned"]["malloc"] == "glibc M_MMAP_MAX=0 M_TRIM_THRESHOLD=2147483647"


def test_tuning_off_by_environment_and_user_dispatch_wins():
  off = _probe(T5LITE_CPU_TUNING="0")["tuned"]
  assert off["enabled"] is False and off["malloc"] == "default" and off["async_dispatch"] is True
  assert off["why_not"] == "T5LITE_CPU_TUNING=0"
  kept = _probe(JAX_CPU_ENABLE_ASYNC_DISPATCH="1")
  assert kept["tuned"]["enabled"] is True and kept["async"] is True


def test_too_late_changes_nothing():
  late = _probe("late")
  assert late["tuned"]["enabled"] is False and late["async"] is True
  assert "before tune()" in late["tuned"]["why_not"]


@pytest.mark.e2e
@pytest.mark.slow
def test_bench_reports_the_machine_and_the_numbers_do_not_change(tmp_path):
  """The same tiny train steps with and without the settings: bitwise equal losses; the JSON
  line names the CPU, the versions and the settings in force."""
  reports = {}
  for tuning in ("1", "0"):
    out = run_t5lite("bench", "train", "--model", "tiny", "--no_hf", "--repeats", "1",
                     "--steps", "2", "--batch_size", "3", "--inputs_length", "37",
                     "--targets_length", "11", env={"T5LITE_CPU_TUNING": tuning}, timeout=300,
                     expect=0)
    reports[tuning] = json.loads(out.stdout.strip().splitlines()[-1])
  assert reports["1"]["warmup_losses"] == reports["0"]["warmup_losses"]
  machine = reports["1"]["machine"]
  assert machine["cpu_tuning"]["enabled"] is True
  assert reports["0"]["machine"]["cpu_tuning"]["enabled"] is False
  assert {"jax", "jaxlib", "torch", "xla_flags", "cores"} <= set(machine)
  if os.path.exists("/proc/cpuinfo"):
    assert machine["cpu"]["vendor"] and isinstance(machine["cpu"]["avx512"], bool)
    assert isinstance(machine["cpu"]["family"], int)
