"""Which JAX platforms the `t5lite` command starts: on a host with neither TPU chips nor GPUs,
the CPU alone.

Why. The `tpu` extra installs libtpu, which `t5lite compile` uses to compile for TPU
topologies on any host. Once installed, JAX tries the TPU first whenever it makes its
backends, and on a host without TPU chips libtpu prints a dozen lines of initialization
errors (hostnames, accelerator type, metadata server) before every command's own output.
Leaving the TPU platform out where there is no TPU keeps the output to t5lite's own lines;
compiling for a TPU topology does not need the platform (t5lite/runtime/topologies.py).

How. A TPU chip is a PCI device of Google's vendor id (what JAX's own hardware check reads;
written here because that check is private to JAX); a GPU is one of the device files of
NVIDIA's, AMD's or WSL's drivers. Only where JAX_PLATFORMS is unset and neither is found does
the process start the CPU alone (JAX's config, not the environment, which jobs submitted from
this host inherit); a user's JAX_PLATFORMS always wins. On a GPU host that has libtpu
installed JAX still tries the TPU first (set JAX_PLATFORMS=cuda to quiet it).
"""
from __future__ import annotations

import glob
import os

GOOGLE_PCI_VENDOR = "0x1ae0"
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def has_tpu_chips(pci_devices: str = "/sys/bus/pci/devices") -> bool:
  for vendor in glob.glob(os.path.join(pci_devices, "*", "vendor")):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip() == GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


def has_gpus() -> bool:
  return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def choose() -> str | None:
  """The platforms to start: "cpu" on a host with no TPU chips and no GPUs when JAX_PLATFORMS
  is unset, else None (JAX's own choice)."""
  if os.environ.get("JAX_PLATFORMS") or has_tpu_chips() or has_gpus():
    return None
  return "cpu"


def apply() -> str | None:
  """Starts only choose()'s platforms in this process (call before JAX makes its backends);
  returns them. The environment is left as it is: a job submitted from here (`t5lite launch`
  with sbatch, which passes the environment on) chooses again on its own hosts."""
  chosen = choose()
  if chosen is not None:
    import jax
    jax.config.update("jax_platforms", chosen)
  return chosen
