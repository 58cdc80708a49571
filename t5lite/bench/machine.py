"""What the machine is doing around a benchmark: memory of this process, CPU use of others.

Timings on a shared machine are only as good as its quietness, so `bench train` waits for a
quiet machine (optionally) and reports how much CPU other processes took while it timed.
Linux /proc is read where present; elsewhere the figures are None (or the RSS high-water mark).
"""
from __future__ import annotations

import gc
import os
import resource
import threading
import time
from typing import Any, Callable


def rss_bytes() -> int:
  """Resident set size of this process now (the high-water mark where /proc is absent)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return max_rss_bytes()


def max_rss_bytes() -> int:
  """This process's RSS high-water mark (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_above(fn: Callable[[], Any], interval: float = 0.002) -> int:
  """Peak RSS while fn() runs, above the RSS just before it (a sampling thread).

  Freed heap is first handed back to the OS (glibc malloc_trim) where possible, so memory the
  other side freed earlier is not reused unseen and the figure is this call's own transient.
  """
  gc.collect()
  try:
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass
  before = peak = rss_bytes()
  done = threading.Event()

  def sample():
    nonlocal peak
    while not done.is_set():
      peak = max(peak, rss_bytes())
      done.wait(interval)
  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  try:
    fn()
  finally:
    done.set()
    thread.join()
  return max(peak, rss_bytes()) - before


def cpu_busy_seconds() -> float | None:
  """CPU seconds all processes have used since boot, summed over cores (None without /proc)."""
  try:
    with open("/proc/stat") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return None
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
  return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user .. steal


class OthersCpu:
  """CPU used by other processes between start() and stop(), as a fraction of all cores.

  0.0 = the machine was ours; 0.5 on 2 cores = another process held one core throughout.
  """

  def start(self) -> "OthersCpu":
    self.busy, self.ours, self.wall = cpu_busy_seconds(), time.process_time(), time.perf_counter()
    return self

  def stop(self) -> float | None:
    busy = cpu_busy_seconds()
    if busy is None or self.busy is None:
      return None
    others = (busy - self.busy) - (time.process_time() - self.ours)
    return max(0.0, others) / ((time.perf_counter() - self.wall) * (os.cpu_count() or 1))


def wait_for_quiet(max_seconds: float, threshold: float = 0.1, window: float = 2.0,
                   log: Callable[[str], Any] = print) -> float | None:
  """Waits (up to max_seconds) until other processes use < threshold of the CPUs over a
  `window`; returns the last fraction seen (None without /proc)."""
  deadline = time.monotonic() + max_seconds
  while True:
    probe = OthersCpu().start()
    time.sleep(window)
    fraction = probe.stop()
    if fraction is None or fraction < threshold or time.monotonic() >= deadline:
      return fraction
    log(f"bench: other processes use {100 * fraction:.0f}% of the CPUs; waiting for quiet")


def matmul_flops_per_s(m: int, k: int, n: int, dtype: str = "float32",
                       seconds: float = 2.0) -> float:
  """FLOP/s of XLA's (m, k) @ (k, n) in `dtype` on the default device: the median of timed
  calls over about `seconds`, after a warm-up, on random operands. A benchmark calls it with
  its model's own largest matmul shape: the rate this machine reaches on the work the step is
  made of, its practical peak. A CPU's datasheet peak assumes every core at its top vector
  clock, which few reach for long, and its vendor and model alone do not give it."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(0)
  a = jax.device_put(jnp.asarray(rng.standard_normal((m, k), np.float32), dtype))
  b = jax.device_put(jnp.asarray(rng.standard_normal((k, n), np.float32), dtype))
  product = jax.jit(jnp.dot)
  product(a, b).block_until_ready()
  times: list[float] = []
  deadline = time.perf_counter() + seconds
  while len(times) < 5 or time.perf_counter() < deadline:
    start = time.perf_counter()
    product(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  times.sort()
  return 2.0 * m * k * n / times[len(times) // 2]


def cpu_info() -> dict:
  """The CPU as /proc/cpuinfo tells it (first processor): vendor, model name, family and model
  numbers, and whether it has AVX-512 (avx512f) and AVX2. Empty where /proc is absent."""
  fields: dict[str, str] = {}
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if not line.strip():
          break  # the first processor's block is enough: they are all alike here
        key, _, value = line.partition(":")
        fields[key.strip().lower()] = value.strip()
  except OSError:
    return {}
  flags = set(fields.get("flags", "").split())
  number = lambda key: int(fields[key]) if fields.get(key, "").isdigit() else None  # noqa: E731
  return {"vendor": fields.get("vendor_id"), "model_name": fields.get("model name"),
          "family": number("cpu family"), "model": number("model"),
          "avx512": "avx512f" in flags, "avx2": "avx2" in flags}


def cpu_model() -> str | None:
  """The CPU's model name (/proc/cpuinfo's `model name`, as lscpu shows it), None if unknown."""
  return cpu_info().get("model_name")


def _version(package: str) -> str | None:
  from importlib import metadata
  try:
    return metadata.version(package)
  except metadata.PackageNotFoundError:
    return None


def describe() -> dict:
  """The machine and software a benchmark ran on, for its JSON line: the CPU (cpu_info), its
  cores, JAX's backend and device kind, the jax / jaxlib / torch / transformers versions,
  XLA_FLAGS and the CPU process settings in force (t5lite.runtime.cpu_host). jax is imported
  here: call it from a benchmark that uses it anyway."""
  import sys
  import jax
  from t5lite.runtime import cpu_host
  info = {"cpu": cpu_info(), "cores": os.cpu_count(), "backend": jax.default_backend(),
          "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
          "python": sys.version.split()[0]}
  info.update({name: _version(name) for name in ("jax", "jaxlib", "torch", "transformers")})
  info["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  info["cpu_tuning"] = cpu_host.in_force()
  return info
