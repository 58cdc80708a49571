"""t5lite.util.storage against real object-storage servers on 127.0.0.1 (fake-gcs-server for
gs://, moto's server for s3://, started by tests/helpers/storage_servers.py): the conditional
writes an exclusive lease and a commit marker rely on, and the one-line refusal of a bucket
that is not there."""
import threading

import pytest

from t5lite.errors import ConfigError
from t5lite.util import storage


@pytest.fixture(params=["gs", "s3"])
def bucket(request):
  """(server, a fresh bucket's URL) with this process's clients pointed at the server."""
  server = request.getfixturevalue("gcs_server" if request.param == "gs" else "s3_server")
  with server.activated():
    storage.forget_clients()
    try:
      yield server, server.url(server.new_bucket())
    finally:
      storage.forget_clients()


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
