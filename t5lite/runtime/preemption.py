"""SIGTERM as a flag, from the first moment of `t5lite train` to its last step.

    with preemption.SIGTERM:          # the CLI, before jax.distributed.initialize
      ...                             # startup: JAX, the mesh, init or restore, compiling
      with preemption.SIGTERM:        # the trainer takes over the same flag
        ... preemption.SIGTERM.requested ...

The handler only sets `requested`; the trainer decides what follows (the processes agree,
save and exit 42: t5lite/train/trainer.py). Without it, a SIGTERM during startup (minutes on
a pod) would end the process with the default action: exit 143, which no recipe requeues.

Entered any number of times, it is installed once: the outermost entry clears the flag and
installs the handler, the outermost exit puts the previous handler back. Outside the main
thread (where Python cannot install handlers) the flag just stays unset.
"""
from __future__ import annotations

import signal
import threading


class SigtermFlag:
  """`requested` turns True on SIGTERM while entered (see the module docstring)."""

  def __init__(self):
    self.requested = False
    self._depth = 0
    self._previous = None

  def __enter__(self) -> "SigtermFlag":
    if self._depth == 0:
      self.requested = False  # a new run: an earlier run's signal was acted on
      if threading.current_thread() is threading.main_thread():
        self._previous = signal.signal(signal.SIGTERM, self._handle)
    self._depth += 1
    return self

  def _handle(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc) -> None:
    self._depth -= 1
    if self._depth == 0 and self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


SIGTERM = SigtermFlag()
"""The process's one flag: the CLI and the trainer enter the same object."""
