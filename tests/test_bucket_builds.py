"""First-use builds kept in a bucket, against the local storage servers (fake-gcs-server,
moto's server; tests/helpers/storage_servers.py): t5lite.util.staging.built, the embedded corpus
and its vocabularies under T5LITE_DATA_DIR=gs://... / s3://..., and the task cache in a bucket."""
import os
import pathlib
import threading

import numpy as np
import pytest

from t5lite.data import cache
from t5lite.data.registry import TaskRegistry
from t5lite.errors import ConfigFileNotFoundError
from t5lite.util import paths, staging, storage
from t5lite_tasks import embedded


@pytest.fixture
def object_cache(tmp_path, monkeypatch):
  monkeypatch.setenv(staging.CACHE_ENV, str(tmp_path / "objects"))
  monkeypatch.chdir(tmp_path)  # a URL taken for a local path would show up here
  return tmp_path / "objects"


def _writer(name: str, before_publish=lambda: None):
  def build(folder):
    os.makedirs(os.path.join(folder, "sub"))
    pathlib.Path(folder, "sub", "data.txt").write_text(f"built by {name}\n")
    pathlib.Path(folder, "name").write_text(name)
    before_publish()
  return build


def test_of_two_hosts_building_together_one_publishes_and_both_read_its_build(
    bucket, object_cache, tmp_path, monkeypatch):
  _, url = bucket
  target = paths.join(url, "vocab")
  both_built = threading.Barrier(2)  # both build before either publishes: a real race
  results, errors = {}, []

  def host(name):
    try:
      results[name] = staging.built(target, _writer(name, lambda: both_built.wait(60)))
    except BaseException as e:  # noqa: BLE001 (reported below)
      errors.append(e)

  threads = [threading.Thread(target=host, args=(name,)) for name in ("a", "b")]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(120)
  assert not errors, errors
  assert results["a"] == results["b"] and results["a"].startswith(str(object_cache))
  winner = pathlib.Path(results["a"], "name").read_text()
  assert winner in ("a", "b")
  assert pathlib.Path(results["a"], "sub", "data.txt").read_text() == f"built by {winner}\n"
  prefix = storage.read_versioned(paths.join(target, staging.BUILT_MARKER))[0].decode()
  # The loser deleted its upload: the bucket holds the marker and the winner's files only.
  assert paths.files_under(target) == sorted(
      [staging.BUILT_MARKER, f"{prefix}/name", f"{prefix}/sub/data.txt"])
  # Another host (an empty object cache) reads the published build and builds nothing.
  monkeypatch.setenv(staging.CACHE_ENV, str(tmp_path / "other-host"))
  local = staging.built(target, lambda folder: pytest.fail("built a second time"))
  assert local.startswith(str(tmp_path / "other-host"))
  assert pathlib.Path(local, "name").read_text() == winner
  assert not [p for p in os.listdir(tmp_path) if p.startswith(("gs:", "s3:"))]


def test_a_failed_or_killed_build_publishes_nothing_and_the_next_one_is_read(
    bucket, object_cache):
  _, url = bucket
  target = paths.join(url, "vocab")

  def failing(folder):
    _writer("failed")(folder)
    raise RuntimeError("the build failed")

  with pytest.raises(RuntimeError, match="the build failed"):
    staging.built(target, failing)
  assert paths.files_under(target) == []
  # A host SIGKILLed mid-upload leaves objects under a prefix no BUILT names: never read.
  from t5lite.util import atomic
  atomic.write_file(paths.join(target, "build-dead", "name"), "dead")
  local = staging.built(target, _writer("good"))
  assert pathlib.Path(local, "name").read_text() == "good"
  assert (storage.read_versioned(paths.join(target, staging.BUILT_MARKER))[0].decode()
          != "build-dead")


def test_the_embedded_corpus_and_a_vocabulary_build_once_in_a_bucket(
    bucket, object_cache, tmp_path, monkeypatch):
  """T5LITE_DATA_DIR in a bucket: the first prepare() builds and publishes; its local copy reads
  the same documents as the suite's local build; a second host only copies."""
  _, url = bucket
  on_disk = embedded.source("validation")  # the suite's local build, before the variable
  monkeypatch.setenv("T5LITE_DATA_DIR", paths.join(url, "data"))
  data_url = embedded.data_dir()
  assert data_url == paths.join(url, "data", os.path.basename(data_url))
  local = embedded.prepare.__wrapped__()
  assert local.startswith(str(object_cache))
  from_bucket = embedded.TfdsSource(embedded.DATASET, "validation", data_dir=local)
  assert len(from_bucket) == len(on_disk) > 10
  for i in (0, len(on_disk) // 2, len(on_disk) - 1):
    assert from_bucket[i]["text"] == on_disk[i]["text"]
  names = paths.files_under(data_url)
  assert staging.BUILT_MARKER in names and any(n.endswith("/spiece.model") for n in names)
  vocabulary = embedded.load_lm_vocabulary()  # built and published beside the dataset
  text = "Return a list of the words in the string."
  assert vocabulary.decode(vocabulary.encode(text)) == text
  bpe_url = paths.join(data_url, f"byte_level_bpe_{embedded.LM_VOCAB_SIZE}")
  assert staging.BUILT_MARKER in paths.files_under(bpe_url)
  # A second host: nothing is rebuilt, the same files are read.
  monkeypatch.setenv(staging.CACHE_ENV, str(tmp_path / "other-host"))
  monkeypatch.setattr(embedded, "stdlib_documents", lambda: pytest.fail("rebuilt"))
  again = embedded.prepare.__wrapped__()
  assert pathlib.Path(again, "spiece.model").read_bytes() == pathlib.Path(
      local, "spiece.model").read_bytes()
  assert embedded.load_lm_vocabulary() == vocabulary


def test_a_task_cache_in_a_bucket_reads_the_same_examples_as_on_disk(
    bucket, object_cache, tmp_path):
  """`t5lite cache --cache_dir gs://...` (or T5LITE_CACHE_DIR) by two workers: each shard one
  object, its .json after it; USE_CACHED_TASKS then reads the examples the local cache holds."""
  import train_tasks  # noqa: F401 (registers train_test_sc, which has a CACHE_POINT)
  _, url = bucket
  task = TaskRegistry.get("train_test_sc")
  where = {"bucket": paths.join(url, "tasks"), "disk": str(tmp_path / "tasks")}
  for cache_dir in where.values():
    with pytest.raises(ConfigFileNotFoundError, match="no cache for task 'train_test_sc'"):
      cache.cached_source(task, "train", cache_dir)
    for worker in (1, 0):
      cache.cache_task(task, "train", cache_dir, worker_index=worker, num_workers=2)
  assert paths.files_under(paths.join(where["bucket"], "train_test_sc", "train")) == [
      f"shard-0000{i}-of-00002.{ext}" for i in (0, 1) for ext in ("array_record", "json")]
  from_bucket = cache.cached_source(task, "train", where["bucket"])
  on_disk = cache.cached_source(task, "train", where["disk"])
  assert len(from_bucket) == len(on_disk) == len(task.get_source("train"))
  for i in range(len(on_disk)):
    got, want = from_bucket[i], on_disk[i]
    assert sorted(got) == sorted(want)
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


def test_a_missing_bucket_is_refused_in_one_line_before_anything_is_built(
    bucket, object_cache, monkeypatch):
  import train_tasks  # noqa: F401 (registers train_test_sc)
  from t5lite.errors import ConfigError
  _, url = bucket
  missing = url.replace("t5lite-", "missing-")
  refused = f"T5LITE_DATA_DIR {missing}/x(: .*does not exist| is not writable)"
  with pytest.raises(ConfigError, match=refused):
    staging.built(f"{missing}/x", lambda folder: pytest.fail("built"), "T5LITE_DATA_DIR")
  monkeypatch.setattr(cache, "apply_preprocessors", lambda *a, **k: pytest.fail("cached"))
  with pytest.raises(ConfigError, match=f"the task cache {missing}/tasks/train_test_sc/train "
                     "is not writable"):
    cache.cache_task(TaskRegistry.get("train_test_sc"), "train", f"{missing}/tasks")
