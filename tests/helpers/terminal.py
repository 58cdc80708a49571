"""stderr on a real pseudo-terminal, for tests of what a user at a terminal sees (progress bars).

    with on_terminal(monkeypatch) as screen:
      cli.main([...])
    assert "100%|" in screen()

sys.stderr becomes the pty's terminal end (isatty() is True, as in a shell); a thread reads the
other end, so a long output never fills the pty's buffer; screen() returns what was written.
"""
from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import struct
import sys
import termios
import threading


@contextlib.contextmanager
def on_terminal(monkeypatch):
  leader, follower = pty.openpty()
  # A fresh pty is 0 columns wide, which leaves a bar no room: a shell window's 120 x 40.
  fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
  chunks: list[bytes] = []

  def drain() -> None:
    while True:
      try:
        data = os.read(leader, 4096)
      except OSError:  # the terminal end closed
        return
      if not data:
        return
      chunks.append(data)

  reader = threading.Thread(target=drain, daemon=True)
  reader.start()
  stream = io.TextIOWrapper(os.fdopen(follower, "wb", buffering=0), encoding="utf-8",
                            write_through=True)
  previous = sys.stderr
  monkeypatch.setattr(sys, "stderr", stream)
  try:
    yield lambda: b"".join(chunks).decode("utf-8", "replace")
  finally:
    monkeypatch.setattr(sys, "stderr", previous)
    stream.close()
    reader.join(timeout=5)
    os.close(leader)


def redrawn(shown: str) -> bool:
  """Whether the output redraws a line in place (a bar): more carriage returns than new
  lines (the terminal writes each new line as \\r\\n)."""
  return shown.count("\r") > shown.count("\n")
