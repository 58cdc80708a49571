"""Shared test setup: compilation cache, 8 fake CPU devices, the tiers (unit, parity, e2e) and
the `slow` marker, a suite timer.

Environment variables are set before JAX is imported so that test subprocesses inherit them.
Shared helpers (tiny configs, tree comparisons, logged losses) live in the helpers/ package
(`from helpers import tiny`); shared fixtures in helpers/fixtures.py, loaded as a plugin. Test
modules import neither conftest nor other test modules (test_suite_layout.py checks).
"""
import os
import pathlib
import time

# helpers.paths.REPO too; not imported from there: importing the helpers package imports JAX,
# which must come after the environment below.
REPO = pathlib.Path(__file__).resolve().parents[1]
# One compilation cache for every worker and the test subprocesses: a program one worker
# compiled is read by the other (with a folder per worker, 101 of the fast tier's 1,105
# programs were compiled by both workers from a cold cache). JAX writes an entry in place, not
# by rename, but in one write of a few kB: a reader that caught one mid-write would get a
# damaged entry, which JAX refuses with a warning and compiles again, never a wrong program.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# JAX's default also points XLA's GPU autotuning cache into the cache folder, and that folder's
# path then enters every entry's key: the same program got another key in each worker's folder
# (and in each checkout), so the entries shared above never hit. With it off, keys depend on
# the program alone. The suite runs on CPU, which has no autotuning.
os.environ.setdefault("JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES", "none")
# The embedded corpus and its vocabulary are built once here and reused by later runs.
os.environ.setdefault("T5LITE_DATA_DIR", str(REPO / ".t5lite_data"))
# The suite runs on CPU devices. The tpu extra (libtpu, for `t5lite compile`) is installed
# too: without JAX_PLATFORMS, every process's backend setup would try the TPU first, loading
# libtpu, which prints warnings on a host without TPUs (into subprocesses' stderr) and takes
# a host-wide lock file that the other test workers' topology descriptions then trip on.
# Compiling for a TPU topology needs neither (t5lite/runtime/topologies.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
# The suite compiles thousands of small programs and runs each for a few steps: XLA:CPU's
# compile is about 70% of the suite's time, and LLVM's optimization of the generated code
# buys nothing here (tests/test_train_step.py from a cold cache: 57 s at XLA's default level 2,
# 43 s at 1, on the 2-core Zen 4 EPYC). The programs are the same; only their machine code is
# less optimized, and every bitwise comparison compares runs made under the same level. Level
# 0 is not used: it compiled 20% faster again, but the 8-device train step of
# test_learning.py then deadlocked in a collective permute (7 of 8 devices arrived). Nor is
# --xla_cpu_use_fusion_emitters=false (XLA's older loop emitters instead of its MLIR fusion
# compiler): test_train_step + test_decoding + test_moe took 131 s instead of 165 s from a
# cold cache, but the same 8-device step of test_learning.py aborted the process.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=1"
# LLVM's expensive passes (vectorizers, aggressive unrolling) likewise buy these tiny programs
# nothing: from a cold cache on the same EPYC, test_models + test_peft_mixed +
# test_distillation took 291 s instead of 320 s, test_train_step 46 s instead of 56 s, and
# the step-heavy test_learning + test_optimizers the same 56 s either way. No fast-math is
# turned on: a 3+2-layer T5's logits and gradients came out bitwise the same with and without.
if "xla_llvm_disable_expensive_passes" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_llvm_disable_expensive_passes=true"

import pytest  # noqa: E402

from helpers import TINY, jitted_apply, tiny  # noqa: E402,F401 (re-exported)
from helpers import durations  # noqa: E402

pytest_plugins = ["helpers.fixtures", "helpers.durations", "helpers.scheduling",
                  "helpers.storage_servers"]
_START = time.time()


TIERS = ("unit", "parity", "e2e")


def pytest_configure(config):
  _check_loadgroup_groups(config)
  config.addinivalue_line(
      "markers", "unit: the default tier: in-process, no torch/transformers/peft; "
      "`make test-fast` runs those not also marked slow")
  config.addinivalue_line(
      "markers", "parity: compares with torch / transformers / peft (`make test-parity`)")
  config.addinivalue_line(
      "markers", "e2e: end to end: CLI subprocesses, multi-host jobs, interrupted runs, long "
      "training, benchmarks, packaging (`make test-e2e`)")
  config.addinivalue_line(
      "markers", "slow: expensive (every e2e test, and the large variants of unit and parity "
      "tests); `make test-fast` deselects them")


def _check_loadgroup_groups(config):
  """pytest 9.2's structured node ids silently turn off pytest-xdist's --dist loadgroup up to
  xdist 3.8 (pytest-xdist issue 1386: it marks a group by appending @GROUP to a node id,
  which pytest 9.2 no longer reads): every worker would build every grouped module's
  fixtures. The run stops instead; the test extra pins a pytest that groups."""
  if config.getoption("dist", None) != "loadgroup" or pytest.version_tuple[:2] < (9, 2):
    return
  import xdist  # there: --dist is its option
  if tuple(int(p) for p in xdist.__version__.split(".")[:2]) <= (3, 8):
    raise pytest.UsageError(
        f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} does not keep "
        "an xdist_group on one worker: install the test extra's pytest (pip install -e "
        "'.[test]', pytest<9.2)")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the default tier must be there by then
def pytest_collection_modifyitems(config, items):
  """Every test gets exactly one tier: its own marker (the test's, its class's or its
  module's pytestmark), else `unit`. Two tiers on one test is a collection error."""
  wrong = []
  for item in items:
    tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
    if not tiers:
      item.add_marker(pytest.mark.unit)
    elif len(tiers) > 1:
      wrong.append(f"{item.nodeid}: {sorted(tiers)}")
  if wrong:
    raise pytest.UsageError("tests with more than one tier (unit, parity, e2e):\n"
                            + "\n".join(wrong))
  durations.mark_measured_slow(items)  # before -m deselects, as the tiers


@pytest.fixture
def tmp_dir(tmp_path):
  return str(tmp_path)


def pytest_terminal_summary(terminalreporter):
  terminalreporter.write_line(f"t5lite test suite duration: {time.time() - _START:.1f}s")
