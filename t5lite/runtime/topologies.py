"""TPU pod topologies a CPU host can compile for: their chips and devices, without the chips.

    chip = chip_of("v5e:16x16")           # Chip(name='v5e', hbm_bytes=16 GiB, peak_flops=197e12)
    devices = topology_devices("v5e:16x16")   # 256 compile-only TPU devices (needs libtpu)

With libtpu installed (the `tpu` extra: `pip install -e .[tpu]`, the libtpu that jax[tpu]
pins for the installed jax), jax.experimental.topologies.get_topology_desc describes a pod's
devices on any host; a Mesh over them and jax.jit(...).lower(...).compile() give the real TPU
executable (t5lite.train.aot.compiler). On a host without TPUs libtpu prints warnings about
TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES when it loads; compiling works regardless.

Names are `GENERATION:AxBxC` in chips, as Cloud TPU's topology flag writes them: `v5e:16x16`
(256 chips), `v4:4x4x8` (128 chips), `v5p:4x4x8`, `v6e:8x8`. v4 and v5p chips are driven as one
device each (megacore), as the TPU runtime does by default.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from t5lite.errors import ConfigError

GiB = 1024**3
INSTALL = ('install libtpu, the version jax[tpu] pins for the installed jax: pip install -e '
           '".[tpu]" (in a clone of t5lite), or pip install "jax[tpu]==$(python -c "import '
           'jax; print(jax.__version__)")"')


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation: what a chip holds and computes."""

  name: str
  hbm_bytes: int
  """High-bandwidth memory per chip (= per device: one device per chip)."""
  peak_flops: float
  """Dense bf16 FLOP/s per chip (Google's figures)."""
  dims: int
  """Axes of the topology name: 2 (a torus of v5e / v6e chips) or 3 (v4 / v5p)."""
  chip_config_name: str | None = None
  """libtpu's chip config: 'megacore' runs a v4 / v5p chip's two cores as one device."""


CHIPS: dict[str, Chip] = {
    "v4": Chip("v4", 32 * GiB, 275e12, 3, "megacore"),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 2),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 3, "megacore"),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 2),
}
EXAMPLES = {"v4": "v4:4x4x8", "v5e": "v5e:16x16", "v5p": "v5p:4x4x8", "v6e": "v6e:8x8"}
_NAME = re.compile(r"^(?P<chip>v\w+):(?P<shape>\d+(?:x\d+)*)$")


def _known() -> str:
  return (f"known generations: {', '.join(CHIPS)}; a name is GENERATION:AxB (v5e, v6e) or "
          f"GENERATION:AxBxC (v4, v5p) in chips, e.g. {', '.join(EXAMPLES.values())}")


def parse(name: str) -> tuple[Chip, tuple[int, ...]]:
  """(chip, shape in chips) of a topology name; ConfigError listing the known ones."""
  match = _NAME.match(name.strip().lower())
  chip = CHIPS.get(match["chip"]) if match else None
  if chip is None:
    raise ConfigError(f"unknown TPU topology {name!r}: {_known()}")
  shape = tuple(int(n) for n in match["shape"].split("x"))
  if len(shape) != chip.dims or min(shape) < 1:
    raise ConfigError(f"TPU topology {name!r}: a {chip.name} topology has {chip.dims} axes, "
                      f"e.g. {EXAMPLES[chip.name]}; {_known()}")
  return chip, shape


def chip_of(name: str) -> Chip:
  return parse(name)[0]


def chips_in(name: str, num_slices: int = 1) -> int:
  return math.prod(parse(name)[1]) * num_slices


def require_libtpu() -> None:
  """ConfigError saying how to install libtpu when it is missing."""
  try:
    import libtpu  # noqa: F401
  except ImportError as e:
    raise ConfigError(f"t5lite compile for TPUs needs libtpu, which is not installed: "
                      f"{INSTALL}; or check that the program traces for GPUs with "
                      f"--platform cuda") from e


def topology_devices(name: str, num_slices: int = 1) -> list:
  """The compile-only TPU devices of `num_slices` slices of topology `name` (needs libtpu)."""
  chip, shape = parse(name)
  if not isinstance(num_slices, int) or num_slices < 1:
    raise ConfigError(f"--num_slices must be a positive integer, got {num_slices!r}")
  require_libtpu()
  # libtpu takes a host-wide lock file when it loads (one process drives a host's chips);
  # compiling drives no chip, and another process on this host may hold it (a test worker, a
  # second compile): without this, "Internal error when accessing libtpu multi-process
  # lockfile". Read when libtpu loads, so before the first topology of this process.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  import jax
  from jax.experimental import topologies
  canonical = f"{chip.name}:{'x'.join(map(str, shape))}"
  kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
  if chip.chip_config_name:
    kwargs["chip_config_name"] = chip.chip_config_name
  try:
    devices = topologies.get_topology_desc(topology_name=canonical, platform="tpu",
                                           **kwargs).devices
  except jax.errors.JaxRuntimeError as e:
    detail = str(e).split("\n")[0]
    if not detail.startswith("INVALID_ARGUMENT: "):  # not about the name: libtpu's own words
      raise ConfigError(f"libtpu could not describe TPU topology {name!r}: {detail}") from e
    detail = detail.removeprefix("INVALID_ARGUMENT: ")  # libtpu refuses the shape: v5e:3x3
    raise ConfigError(f"libtpu has no TPU topology {name!r} ({detail}); {_known()}") from e
  expected = math.prod(shape) * num_slices
  if len(devices) != expected:  # a libtpu that counts cores, not chips: say so, do not guess
    raise ConfigError(f"TPU topology {name!r} x {num_slices} slice(s) gave {len(devices)} "
                      f"devices for {expected} chips")
  return list(devices)
