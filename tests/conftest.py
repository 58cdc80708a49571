"""Shared test setup: compilation cache, 8 fake CPU devices, tiny configs, a suite timer.

Environment variables are set before JAX is imported so that test subprocesses inherit them.
"""
import functools
import os
import pathlib
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# The embedded corpus and its vocabulary are built once here and reused by later runs.
os.environ.setdefault("T5LITE_DATA_DIR", str(REPO / ".t5lite_data"))
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from t5lite.models import ModelConfig, make_model  # noqa: E402

_START = time.time()

TINY = dict(vocab_size=128, d_model=32, d_ff=64, num_heads=4, d_kv=8, num_encoder_layers=2,
            num_decoder_layers=2)


def tiny(**changes) -> ModelConfig:
  """A tiny config (vocab 128, width 32, 2 + 2 layers) with changes."""
  return ModelConfig(**{**TINY, **changes})


@functools.lru_cache(maxsize=None)
def jitted_apply(config: ModelConfig, enable_dropout: bool = False):
  """A cached jitted model.apply(params, **inputs) for a config."""
  model = make_model(config, enable_dropout=enable_dropout)

  @jax.jit
  def apply(params, inputs, rng=None):
    rngs = {"dropout": rng} if rng is not None else None
    return model.apply({"params": params}, **inputs, rngs=rngs)
  return apply


@pytest.fixture
def tmp_dir(tmp_path):
  return str(tmp_path)


def pytest_terminal_summary(terminalreporter):
  terminalreporter.write_line(f"t5lite test suite duration: {time.time() - _START:.1f}s")
