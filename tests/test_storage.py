"""t5lite.util.storage against real object-storage servers on 127.0.0.1 (fake-gcs-server for
gs://, moto's server for s3://, started by tests/helpers/storage_servers.py): the conditional
writes an exclusive lease and a commit marker rely on, the one-line refusal of a bucket that
is not there, the MODEL_DIR lease in a bucket (t5lite.runtime.lease.BucketLease), and a
Checkpointer opening a bucket where a save was cut short."""
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest
from orbax.checkpoint._src.path import step as orbax_steps

from t5lite.data.vocab import hf_training, vocabularies
from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.runtime import checkpoints, integrity, lease as lease_lib
from t5lite.util import paths, storage


def test_object_names_that_would_leave_their_local_folder_are_refused(tmp_path, monkeypatch):
  from t5lite.util import staging
  monkeypatch.setenv(staging.CACHE_ENV, str(tmp_path))
  assert staging.cache_path("s3://b/a/x.array_record") == str(tmp_path / "s3/b/a/x.array_record")
  for url in ("gs://b/a/../../x", "gs://b/./x", "s3://b/a//x"):
    with pytest.raises(ConfigError, match="has an empty, '.' or '..' part"):
      staging.cache_path(url)


def test_urls_are_told_from_local_paths():
  assert storage.is_url("gs://b/run") and storage.is_url("s3://b") and storage.is_url("gs://b/")
  for local in ("/tmp/run", "run", "gs:/b", "file:///tmp/x", "http://b/x", None):
    assert not storage.is_url(local)
  assert storage.split("s3://b/a/b.json") == ("s3", "b", "a/b.json")
  with pytest.raises(ConfigError, match="is not a bucket URL: write gs://BUCKET/PATH"):
    storage.split("gs:///x")


def test_create_exclusive_lets_one_writer_create_an_object(bucket):
  _, url = bucket
  lease = f"{url}/run/t5lite.lease"
  assert storage.read_versioned(lease) is None
  first = storage.create_exclusive(lease, b"first")
  assert first is not None
  assert storage.create_exclusive(lease, b"second") is None
  assert storage.read_versioned(lease) == (b"first", first)


def test_replace_if_takes_the_last_version_seen_and_refuses_a_stale_one(bucket):
  _, url = bucket
  path = f"{url}/lease"
  v1 = storage.create_exclusive(path, b"1")
  v2 = storage.replace_if(path, b"2", v1)
  assert v2 is not None and v2 != v1
  # A holder that was overtaken (it still has v1) notices at its next write.
  assert storage.replace_if(path, b"stale", v1) is None
  assert storage.read_versioned(path) == (b"2", v2)
  assert not storage.delete_if(path, v1)
  assert storage.read_versioned(path) == (b"2", v2)
  assert storage.delete_if(path, v2)
  assert storage.read_versioned(path) is None
  assert storage.replace_if(path, b"3", v2) is None  # deleted since: refused, not created
  assert storage.read_versioned(path) is None


def test_of_writers_racing_to_create_exactly_one_wins(bucket):
  _, url = bucket
  for round_ in range(6):
    path = f"{url}/race{round_}"
    results = [None] * 4
    start = threading.Barrier(len(results))

    def create(i):
      start.wait()
      results[i] = storage.create_exclusive(path, f"writer {i}".encode())

    threads = [threading.Thread(target=create, args=(i,)) for i in range(len(results))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    winners = [i for i, version in enumerate(results) if version is not None]
    assert len(winners) == 1, results
    assert storage.read_versioned(path) == (f"writer {winners[0]}".encode(),
                                            results[winners[0]])


def test_a_bucket_that_does_not_exist_is_refused_in_one_line_naming_it(bucket):
  server, url = bucket
  storage.check_writable(f"{url}/run", "MODEL_DIR")  # an existing bucket passes
  missing = server.url("no-such-bucket-t5lite", "run")
  with pytest.raises(ConfigError) as refused:
    storage.check_writable(missing, "MODEL_DIR")
  message = str(refused.value)
  assert message.startswith(f"MODEL_DIR {missing} is not writable: ")
  assert "\n" not in message and "exists" in message
  with pytest.raises(ConfigError, match="no-such-bucket-t5lite"):
    storage.create_exclusive(f"{missing}/x", b"x")


# --- the MODEL_DIR lease in a bucket ----------------------------------------------------------

def test_of_trainers_taking_a_bucket_lease_together_exactly_one_holds_it(bucket):
  _, url = bucket
  for round_ in range(4):
    model_dir = f"{url}/run{round_}"
    leases = [lease_lib.lease_for(model_dir) for _ in range(3)]
    assert all(isinstance(held, lease_lib.BucketLease) for held in leases)
    outcome = [None] * len(leases)
    start = threading.Barrier(len(leases))

    def take(i):
      start.wait()
      try:
        leases[i].acquire()
        outcome[i] = "held"
      except ConfigError as e:
        outcome[i] = str(e)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(leases))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert outcome.count("held") == 1, outcome
    for refused in (o for o in outcome if o != "held"):
      assert refused.startswith(f"MODEL_DIR {model_dir} is in use by another trainer (host ")
    holder = leases[outcome.index("held")]
    assert holder.check() is None
    holder.release()
    assert storage.read_versioned(holder.path) is None  # released: the object is gone
    again = lease_lib.lease_for(model_dir)
    again.acquire()
    again.release()


def test_a_stale_bucket_lease_is_taken_over_and_its_holder_notices(bucket):
  _, url = bucket
  path = f"{url}/run/{lease_lib.LEASE_FILE}"
  # A holder on another host whose heartbeat stopped 1,000 s ago.
  storage.create_exclusive(path, json.dumps(
      {"host": "elsewhere", "pid": 7, "token": "t", "heartbeat": time.time() - 1000}).encode())
  late = lease_lib.BucketLease(f"{url}/run", timeout_s=600)
  with pytest.raises(ConfigError, match="in use by another trainer"):
    lease_lib.BucketLease(f"{url}/run", timeout_s=2000).acquire()  # not stale for it
  late.acquire()
  assert "host elsewhere" in late.taken_over and "heartbeat is 1000 s old" in late.taken_over
  # Now `late` stalls; a rival takes the object over (as a takeover writes it, at its
  # version): the holder's next conditional heartbeat fails and it stops writing.
  rival = lease_lib.BucketLease(f"{url}/run", timeout_s=600)
  data, version = storage.read_versioned(path)
  assert json.loads(data)["token"] == late.token
  assert storage.replace_if(path, rival._payload(), version) is not None
  message = late.check()
  assert message.startswith(f"MODEL_DIR {url}/run: another trainer took over its lease (host ")
  late.release()  # leaves the rival's lease alone
  assert json.loads(storage.read_versioned(path)[0])["token"] == rival.token


def test_a_bucket_lease_heartbeat_renews_only_its_own_version(bucket):
  _, url = bucket
  held = lease_lib.BucketLease(f"{url}/run", timeout_s=0.5)  # a beat every 0.05 s
  held.acquire()
  first = held.version
  deadline = time.time() + 10
  while held.version == first and time.time() < deadline:
    time.sleep(0.05)
  assert held.version != first and held.check() is None  # renewed, still ours
  taken = None
  while taken is None:  # a rival's takeover, at the version it read (a beat may land first)
    taken = storage.replace_if(held.path, b'{"token": "someone else"}',
                               storage.read_versioned(held.path)[1])
  deadline = time.time() + 10
  while held.lost is None and time.time() < deadline:
    time.sleep(0.05)
  assert held.lost and "another trainer took over its lease" in held.lost
  held.release()


# --- inputs read from a bucket -----------------------------------------------------------------

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen jugs.",
         "How vexingly quick daft zebras jump!", "Sphinx of black quartz, judge my vow."] * 20


def _upload(folder, url) -> None:
  for name in sorted(os.listdir(folder)):
    storage.path(f"{url}/{name}").write_bytes((folder / name).read_bytes())


def test_a_checkpointer_on_a_bucket_whose_only_step_was_cut_short_starts_empty(bucket, monkeypatch):
  """A SIGKILL during the first save leaves a step with no commit object, the only thing under
  checkpoints/. Removing it makes the folder vanish: orbax's own cleanup does so in a thread
  while its constructor lists the folder, and a removal between its exists() and its listing
  was a FileNotFoundError (gcsfs) that stopped the restart. Here orbax's listing waits until
  the leftover is gone, the interleaving that failed: the Checkpointer must start empty."""
  server, url = bucket
  leftover = f"{url}/run/checkpoints/2/_CHECKPOINT_METADATA"
  storage.create_exclusive(leftover, b"{}")
  exists_then_list = orbax_steps._is_valid_base_path

  def removal_in_between(base_path):
    found = exists_then_list(base_path)
    deadline = time.monotonic() + 10
    while paths.exists(leftover) and time.monotonic() < deadline:
      time.sleep(0.02)
    return found

  monkeypatch.setattr(orbax_steps, "_is_valid_base_path", removal_in_between)
  checkpointer = checkpoints.Checkpointer(f"{url}/run")
  assert checkpointer.all_steps() == []
  assert not paths.exists(leftover)
  checkpointer.save(2, {"w": np.arange(5.0)}, {"position": 2})  # the step cut short, again
  checkpointer.wait()
  assert checkpointer.all_steps() == [2]
  checkpointer.close()


def test_an_upload_writes_commit_markers_last_and_the_folders_own_last_of_all(bucket,
                                                                              tmp_path):
  """A checkpoint step uploaded (t5lite.util.staging.put_tree): orbax's commit markers after
  every other file, the step's own (which commits the whole) after its items' markers."""
  from t5lite.util import staging
  names = ["commit_success.txt", "_CHECKPOINT_METADATA", "state/commit_success.txt",
           "state/d/0a1b", "data/commit_success.txt", "data/metadata", "zz_last_by_name"]
  for rel in names:
    (tmp_path / "step" / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "step" / rel).write_text(rel)
  uploaded: list[str] = []
  out = paths.join(bucket[1], "step")
  staging.put_tree(str(tmp_path / "step"), out, uploaded)
  order = [url[len(out) + 1:] for url in uploaded]
  assert order[-3:] == ["data/commit_success.txt", "state/commit_success.txt",
                        "commit_success.txt"]
  assert sorted(order) == sorted(names) == paths.files_under(out)


def test_an_s3_mirror_lists_committed_steps_and_clears_cut_short_uploads(s3_server):
  """S3 checkpoints' local mirror (t5lite/runtime/checkpoint_mirror.py): a dead process's
  mirror is removed, a live one's kept; at start a step with its commit marker is listed with
  its small files only (array data comes when it is read), a step without one (a killed
  upload) is deleted, a step set aside stays; after a save, retention's deletions reach the
  bucket once orbax has made them here."""
  from t5lite.runtime import checkpoint_mirror
  from t5lite.util import owned_tmp
  with s3_server.activated():
    storage.forget_clients()
    url = s3_server.url(s3_server.new_bucket(), "run/checkpoints")
    objects = {"4/commit_success.txt": "", "4/_CHECKPOINT_METADATA": "{}",
               "4/state/d/0a1b": "data", "6/_CHECKPOINT_METADATA": "{}",
               "6/state/d/0a1c": "cut short", "2.corrupt-1/state/d/0a1d": "kept"}
    for rel, text in objects.items():
      storage.create_exclusive(paths.join(url, rel), text.encode())
    # What a SIGKILLed run left: its folder, its lock file held by nobody.
    stale = tempfile.mkdtemp(prefix=checkpoint_mirror.PREFIX)
    open(os.path.join(stale, owned_tmp.LOCK_FILE), "w").close()
    mirror = checkpoint_mirror.S3Mirror(url)
    assert not os.path.exists(stale)
    checkpoint_mirror.S3Mirror(url).close()  # another mirror beside a live one leaves it
    assert os.path.isdir(mirror.local)
    mirror.pull(write=True)
    assert paths.files_under(mirror.local) == ["4/_CHECKPOINT_METADATA", "4/commit_success.txt"]
    assert paths.files_under(url) == ["2.corrupt-1/state/d/0a1d", "4/_CHECKPOINT_METADATA",
                                      "4/commit_success.txt", "4/state/d/0a1b"]
    mirror.fetch(4)
    assert paths.read_text(os.path.join(mirror.local, "4", "state", "d", "0a1b")) == "data"
    os.makedirs(os.path.join(mirror.local, "8"))  # a step orbax committed here, sealed
    with open(os.path.join(mirror.local, "8", "commit_success.txt"), "w") as f:
      f.write("")
    # orbax lists 8 alone but 4 is still here (it deletes after a save commits; this one may
    # yet fail): 4 stays in the bucket; once retention has deleted it here, it goes there too.
    mirror.publish([8])
    assert sorted(checkpoint_mirror.committed_steps(url)[0]) == [4, 8]
    shutil.rmtree(os.path.join(mirror.local, "4"))
    mirror.publish([8])
    assert checkpoint_mirror.committed_steps(url)[0] == {8: ["commit_success.txt"]}
    assert paths.files_under(url) == ["2.corrupt-1/state/d/0a1d", "8/commit_success.txt"]
    local = mirror.local
    mirror.close()
    assert not os.path.exists(local)
    storage.forget_clients()


def test_a_bucket_step_is_sealed_only_once_orbax_has_written_its_commit_marker(gcs_server):
  """orbax may call a save that failed in its metadata writes over while its checkpointer's
  thread still commits the step (rewriting _CHECKPOINT_METADATA): on a bucket a step without
  the marker, orbax's last write of a step, is not sealed until the marker is there."""
  with gcs_server.activated():
    storage.forget_clients()
    run = gcs_server.url(gcs_server.new_bucket(), "run")
    checkpointer = checkpoints.Checkpointer(run, checkpoints.CheckpointConfig(async_save=False))
    checkpointer.save(3, {"w": np.arange(5.0)}, {"position": 3})
    step_dir = checkpointer.step_dir(3)
    marker = paths.join(step_dir, integrity.COMMIT_MARKER)
    text = paths.read_text(marker)
    paths.remove(marker)  # as between orbax's metadata update and its marker
    checkpointer.seal_committed()
    assert not integrity.is_sealed(step_dir)
    with paths.open_binary(marker, "wb") as f:
      f.write(text.encode())
    checkpointer.seal_committed()
    assert integrity.verify(step_dir, 3) is True
    checkpointer.close()
    storage.forget_clients()


def test_an_s3_upload_runs_beside_training_and_a_refused_one_stops_the_run_at_a_step(s3_server):
  """On s3:// a committed step is uploaded in the mirror's own thread: the step that starts
  the upload returns before it (a synchronous upload to the missing bucket would raise
  there); an upload the storage refuses (the bucket is gone) stops the run at a following
  step in one line naming the URL, with the committed steps named intact."""
  import fsspec
  with s3_server.activated():
    storage.forget_clients()
    bucket = s3_server.new_bucket()
    run = s3_server.url(bucket, "run")
    checkpointer = checkpoints.Checkpointer(run)
    checkpointer.save(2, {"w": np.arange(5.0)}, {"position": 2})
    checkpointer.wait()  # committed, sealed and uploaded
    assert paths.exists(f"{run}/checkpoints/2/commit_success.txt")
    s3 = fsspec.filesystem("s3")
    s3.rm(bucket, recursive=True)  # every object, then the bucket itself
    checkpointer.save(4, {"w": np.arange(5.0) + 1}, {"position": 4})
    checkpointer._manager.wait_until_finished()  # committed here; its upload not started
    checkpointer.seal_committed()  # sealed; the upload starts and this step goes on
    deadline = time.monotonic() + 60
    with pytest.raises(checkpoints.CheckpointWriteError) as stopped:
      while time.monotonic() < deadline:  # the steps after it
        checkpointer.seal_committed()
        time.sleep(0.05)
    message = str(stopped.value)
    assert message.startswith(f"copying checkpoints to {run}/checkpoints failed: "), message
    assert "the committed checkpoints (2) are intact: check that the bucket is reachable" in (
        message)
    checkpointer._mirror.close()
    storage.forget_clients()


def test_a_killed_readers_download_is_removed_by_the_next_and_a_live_ones_kept(bucket):
  """staging.download's temporary folder: a SIGKILLed process (its lock file held by nobody)
  leaves it until the next download removes it; one whose owner lives (its lock held) stays;
  the download's own is gone when it ends."""
  from t5lite.util import owned_tmp, staging
  _, url = bucket
  storage.create_exclusive(paths.join(url, "run/file.txt"), b"x")
  dead = tempfile.mkdtemp(prefix="t5lite-download-")
  open(os.path.join(dead, owned_tmp.LOCK_FILE), "w").close()
  live = owned_tmp.OwnedFolder("t5lite-download-")
  with staging.download(paths.join(url, "run")) as local:
    assert open(os.path.join(local, "file.txt")).read() == "x"
    assert os.listdir(local) == ["file.txt"]  # the lock file is beside the files, not in them
    assert not os.path.exists(dead) and os.path.isdir(live.path)
  assert not os.path.exists(os.path.dirname(local))
  live.close()
  assert not os.path.exists(live.path)


def test_an_initial_checkpoint_in_a_bucket_loads_as_the_local_one_read_once(bucket, tmp_path,
                                                                           monkeypatch, capsys):
  """INITIAL_CHECKPOINT_PATH on a bucket: the params equal those read from the same MODEL_DIR
  on disk; on s3:// the step is downloaded once for its shapes and params alike (gs:// is read
  in place); a step without checksums is read with a warning naming the bucket, not a local
  copy."""
  import jax

  import train_tasks  # noqa: F401 (registers train_test_copy)
  from helpers import BYTE_VOCAB_SIZE, assert_trees_equal, tiny, train_config
  from helpers.storage_servers import upload_tree
  from t5lite.interop import params_only
  from t5lite.train.trainer import Trainer
  from t5lite.util import staging
  server, url = bucket
  config = tiny(vocab_size=BYTE_VOCAB_SIZE, num_encoder_layers=1, num_decoder_layers=1)
  trainer = Trainer(config, train_config(tmp_path / "base_run"))
  params = jax.device_get(trainer.fresh_state().params)
  params_only.write_model_dir(str(tmp_path / "base"), config, params, step=0, vocabulary=None)
  upload_tree(tmp_path / "base", f"{url}/base")
  downloads = []
  download = staging.download
  monkeypatch.setattr(staging, "download",
                      lambda *a, **k: downloads.append(a[0]) or download(*a, **k))
  local, step = trainer.initial_params(str(tmp_path / "base"))
  remote, remote_step = trainer.initial_params(f"{url}/base")
  assert remote_step == step == 0
  assert_trees_equal(jax.device_get(remote), jax.device_get(local))
  assert_trees_equal(jax.device_get(remote), params)
  assert len(downloads) == (1 if server.scheme == "s3" else 0), downloads
  from t5lite.runtime import integrity
  paths.remove(f"{url}/base/checkpoints/0/{integrity.CHECKSUMS_FILE}")
  capsys.readouterr()
  assert_trees_equal(jax.device_get(trainer.initial_params(f"{url}/base")[0]), params)
  warning = capsys.readouterr().err
  assert f"checkpoint step 0 in {url}/base" in warning and "has no checksums" in warning, warning


@pytest.mark.parametrize("kind", ["sentencepiece", "wordpiece", "byte_level_bpe", "hf_spiece"])
def test_a_vocabulary_in_a_bucket_loads_as_the_same_one_from_disk(bucket, kind, tmp_path):
  _, url = bucket
  if kind in ("sentencepiece", "hf_spiece"):
    model = vocabularies.train_sentencepiece(TEXTS, vocab_size=47, byte_fallback=False)
    vocabulary = vocabularies.SentencePieceVocabulary(model, extra_ids=100 if kind == "hf_spiece"
                                                      else 7)
  elif kind == "wordpiece":
    vocabulary = hf_training.train_wordpiece(TEXTS, vocab_size=90)
  else:
    vocabulary = hf_training.train_byte_level_bpe(TEXTS, vocab_size=300)
  if kind == "hf_spiece":  # an HF checkpoint's folder: spiece.model alone
    (tmp_path / vocabularies.SPIECE_FILE).write_bytes(vocabulary.serialized_model)
  else:
    vocabulary.save(tmp_path)
  _upload(tmp_path, f"{url}/vocab")
  loaded = vocabularies.load_vocabulary(f"{url}/vocab")
  assert loaded == vocabularies.load_vocabulary(tmp_path) == vocabulary
  text = "Quick zebras judge the lazy box."
  assert loaded.decode(loaded.encode(text)) == vocabulary.decode(vocabulary.encode(text))
  with pytest.raises(ConfigFileNotFoundError, match=f"{url}/nothing-here"):
    vocabularies.load_vocabulary(f"{url}/nothing-here")


def test_jsonl_shards_in_a_bucket_read_as_the_same_rows_as_on_disk(bucket, tmp_path):
  import gzip

  from t5lite.data.sources.readers import JsonlSource
  _, url = bucket
  rows = [{"text": f"doc {i} \u00e9\u4e2d", "n": i} for i in range(11)]
  for shard in range(3):
    lines = "".join(json.dumps(r) + "\n" for r in rows[shard * 4:][:4]).encode()
    name = f"c4-train.{shard:05d}-of-00003.json" + (".gz" if shard != 1 else "")
    (tmp_path / name).write_bytes(gzip.compress(lines) if name.endswith(".gz") else lines)
  (tmp_path / "c4-validation.00000-of-00001.json").write_text('{"text": "not this"}\n')
  _upload(tmp_path, f"{url}/c4")
  local = JsonlSource(str(tmp_path / "c4-train.*"))
  remote = JsonlSource(f"{url}/c4/c4-train.*")
  assert len(remote) == len(local) == 11
  assert [remote[i] for i in range(11)] == [local[i] for i in range(11)] == rows
  with pytest.raises(ConfigFileNotFoundError, match=f"no object matches '{url}/c4/nothing-\\*'"):
    len(JsonlSource(f"{url}/c4/nothing-*"))


def test_parquet_files_in_a_bucket_read_as_the_same_rows_as_on_disk(bucket, tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  from t5lite.data.sources.readers import ParquetSource
  _, url = bucket
  rows = [{"text": f"row {i} \u00e9", "ids": list(range(i % 4)), "n": i} for i in range(23)]
  for shard in range(2):
    part = rows[shard * 12:][:12]
    pq.write_table(pa.Table.from_pylist(part), tmp_path / f"part-{shard}.parquet",
                   row_group_size=5)  # several row groups: read one at a time
  _upload(tmp_path, f"{url}/pq")
  local = ParquetSource(str(tmp_path / "part-*.parquet"))
  remote = ParquetSource(f"{url}/pq/part-*.parquet")
  assert len(remote) == len(local) == 23
  for i in (0, 4, 5, 11, 12, 22, 7):
    got, want = remote[i], local[i]
    assert got.keys() == want.keys() and got["text"] == want["text"] == rows[i]["text"]
    assert list(got["ids"]) == list(want["ids"]) == rows[i]["ids"]


def test_builds_that_rename_a_folder_into_place_refuse_a_bucket_url(tmp_path, monkeypatch):
  from t5lite.util import atomic
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match="gs://b/cache/x: this is built on local disk"):
    atomic.build_dir("gs://b/cache/x", lambda path: None, lambda path: False)
  with pytest.raises(ConfigError, match="s3://b/y.array_record: this is built on local disk"):
    with atomic.writing("s3://b/y.array_record"):
      pass
  assert os.listdir(tmp_path) == []  # no local folder named gs: or s3:


def test_tfrecord_array_record_and_tfds_data_in_a_bucket_read_as_on_disk(
    bucket, tmp_path, monkeypatch):
  """TFRecord shards are read from the bucket; array_record shards and a TFDS data_dir are
  copied to the local object cache once (array_record reads local files only) and read the
  same rows as on disk; a replaced object is fetched again."""
  from t5lite.data.sources.tfds import TfdsSource, prepare_tfds_dataset
  from t5lite.data.sources.tfrecord import (ArrayRecordSource, TfRecordSource,
                                            convert_tfrecord_to_array_record, read_tfrecord)
  from t5lite.util import staging
  _, url = bucket
  monkeypatch.setenv(staging.CACHE_ENV, str(tmp_path / "objects"))
  rows = [{"text": f"doc {i} \u00e9\u65e5", "n": i} for i in range(9)]
  records = tmp_path / "records"
  records.mkdir()
  prepare_tfds_dataset("t5lite_bucket_corpus", {"train": rows, "validation": rows[:2]},
                       str(tmp_path / "tfds"), {"text": "text", "n": "int64"})
  version = tmp_path / "tfds" / "t5lite_bucket_corpus" / "1.0.0"
  shard = version / "t5lite_bucket_corpus-train.array_record-00000-of-00001"
  opened = ArrayRecordSource(str(shard))._open()  # TFDS's records: tf.train.Example bytes
  examples = [bytes(opened[i]) for i in range(len(rows))]
  _write_tfrecord(records / "part-0.tfrecord", examples[:5])
  _write_tfrecord(records / "part-1.tfrecord", examples[5:])
  convert_tfrecord_to_array_record(str(records / "part-*.tfrecord"), str(tmp_path / "ar"))
  _upload(records, f"{url}/tfrecord")
  _upload(tmp_path / "ar", f"{url}/ar")
  for folder in sorted(p for p in (tmp_path / "tfds").rglob("*") if p.is_dir()):
    if any(f.is_file() for f in folder.iterdir()):
      _upload(folder, f"{url}/tfds/{folder.relative_to(tmp_path / 'tfds').as_posix()}")
  want = [(r["text"], r["n"]) for r in rows]
  for remote in (TfRecordSource(f"{url}/tfrecord/part-*.tfrecord"),
                 ArrayRecordSource(f"{url}/ar/*.array_record"),
                 TfdsSource("t5lite_bucket_corpus", "train", data_dir=f"{url}/tfds")):
    assert [(remote[i]["text"], remote[i]["n"]) for i in range(len(remote))] == want, remote
  cached = sorted(p.relative_to(tmp_path / "objects").as_posix()
                  for p in (tmp_path / "objects").rglob("*") if p.is_file()
                  and not p.name.endswith(".version"))
  scheme, bucket_name = url.split("://")[0], url.split("/")[2]
  assert cached == sorted(
      [f"{scheme}/{bucket_name}/ar/{p.name}" for p in (tmp_path / "ar").iterdir()]
      + [f"{scheme}/{bucket_name}/tfds/t5lite_bucket_corpus/1.0.0/{p.name}"
         for p in version.iterdir()]), cached
  assert len(read_tfrecord(str(records / "part-1.tfrecord"))) == 4
  # The array_record shard replaced in the bucket (its first 5 rows only): fetched again.
  first = sorted((tmp_path / "ar").iterdir())[0]
  convert_tfrecord_to_array_record(str(records / "part-0.tfrecord"), str(tmp_path / "ar5"))
  storage.path(f"{url}/ar/{first.name}").write_bytes(
      next((tmp_path / "ar5").glob("*.array_record")).read_bytes())
  assert len(ArrayRecordSource(f"{url}/ar/{first.name}")) == 5


def _write_tfrecord(path, records: list[bytes]) -> None:
  """TFRecord framing (u64 length, masked CRC32C of it, data, masked CRC32C of the data)."""
  import struct

  from t5lite.data.sources.crc32c import masked_crc32c
  out = bytearray()
  for data in records:
    length = struct.pack("<Q", len(data))
    out += length + struct.pack("<I", masked_crc32c(length)) + data
    out += struct.pack("<I", masked_crc32c(data))
  path.write_bytes(bytes(out))
