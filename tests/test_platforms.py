"""On a host with neither TPU chips nor GPUs the `t5lite` command starts JAX's CPU platform
alone, so an installed libtpu (the tpu extra) prints nothing; a user's JAX_PLATFORMS wins."""
from __future__ import annotations

import pytest

from helpers.cli import run_t5lite
from t5lite.runtime import platforms


def test_tpu_chips_are_pci_devices_of_googles_vendor_id(tmp_path):
  for name, vendor in (("0000:00:04.0", "0x8086"), ("0000:00:05.0", "0x10de")):
    (tmp_path / name).mkdir()
    (tmp_path / name / "vendor").write_text(vendor + "\n")
  assert not platforms.has_tpu_chips(str(tmp_path))
  (tmp_path / "0000:00:06.0").mkdir()
  (tmp_path / "0000:00:06.0" / "vendor").write_text("0x1ae0\n")
  assert platforms.has_tpu_chips(str(tmp_path))


@pytest.mark.parametrize("env, tpu, gpu, chosen", [
    ("", False, False, "cpu"), ("", True, False, None), ("", False, True, None),
    ("cuda", False, False, None)])
def test_the_cpu_alone_only_where_there_is_nothing_else_and_nothing_was_set(
    monkeypatch, env, tpu, gpu, chosen):
  monkeypatch.setenv("JAX_PLATFORMS", env)
  monkeypatch.setattr(platforms, "has_tpu_chips", lambda: tpu)
  monkeypatch.setattr(platforms, "has_gpus", lambda: gpu)
  assert platforms.choose() == chosen


@pytest.mark.skipif(platforms.has_tpu_chips() or platforms.has_gpus(),
                    reason="a host with TPU chips or GPUs keeps JAX's platforms")
def test_a_process_that_applied_it_makes_its_backends_without_a_word_and_keeps_its_env():
  """The environment stays as it was: a job submitted from this host (sbatch passes the
  environment on) chooses on its own hosts."""
  code = ("import os, jax\nfrom t5lite.runtime import platforms\nplatforms.apply()\n"
          "print(jax.default_backend(), repr(os.environ['JAX_PLATFORMS']))")
  # JAX_PLATFORMS empty: unset for JAX (every platform), as on a user's host.
  done = run_t5lite(python=code, env={"JAX_PLATFORMS": ""}, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == ["cpu", "''"] and done.stderr == ""
