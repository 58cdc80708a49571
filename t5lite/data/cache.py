"""Task caching: run the preprocessors before CACHE_POINT once, into array_record shards.

Layout: CACHE_DIR/<task>/<split>/shard-WWWWW-of-NNNNN.array_record, each with a
.json beside it (written last, so a shard without one is unfinished and never read); both
are written under temporary names and renamed into place (t5lite.util.atomic). CACHE_DIR may be
a bucket (gs://, s3://): a shard is written on local disk, then uploaded as one object, its
.json after it (one object upload is atomic by itself); readers copy each shard to the local
object cache once (t5lite.util.staging.local_copy), as array_record reads local files only.
Examples are msgpack (flax.serialization): numpy arrays, strings and numbers, no pickle.
Worker w of N caches source indices w, w+N, ... of a random-access source, or shards w,
w+N, ... of a streamed one; N workers can be N hosts, or processes of one (cache_in_parallel).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from typing import Any, Callable

import grain
from array_record.python import array_record_data_source, array_record_module
from flax import serialization

from t5lite.util import atomic, paths, staging, storage
from t5lite.data.preprocessors import apply_preprocessors, derive_seed
from t5lite.data.registry import Task
from t5lite.data.stream_rows import StreamRow
from t5lite.errors import ConfigError, ConfigFileNotFoundError

CACHE_ENV = "T5LITE_CACHE_DIR"


def cache_root(cache_dir: str | None = None) -> str:
  """cache_dir, else $T5LITE_CACHE_DIR, else ~/.cache/t5lite/tasks."""
  return cache_dir or os.environ.get(CACHE_ENV) or os.path.expanduser("~/.cache/t5lite/tasks")


def task_cache_dir(task: Task, split: str, cache_dir: str | None = None) -> str:
  return paths.join(cache_root(cache_dir), task.name, split)


def cache_task(task: Task, split: str, cache_dir: str | None = None, *, worker_index: int = 0,
               num_workers: int = 1, progress: Callable[[int], Any] | None = None) -> dict:
  """Writes this worker's shard; returns its info ({'examples': n, ...}). progress(n) is
  called as examples are written."""
  check_request(task, worker_index, num_workers)
  out_dir = writable_cache_dir(task, split, cache_dir)
  name = f"shard-{worker_index:05d}-of-{num_workers:05d}"
  source = task.get_source(split)
  streamed = getattr(source, "streaming", False)
  if streamed:  # worker w reads shards w, w + N, ... in file order (stream_rows.row_units)
    ds = StreamRow(source, worker_index, num_workers, seed=0, window=1, shuffle=False,
                   num_epochs=1, what=f"task {task.name!r} split {split!r} cache worker "
                   f"{worker_index}", empty_ok=True)  # a worker with no records: empty shard
    ds.outputs = 1  # dropping every example is legitimate here: the shard is then empty
  else:
    ds = grain.MapDataset.source(source).slice(slice(worker_index, None, num_workers))
    ds = ds.to_iter_dataset()
  steps = list(enumerate(task.preprocessors))[:task.cache_index]
  ds = apply_preprocessors(ds, task, steps, sequence_length=None,
                           seed=derive_seed("cache", task.name, split))
  count = 0
  with _shard_path(out_dir, name + ".array_record") as tmp:
    writer = array_record_module.ArrayRecordWriter(tmp, "group_size:1")
    for example in ds:
      writer.write(serialization.msgpack_serialize(dict(example)))
      count += 1
      if progress is not None:
        progress(1)
    writer.close()
  # A streamed source's examples are not counted up front: its cache is read shard by shard.
  info = {"task": task.name, "split": split, "examples": count, "worker_index": worker_index,
          "num_workers": num_workers, "source_examples": None if streamed else len(source)}
  atomic.write_file(paths.join(out_dir, name + ".json"), json.dumps(info))
  return info


def check_request(task: Task, worker_index: int, num_workers: int) -> None:
  """A task with a CACHE_POINT, and a worker among the workers; else one ConfigError."""
  if task.cache_index is None:
    raise ConfigError(f"task {task.name!r} has no CACHE_POINT among its preprocessors: "
                      "there is nothing to cache")
  if not 0 <= worker_index < num_workers:
    raise ConfigError(f"worker_index {worker_index} is not in [0, {num_workers})")


def writable_cache_dir(task: Task, split: str, cache_dir: str | None = None) -> str:
  """The task split's cache folder, made (or a bucket checked) writable: a bad place is
  refused in one line before the source is built or read, not after."""
  out_dir = task_cache_dir(task, split, cache_dir)
  if paths.is_url(out_dir):
    storage.check_writable(out_dir, "the task cache")
  else:
    os.makedirs(out_dir, exist_ok=True)
  return out_dir


@contextlib.contextmanager
def _shard_path(out_dir: str, name: str):
  """A local path of this process alone to write the shard at, put in place as out_dir/name
  when the block ends: renamed on a local disk, uploaded as one object to a bucket. Two
  workers given the same index (or a rerun while a killed one's file lies there) never write
  into one file."""
  if not paths.is_url(out_dir):
    atomic.remove_stale(out_dir)
    with atomic.writing(os.path.join(out_dir, name)) as tmp:
      yield tmp
    return
  local = tempfile.mkdtemp(prefix="t5lite-cache-")
  try:
    yield os.path.join(local, name)
    with open(os.path.join(local, name), "rb") as f, paths.open_binary(
        paths.join(out_dir, name), "wb") as out:
      shutil.copyfileobj(f, out, 8 << 20)
  finally:
    shutil.rmtree(local, ignore_errors=True)


class CachedSource:
  """Random access over a complete cache (all shards of one split).

  When no cached preprocessor dropped an example, example i of the source is example i
  here too (worker i % N wrote it as its (i // N)-th record), so cached and uncached
  training see the same batches. Otherwise the shards are read one after another.
  """

  def __init__(self, paths: list[str], infos: list[dict]):
    self._paths = paths
    self._shards = [array_record_data_source.ArrayRecordDataSource([p]) for p in paths]
    self._sizes = [len(shard) for shard in self._shards]
    self._interleaved = sum(self._sizes) == infos[0].get("source_examples")
    self._offsets = [sum(self._sizes[:i]) for i in range(len(self._sizes))]

  @property
  def files(self) -> list[str]:
    """The shards' local files, in shard order."""
    return list(self._paths)

  def __len__(self) -> int:
    return sum(self._sizes)

  def __getitem__(self, index: int) -> dict:
    if not 0 <= index < len(self):
      raise IndexError(f"index {index} out of range for {len(self)} cached examples")
    if self._interleaved:
      shard, position = index % len(self._shards), index // len(self._shards)
    else:
      shard = max(i for i, start in enumerate(self._offsets) if start <= index)
      position = index - self._offsets[shard]
    return serialization.msgpack_restore(self._shards[shard][position])

  def __repr__(self) -> str:
    return f"CachedSource({os.path.dirname(self._paths[0])}, {len(self)} examples)"


def cached_source(task: Task, split: str, cache_dir: str | None = None) -> CachedSource:
  """The cache of a task split; a clear error when it is missing or unfinished."""
  if task.cache_index is None:
    raise ConfigError(f"USE_CACHED_TASKS is on but task {task.name!r} has no CACHE_POINT")
  directory = task_cache_dir(task, split, cache_dir)
  pattern = paths.join(directory, "shard-*.json")
  infos = paths.glob_files(pattern) if paths.is_url(directory) else sorted(glob.glob(pattern))
  how = f"run `t5lite cache {task.name} --split {split}` (or turn USE_CACHED_TASKS off)"
  if not infos:
    raise ConfigFileNotFoundError(
        f"no cache for task {task.name!r} split {split!r} in {directory}: {how}")
  counts = sorted({int(paths.basename(p).split("-of-")[1].split(".")[0]) for p in infos})
  if len(counts) > 1:
    raise ConfigFileNotFoundError(
        f"cache of {task.name!r} split {split!r} in {directory} mixes shards of runs with "
        f"--num_workers {counts}: delete the directory, then {how}")
  expected = counts[0]
  if len(infos) != expected:
    raise ConfigFileNotFoundError(f"cache of {task.name!r} split {split!r} in {directory} has "
                                  f"{len(infos)} of {expected} finished shards: {how}")
  meta = []
  for path in infos:
    try:
      meta.append(json.loads(paths.read_text(path)))
    except ValueError:  # cut short by a killed run of older code (now written atomically)
      raise ConfigFileNotFoundError(f"cache shard info {path} is unreadable: {how}") from None
  return CachedSource([staging.local_copy(p[:-len(".json")] + ".array_record") for p in infos],
                      meta)
