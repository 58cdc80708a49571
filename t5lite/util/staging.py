"""Folders that come from or go to a bucket, staged on the local disk: for the verbs whose
writers and readers are folder-based libraries (safetensors, transformers' tokenizer files,
jax.export), which take local paths only.

    with staging.download(source) as local:   # a URL: its objects fetched into a temp folder
      read(local)                              # a local path: itself, nothing copied
    with staging.upload(out) as local:        # a URL: a temp folder, uploaded when the block
      write(local)                             # ends without an error; a local path: itself

An upload writes every file as one object, and orbax's commit markers (`commit_success.txt`)
last, so a copy cut short leaves no checkpoint step that looks committed; the other files of
an export are readable as soon as they land, as with `gsutil cp -r`. Temporary folders are
removed either way.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from typing import Iterator

from t5lite.util import atomic, paths
from t5lite.util.storage import COMMIT_MARKER


@contextlib.contextmanager
def download(source: str) -> Iterator[str]:
  """A local folder holding `source`'s files (see the module docstring)."""
  if not paths.is_url(source):
    yield source
    return
  names = paths.files_under(source)
  if not names:
    raise FileNotFoundError(f"{source}: no objects under this URL")
  local = tempfile.mkdtemp(prefix="t5lite-download-")
  try:
    for rel in names:
      target = os.path.join(local, *rel.split("/"))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      pathlib.Path(target).write_bytes(paths.read_bytes(paths.join(source, rel)))
    yield local
  finally:
    shutil.rmtree(local, ignore_errors=True)


def check_empty(destination: str) -> None:
  """FileExistsError unless `destination` holds no file (a missing folder or prefix is
  empty): an export or import never writes over what is there."""
  if paths.is_url(destination):
    empty = not paths.files_under(destination)
  else:
    empty = not (os.path.isdir(destination) and os.listdir(destination))
  if not empty:
    raise FileExistsError(f"--out {destination} is not empty; choose a new "
                          f"{'prefix' if paths.is_url(destination) else 'folder'} (nothing was "
                          "written)")


@contextlib.contextmanager
def upload(destination: str) -> Iterator[str]:
  """A local folder whose files go to `destination` when the block succeeds."""
  if not paths.is_url(destination):
    yield destination
    return
  local = tempfile.mkdtemp(prefix="t5lite-upload-")
  try:
    yield local
    files = sorted(p.relative_to(local).as_posix() for p in pathlib.Path(local).rglob("*")
                   if p.is_file())
    for rel in sorted(files, key=lambda rel: (rel.rsplit("/", 1)[-1] == COMMIT_MARKER, rel)):
      atomic.write_file(paths.join(destination, rel), pathlib.Path(local, rel).read_bytes())
  finally:
    shutil.rmtree(local, ignore_errors=True)


def renamed(report, local: str, destination: str):
  """A JSON-able report with the staging folder's path put back as `destination`."""
  if local == destination:
    return report
  if isinstance(report, dict):
    return {k: renamed(v, local, destination) for k, v in report.items()}
  if isinstance(report, list):
    return [renamed(v, local, destination) for v in report]
  if isinstance(report, str) and report.startswith(local):
    return paths.join(destination, report[len(local):].lstrip(os.sep)) if report != local else (
        destination)
  return report
