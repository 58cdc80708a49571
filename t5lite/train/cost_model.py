"""Peak device throughput and MFU; the FLOPs of an example come from its model family.

Each family counts its own training FLOPs (t5lite.families: Family.flops_per_example, the usual
"6 * params * tokens + attention" estimate over matmuls); this module knows the devices.
"""
from __future__ import annotations

import re


# Dense bf16 peak FLOP/s per chip (vendor figures; a large matmul reaches ~80% on H100).
PEAK_FLOPS: dict[str, float] = {
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "tpu v4": 275e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v6e": 918e12,
}

# jax device_kind strings vary ('NVIDIA H100 80GB HBM3', 'TPU v5 lite', 'TPU v5'), so each
# table key is matched by a pattern, most specific first ('TPU v5 lite' before 'TPU v5').
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bh100\b", "h100"),
    (r"\bh200\b", "h200"),
    (r"\ba100\b", "a100"),
    (r"\bv4\b", "tpu v4"),
    (r"\bv5\s*(e|lite(pod)?)\b", "tpu v5e"),
    (r"\bv5\s*p\b|\bv5$", "tpu v5p"),
    (r"\bv6\s*(e|lite)\b", "tpu v6e"),
)


def peak_flops(device_kind: str) -> float | None:
  """Peak bf16 FLOP/s of one device from its jax `device_kind`, or None when unknown (CPU,
  unlisted GPUs), in which case MFU is not reported."""
  kind = device_kind.strip().lower()
  for pattern, key in _DEVICE_PATTERNS:
    if re.search(pattern, kind):
      return PEAK_FLOPS[key]
  return None


def mfu(flops_per_step: float, step_seconds: float, peak_total: float) -> float:
  """Model FLOPs utilization: achieved FLOP/s over the peak of all devices together (a
  fraction, 0.41 = 41%)."""
  if step_seconds <= 0 or peak_total <= 0:
    raise ValueError(f"step_seconds and peak_total must be positive, got {step_seconds}, "
                     f"{peak_total}")
  return flops_per_step / step_seconds / peak_total
