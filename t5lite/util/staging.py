"""Folders that come from or go to a bucket, staged on the local disk: for the verbs whose
writers and readers are folder-based libraries (safetensors, transformers' tokenizer files,
jax.export), which take local paths only.

    with staging.download(source) as local:   # a URL: its objects fetched into a temp folder
      read(local)                              # a local path: itself, nothing copied
    with staging.upload(out) as local:        # a URL: a temp folder, uploaded when the block
      write(local)                             # ends without an error; a local path: itself

`local_copy(url)` is for readers that take local files only and read them in place (array_record's
C++ reader, TFDS's array_record data sources): the object is copied, streamed, into a cache
folder on the local disk once per version of it (its GCS generation or S3 ETag), and reused.

`built(url, build)` is a first-use build (a dataset, a vocabulary, a task cache) kept in a bucket:
built once by whichever host gets there first, then mirrored to each host's local disk.

An upload writes every file as one object, and orbax's commit markers (`commit_success.txt`)
last, a step's own marker last of all, so a copy cut short leaves no checkpoint step that
looks committed; the other files of an export are readable as soon as they land, as with
`gsutil cp -r`. Temporary folders are removed either way, and a SIGKILLed process's by the next
one made (t5lite.util.owned_tmp).
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
from typing import Callable, Iterator

from t5lite.errors import ConfigError
from t5lite.util import atomic, paths, storage
from t5lite.util.owned_tmp import OwnedFolder
from t5lite.util.storage import COMMIT_MARKER


@contextlib.contextmanager
def download(source: str, keep: Callable[[list[str]], list[str]] | None = None,
             keep_name: bool = False) -> Iterator[str]:
  """A local folder holding `source`'s files (see the module docstring). keep: picks the
  relative names worth fetching out of all of them (e.g. one checkpoint step of many).
  keep_name: the local folder has the URL's last name (readers that parse it, as
  checkpoint_N)."""
  if not paths.is_url(source):
    yield source
    return
  names = paths.files_under(source)
  if not names:
    raise FileNotFoundError(f"{source}: no objects under this URL")
  if keep is not None:
    names = keep(names)
  folder = OwnedFolder("t5lite-download-")  # a SIGKILLed reader's: removed by the next one
  try:
    local = folder.subfolder(paths.basename(source.rstrip("/")) if keep_name else "files")
    fetch_tree(source, names, local)
    yield local
  finally:
    folder.close()


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
  folder = OwnedFolder("t5lite-upload-")
  local = folder.subfolder("files")
  try:
    yield local
    put_tree(local, destination)
  finally:
    folder.close()


def fetch_tree(source: str, names: list[str], local: str) -> None:
  """Streams the objects `names` (relative to the URL `source`) into the folder `local`."""
  for rel in names:
    target = os.path.join(local, *_parts(rel, source))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with paths.open_binary(paths.join(source, rel)) as f, open(target, "wb") as out:
      shutil.copyfileobj(f, out, 8 << 20)


def put_tree(local: str, destination: str, uploaded: list[str] | None = None) -> None:
  """Every file under the folder `local` as one object under `destination`, commit markers
  last, the top folder's own last of all (it commits the whole: orbax's step marker); each
  object's URL is appended to `uploaded` as soon as it is written."""
  files = paths.files_under(local)
  for rel in sorted(files, key=lambda rel: (rel.rsplit("/", 1)[-1] == COMMIT_MARKER,
                                             rel == COMMIT_MARKER, rel)):
    url = paths.join(destination, rel)
    if uploaded is not None:
      uploaded.append(url)
    # Streamed (a checkpoint's data files reach gigabytes); the object appears at close.
    with open(os.path.join(local, rel), "rb") as f, paths.open_binary(url, "wb") as out:
      shutil.copyfileobj(f, out, 8 << 20)


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


CACHE_ENV = "T5LITE_OBJECT_CACHE"


def object_cache() -> str:
  """$T5LITE_OBJECT_CACHE, else ~/.cache/t5lite/objects."""
  return os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/t5lite/objects")


def cache_path(url: str) -> str:
  """Where local_copy puts the object at `url` (or the folder of a prefix): object_cache()/
  SCHEME/BUCKET/KEY."""
  scheme, bucket, key = storage.split(url.rstrip("/"))
  return os.path.join(object_cache(), scheme, bucket, *(_parts(key, url) if key else []))


def _parts(name: str, url: str) -> list[str]:
  """The folders and file of an object name, refused where one is empty, '.' or '..': a bucket
  allows such names, and joined to a local folder they would land outside it."""
  parts = name.split("/")
  if any(part in ("", ".", "..") for part in parts):
    raise ConfigError(f"{url}: the object name {name!r} has an empty, '.' or '..' part and "
                      "cannot be copied to local disk; rename the object")
  return parts


def local_copy(url: str) -> str:
  """A local path holding the bytes of the object at `url` (a local path is itself): under
  object_cache(), at the URL's own bucket and path, fetched again only when the object's
  version is not the one fetched last. Each copy lands whole (written aside, then renamed),
  so processes sharing the cache never read half a file."""
  if not paths.is_url(url):
    return url
  local = cache_path(url)
  stamp = local + ".version"
  version = paths.version(url)
  if os.path.isfile(local) and os.path.isfile(stamp) and (
      pathlib.Path(stamp).read_text() == version):
    return local
  os.makedirs(os.path.dirname(local), exist_ok=True)
  with atomic.writing(local) as tmp, paths.open_binary(url) as source, open(tmp, "wb") as f:
    shutil.copyfileobj(source, f, 8 << 20)
  atomic.write_file(stamp, version)
  return local


BUILT_MARKER = "BUILT"


def built(url: str, build: Callable[[str], None], what: str = "a first-use build") -> str:
  """A local folder holding the build published at the bucket prefix `url`; when none is
  published yet, build(folder) writes one here and it is published first.

  A bucket has no folder rename to publish a build with, so the builder uploads its files
  under a prefix of its own (`url/build-RANDOM/...`) and then creates `url/BUILT`, naming that
  prefix, only if no BUILT exists (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`): of two
  hosts building at once exactly one publishes, the other deletes its upload and uses the
  winner's; a build killed before BUILT leaves only an unnamed prefix, which no reader follows
  (it may be deleted). Each host then copies the published prefix once into object_cache()
  (a folder renamed into place whole) and reads it there, as TFDS and array_record read local
  files only. A bucket that is missing or not writable is refused (ConfigError naming `what`
  and the URL) before anything is built.
  """
  marker = paths.join(url, BUILT_MARKER)
  try:
    published = storage.read_versioned(marker)
  except ConfigError as e:  # e.g. S3: no such bucket
    raise ConfigError(f"{what} {url}: {e}") from None
  if published is None:
    storage.check_writable(url, what)
    _build_and_publish(url, marker, build)
    published = storage.read_versioned(marker)
    if published is None:
      raise FileNotFoundError(f"{marker}: published, then gone (deleted by someone else?)")
  prefix = published[0].decode("utf-8").strip()
  source = paths.join(url, *_parts(prefix, marker))
  return atomic.build_dir(cache_path(source),
                          lambda local: fetch_tree(source, paths.files_under(source), local),
                          os.path.isdir)


def _build_and_publish(url: str, marker: str, build: Callable[[str], None]) -> None:
  folder = OwnedFolder("t5lite-build-")
  local = folder.subfolder("files")
  prefix = f"build-{secrets.token_hex(8)}"
  uploaded, won = [], False
  try:
    build(local)
    put_tree(local, paths.join(url, prefix), uploaded)
    won = storage.create_exclusive(marker, prefix.encode("utf-8")) is not None
  finally:
    folder.close()
    if not won:  # another host published first (or this build failed): its upload is unused
      for object_url in uploaded:
        paths.remove(object_url)
