"""`t5lite cache` on one host: all N workers' shards written by local processes at once, with
a progress bar of examples written.

Each worker is cache.cache_task(worker_index=w, num_workers=N) in a spawned process (the task
sent pickled, as the batch pipeline's workers get theirs, so tasks from a user's module work);
at most `processes` run at a time. The examples they write are counted in one shared counter
that the parent shows (t5lite.util.progress: a bar on a terminal, a line per period in a
log). With one worker the shard is written in this process. The shards are the same files N
hosts would write with --worker_index.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os

import cloudpickle

from t5lite.data import cache
from t5lite.data.registry import Task
from t5lite.data.sources.files import IndexedFileSource
from t5lite.errors import ConfigError
from t5lite.util.progress import Progress

_counter = None  # the examples-written counter, in each worker process


def _init(counter) -> None:
  global _counter
  _counter = counter


def _count(n: int) -> None:
  with _counter.get_lock():
    _counter.value += n


def _cache_one(payload: bytes, split: str, cache_dir: str | None, worker_index: int,
               num_workers: int) -> dict:
  task = cloudpickle.loads(payload)  # this process's own pickled task, not an outside file
  return cache.cache_task(task, split, cache_dir, worker_index=worker_index,
                          num_workers=num_workers, progress=_count)


def source_size(task: Task, split: str) -> int | None:
  """The number of source examples when it is known without reading them (the bar's
  total): a streamed source's metadata count, or an in-memory source's length. Files read
  by index would be read once more just to count them: no total then."""
  source = task.get_source(split)
  if isinstance(source, IndexedFileSource):
    return None
  try:
    return len(source)
  except ConfigError:  # a streamed source of text lines, which cannot say
    return None


def cache_in_parallel(task: Task, split: str, cache_dir: str | None = None, *,
                      num_workers: int, processes: int | None = None,
                      progress: bool = True) -> list[dict]:
  """Writes every worker's shard with up to `processes` local processes (default: the
  CPUs, at most num_workers); returns the shards' infos in worker order."""
  # Refused in one line before the source is built (for the bar's total), not after.
  cache.check_request(task, 0, num_workers)
  cache.writable_cache_dir(task, split, cache_dir)
  processes = max(1, min(num_workers, processes or os.cpu_count() or 1))
  bar = Progress(f"cache {task.name} {split}", source_size(task, split), "example",
                 enabled=progress)
  if num_workers == 1:
    with bar:
      return _finished(bar, [cache.cache_task(task, split, cache_dir, progress=bar.update)])
  context = multiprocessing.get_context("spawn")  # never fork a process that loaded JAX
  counter = context.Value("q", 0)
  payload = cloudpickle.dumps(task)
  with bar, concurrent.futures.ProcessPoolExecutor(
      processes, mp_context=context, initializer=_init, initargs=(counter,)) as pool:
    futures = [pool.submit(_cache_one, payload, split, cache_dir, w, num_workers)
               for w in range(num_workers)]
    pending = set(futures)
    while pending:
      _, pending = concurrent.futures.wait(pending, timeout=0.5)
      bar.update(counter.value - bar.count)
    return _finished(bar, [f.result() for f in futures])  # a worker's exception: raised here


def _finished(bar: Progress, infos: list[dict]) -> list[dict]:
  """The bar's total was the source's examples; preprocessors may drop some: the bar ends at
  the examples written, as its new total."""
  written = sum(info["examples"] for info in infos)
  bar.done(written, total=written)
  return infos
