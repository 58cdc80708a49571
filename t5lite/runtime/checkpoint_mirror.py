"""Checkpoints in an s3:// MODEL_DIR, through a folder on the local disk.

orbax, which writes and reads t5lite's checkpoints, reaches arrays through TensorStore specs
it builds for local paths and gs:// only (it has no S3 form: orbax issue 359), so on s3://
the Checkpointer gives orbax a local folder that mirrors MODEL_DIR/checkpoints, with the
bucket's guarantees kept by the order of the copies:

- **start** (`pull`): a step in the bucket is committed when its root commit marker
  (`commit_success.txt`) is there; every other object under `checkpoints/` that is not a
  step moved aside (`<step>.corrupt-N/`) is what a killed upload left, and is deleted. Each
  committed step gets a local folder with its small files (metadata, metrics, checksums) so
  that orbax lists and ranks it; its array data is fetched when the step is read (`fetch`).
- **after a save** (`publish`, once orbax has committed the step locally and t5lite has sealed
  it): every file is uploaded, the commit markers last, so a copy cut short leaves a step the
  next start does not list, and its array data leaves the local disk (what stays there is
  the step being written and any step read); then the steps orbax's retention deleted here
  are deleted there, the root marker first.
- **a damaged step** is copied aside in the bucket (`integrity.move_aside`: no rename there).

The local folder is this process's own (a fresh temporary folder, removed at close; a killed
process's is removed by the next mirror made beside it: t5lite.util.owned_tmp), so a restart,
here or on another host, reads what the bucket holds, verified against the step's checksums.
One process only: each host of a multi-process job would mirror its own shards (such a job is
refused on s3:// before it starts). A step's upload runs in a thread of its own once the
step has committed (`publish_in_background`), so training goes on meanwhile; the next save
and the end of the run wait for it (`finish_publishing`), and it raises its error there.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
from typing import Iterator

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.util import atomic, paths, staging, storage
from t5lite.util.owned_tmp import OwnedFolder
from t5lite.util.staging import fetch_tree, put_tree

COMMIT_MARKER = storage.COMMIT_MARKER


def _is_array_data(rel: str) -> bool:
  """An object of a step's array data (OCDBT's `d/` files), fetched only when read."""
  return "/d/" in f"/{rel}"


def check_single_process(url: str, process_count: int) -> None:
  """ConfigError for checkpoints on s3:// in a job of several processes (module docstring)."""
  if url.startswith("s3://") and process_count > 1:
    raise ConfigError(
        f"{url}: a job of {process_count} processes cannot keep its checkpoints on s3:// "
        "(orbax writes them there through one host's local disk): use gs://, or a bucket "
        "mount that every host shares")


def committed_steps(remote: str) -> tuple[dict[int, list[str]], list[str]]:
  """({committed step: its object names} of a bucket's checkpoints/ folder, the names of its
  other top-level entries). A step is committed once its root commit marker is there."""
  by_entry: dict[str, list[str]] = {}
  for rel in paths.files_under(remote):
    entry, _, rest = rel.partition("/")
    by_entry.setdefault(entry, []).append(rest)
  committed = {int(entry): names for entry, names in by_entry.items()
               if entry.isdigit() and COMMIT_MARKER in names}
  others = [entry for entry in by_entry if not (entry.isdigit() and int(entry) in committed)]
  return committed, others


@contextlib.contextmanager
def readable_step(path: str, checkpoints_dir: str) -> Iterator[str]:
  """A local copy of a checkpoint on s3:// to read (an s3:// MODEL_DIR or its checkpoints_dir
  folder: the newest committed step; or one committed step folder), its errors naming the URL;
  any other path: itself."""
  path = os.fspath(path)
  if not path.startswith("s3://"):
    yield path
    return
  path = path.rstrip("/")
  step_url = path
  is_step = paths.basename(path).isdigit() and paths.isfile(paths.join(path, COMMIT_MARKER))
  if not is_step:
    directory = path if paths.basename(path) == checkpoints_dir else paths.join(
        path, checkpoints_dir)
    steps = committed_steps(directory)[0]
    if not steps:
      raise ConfigFileNotFoundError(f"{directory} holds no committed checkpoint")
    step_url = paths.join(directory, str(max(steps)))
  with staging.download(step_url, keep_name=True) as local:
    try:
      yield local
    except ConfigError as e:
      raise type(e)(str(e).replace(local, step_url)) from e


PREFIX = "t5lite-s3-checkpoints-"


class S3Mirror:
  """The local folder orbax writes an s3:// checkpoints/ folder through (module docstring)."""

  def __init__(self, remote: str):
    self.remote = remote.rstrip("/")
    self._folder = OwnedFolder(PREFIX)  # a SIGKILLed run's is removed by the next one
    self.local = self._folder.subfolder(paths.basename(self.remote))
    self._fetched: set[int] = set()
    self._published: set[int] = set()
    self._uploader = concurrent.futures.ThreadPoolExecutor(1, "t5lite-s3-upload")
    self._upload: concurrent.futures.Future | None = None

  def pull(self, *, write: bool) -> None:
    """Lists the bucket's committed steps here, small files only; with `write`, deletes what
    killed uploads left there (a step without its marker)."""
    committed, others = committed_steps(self.remote)
    if write:
      for entry in others:
        if entry.isdigit():  # an upload cut short; `<step>.corrupt-N` stays
          paths.remove_tree(paths.join(self.remote, entry))
    for step, names in committed.items():
      source = paths.join(self.remote, str(step))
      fetch_tree(source, [n for n in names if not _is_array_data(n)],
                 os.path.join(self.local, str(step)))
      self._published.add(step)

  def fetch(self, step: int) -> None:
    """Fetches a listed step's array data before it is read (once)."""
    if step in self._fetched or step not in self._published:
      return
    source = paths.join(self.remote, str(step))
    fetch_tree(source, [n for n in paths.files_under(source) if _is_array_data(n)],
               os.path.join(self.local, str(step)))
    self._fetched.add(step)

  def publish(self, kept: list[int]) -> None:
    """Uploads the committed local steps not in the bucket yet (markers last), then removes
    from the bucket the steps orbax's retention deleted here (root marker first)."""
    for step in kept:
      folder = os.path.join(self.local, str(step))
      if step not in self._published and os.path.isdir(folder):
        put_tree(folder, paths.join(self.remote, str(step)))
        self._published.add(step)
        for rel in paths.files_under(folder):  # the local disk holds one step's data at most
          if _is_array_data(rel):
            os.remove(os.path.join(folder, rel))
        self._fetched.discard(step)
    for step in sorted(self._published - set(kept)):
      if os.path.isdir(os.path.join(self.local, str(step))):
        continue  # orbax drops a step from its list before a save commits, deletes it after
      step_url = paths.join(self.remote, str(step))
      paths.remove(paths.join(step_url, COMMIT_MARKER))
      paths.remove_tree(step_url)
      self._published.discard(step)

  def publish_in_background(self, kept: list[int]) -> None:
    """`publish` in the upload thread; one upload at a time (the previous one is waited for
    first, and its error raised)."""
    self.finish_publishing()
    self._upload = self._uploader.submit(self.publish, list(kept))

  def finish_publishing(self) -> None:
    """Waits for the upload in flight, if any, and raises its error."""
    upload, self._upload = self._upload, None
    if upload is not None:
      upload.result()

  def raise_failed_upload(self) -> None:
    """Raises the error of an upload that has ended, without waiting for one in flight."""
    if self._upload is not None and self._upload.done():
      self.finish_publishing()

  def upload(self, step: int, rel: str) -> None:
    """One file of a published step, uploaded again (its checksums, sealed after a restore)."""
    if step in self._published:
      with open(os.path.join(self.local, str(step), rel), "rb") as f:
        atomic.write_file(paths.join(self.remote, str(step), rel), f.read())

  def drop(self, step: int) -> None:
    """Forgets a step here (the bucket's copy was moved aside)."""
    shutil.rmtree(os.path.join(self.local, str(step)), ignore_errors=True)
    self._published.discard(step)
    self._fetched.discard(step)

  def close(self) -> None:
    """Removes the local folder, once an upload in flight has ended (its error, if any, was
    the Checkpointer's to raise at its last wait: a close after another error ignores it)."""
    with contextlib.suppress(Exception):
      self.finish_publishing()
    self._uploader.shutdown()
    self._folder.close()
