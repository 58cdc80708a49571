"""How the `t5lite` command sets up a process that computes on the CPU: synchronous dispatch
and a heap that keeps freed memory, so a train step stops paying the kernel for fresh pages.

Why. XLA:CPU allocates each execution's temporary buffer anew (1.6 GB for `t5lite bench
train`'s T5 step) and frees it after. With JAX's default asynchronous CPU dispatch the step
runs on a worker thread, whose glibc malloc arena cannot grow past 64 MiB, so the buffer is
mmap'ed and munmap'ed every step and the kernel zero-fills about 400,000 fresh pages each
time: a third of the step's wall time on a 2-core AMD EPYC (1.16 -> 0.82 s, docs/cpu.md).
Running the step on the calling thread (`jax_cpu_enable_async_dispatch=False`) puts the
allocation in the main arena, and two mallopt settings keep it there between steps:

  M_MMAP_MAX = 0            large blocks come from the heap, not from mmap
  M_TRIM_THRESHOLD = 2 GiB  the heap's free top is not handed back to the kernel

Nothing a step computes changes (same program, same numbers); the process's resident memory
stays at its peak instead of falling between steps (the step's peak RSS was the same in
`bench train`: 1.60 GB either way). Only the CPU backend is tuned: on a GPU or TPU host the
heap is left as it is (and a multi-process job keeps JAX's defaults); the CPU-dispatch setting only affects programs run on the CPU.

Who. The `t5lite` command owns its process and calls `tune()` before JAX makes its backends
(after jax.distributed.initialize where the job has several processes). A program that
imports t5lite as a library decides for itself: call `tune()` before its first JAX
computation. Overrides: T5LITE_CPU_TUNING=0 leaves the process as it is; an explicit
JAX_CPU_ENABLE_ASYNC_DISPATCH in the environment wins over the dispatch setting; with no
glibc (macOS, musl) the heap part is skipped.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

ENV = "T5LITE_CPU_TUNING"
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's <malloc.h> parameter numbers
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: the largest it can say

_applied: dict | None = None


def tune() -> dict:
  """Applies the settings above (once per process); returns what is in force, for logs and
  benchmark reports: {"enabled", "async_dispatch", "malloc"}."""
  global _applied
  if _applied is not None:
    return _applied
  import jax
  from jax._src import xla_bridge
  if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
    _applied = {**in_force(), "why_not": f"{ENV}={os.environ[ENV]}"}
    return _applied
  from jax._src import distributed
  if getattr(distributed.global_state, "client", None) is not None:
    # A multi-process job: making the backends here, before the run reports a bad setup,
    # lets a process that exits first take the coordination service down under the others
    # (JAX aborts them); such jobs keep JAX's defaults.
    _applied = {**in_force(), "why_not": "a multi-process job (jax.distributed)"}
    return _applied
  made = getattr(xla_bridge, "backends_are_initialized", None)  # private: may move
  if made is not None and made():  # too late to choose the dispatch: change nothing
    _applied = {**in_force(), "why_not": "JAX had made its backends before tune()"}
    return _applied
  if "JAX_CPU_ENABLE_ASYNC_DISPATCH" not in os.environ:
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # read when the CPU client is made
  malloc = "default"
  if jax.default_backend() == "cpu":
    malloc = _keep_freed_heap()
  _applied = {"enabled": True, "async_dispatch": jax.config.read("jax_cpu_enable_async_dispatch"),
              "malloc": malloc}
  return _applied


def _keep_freed_heap() -> str:
  """mallopt(M_MMAP_MAX, 0) and a 2 GiB trim threshold; what was set, or why nothing was."""
  if platform.libc_ver()[0] != "glibc":
    return "default (not glibc)"
  libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
    return "default (mallopt refused)"
  return f"glibc M_MMAP_MAX=0 M_TRIM_THRESHOLD={TRIM_THRESHOLD_BYTES}"


def in_force() -> dict:
  """What `tune()` set in this process, or the defaults where it has not run."""
  if _applied is not None:
    return _applied
  import jax
  return {"enabled": False, "async_dispatch": bool(jax.config.read("jax_cpu_enable_async_dispatch")),
          "malloc": "default"}
