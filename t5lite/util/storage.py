"""Object storage (`gs://BUCKET/...`, `s3://BUCKET/...`): the operations whose guarantees a
bucket gives differently from a local disk, each in its object-store form.

    storage.is_url("gs://b/run")                      # True; local paths are False
    version = storage.create_exclusive(url, data)      # None: the object exists already
    version = storage.replace_if(url, data, version)   # None: someone else wrote it since
    data, version = storage.read_versioned(url)        # None: no such object
    storage.check_writable("gs://b/run", "MODEL_DIR")  # ConfigError naming the URL if not

A bucket has no atomic folder rename and no locks; what it has is an atomic write of one
object and a *precondition* on that write. Creating an object only if none exists (GCS
`ifGenerationMatch=0`, S3 `If-None-Match: *`) lets exactly one of two racing writers win;
overwriting only if the object is still at the version this writer last saw (GCS generation,
S3 ETag) makes a writer that was overtaken notice at its next write. Those two calls are what
an exclusive lease, a commit marker and a first-use build need on a bucket.

The calls go through the clouds' own clients, google-cloud-storage and boto3 (the `gcs` and
`s3` extras), because the fsspec layers over them (gcsfs, s3fs) expose create-if-absent but no
compare-and-swap. Credentials are the clients' usual ones (Application Default Credentials;
the AWS credential chain); their endpoints follow STORAGE_EMULATOR_HOST and AWS_ENDPOINT_URL,
which is how the tests run them against local servers. Transient errors (429, 5xx, resets)
are retried by the clients with exponential backoff: google-cloud-storage's default policy
(1 s doubling to 60 s, for at most 120 s; a conditional write is safe to retry) and boto3's
`standard` mode (RETRY_ATTEMPTS tries, backoff up to 20 s); what still fails is raised.
"""
from __future__ import annotations

import functools
import re
from typing import Union

from t5lite.errors import ConfigError

SCHEMES = ("gs", "s3")
_URL = re.compile(r"^(?P<scheme>gs|s3)://(?P<bucket>[^/]+)/?(?P<key>.*)$")
RETRY_ATTEMPTS = 8
COMMIT_MARKER = "commit_success.txt"
"""What orbax writes last into a checkpoint step it saves on a bucket (and into each item): the
step is committed once it is there (on a local disk a folder rename commits it)."""
Version = Union[int, str]
"""A GCS object's generation (int) or an S3 object's ETag (str)."""


_SERVICE_ERROR_WORDS = ("UNAVAILABLE:", "DEADLINE_EXCEEDED:", "PERMISSION_DENIED:",
                        "RESOURCE_EXHAUSTED:", "UNAUTHENTICATED:", "Failed to connect",
                        "Couldn't connect")
"""How TensorStore (under orbax) reports a bucket that failed it once its own retries are spent
(its gcs driver retries transient errors 32 times, backing off from 1 s to 32 s)."""
_SERVICE_ERROR_MODULES = ("google.api_core", "google.auth", "google.cloud", "gcsfs", "botocore",
                          "aiohttp", "requests", "urllib3")
"""Client libraries whose exceptions mean the storage service failed (after their retries)."""


def is_service_error(error: BaseException) -> bool:
  """True for an error of a storage service or its client (unreachable, refused, throttled
  past the retries): the environment's doing, told in one line, not a bug."""
  return (type(error).__module__.startswith(_SERVICE_ERROR_MODULES)
          or any(w in str(error) for w in _SERVICE_ERROR_WORDS))


def is_url(path) -> bool:
  """True for gs:// and s3:// URLs (what this module handles), False for local paths."""
  return isinstance(path, str) and _URL.match(path) is not None


def split(url: str) -> tuple[str, str, str]:
  """("gs" | "s3", bucket, key) of a URL; ConfigError for anything else."""
  match = _URL.match(url) if isinstance(url, str) else None
  if not match or not match.group("bucket"):
    raise ConfigError(f"{url!r} is not a bucket URL: write gs://BUCKET/PATH or s3://BUCKET/PATH")
  return match.group("scheme"), match.group("bucket"), match.group("key")


def path(where):
  """A path object for a local path or a bucket URL, with pathlib's API (`/`, is_file,
  read_bytes, read_text, stat, ...): etils' epath.Path for a URL (through gcsfs / s3fs, as
  orbax reads buckets), pathlib.Path otherwise, so local paths behave exactly as before."""
  import os
  import pathlib
  if is_url(where if isinstance(where, str) else None):
    from etils import epath
    return epath.Path(where)
  if type(where).__module__.startswith("etils"):
    return where
  return pathlib.Path(os.fspath(where))


def size(where) -> int:
  """Bytes of the file at a `path()` object (epath's stat calls it length, pathlib's st_size)."""
  stat = where.stat()
  return int(stat.st_size if hasattr(stat, "st_size") else stat.length)


# --- clients ---------------------------------------------------------------------------------

def _missing(extra: str, package: str) -> ConfigError:
  return ConfigError(f"{extra}:// paths need {package}: pip install 't5lite[{extra}]'")


@functools.lru_cache(maxsize=None)
def _gcs_client():
  try:
    from google.cloud import storage
  except ImportError:
    raise _missing("gcs", "google-cloud-storage") from None
  import google.auth.exceptions
  try:
    return storage.Client()
  except google.auth.exceptions.DefaultCredentialsError as e:
    raise ConfigError("no Google Cloud credentials for gs:// paths: run `gcloud auth "
                      "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS "
                      f"({' '.join(str(e).split())[:120]})") from None


@functools.lru_cache(maxsize=None)
def _s3_client():
  try:
    import boto3
    import botocore.config
  except ImportError:
    raise _missing("s3", "boto3") from None
  config = botocore.config.Config(retries={"mode": "standard", "max_attempts": RETRY_ATTEMPTS})
  return boto3.client("s3", config=config)


def forget_clients() -> None:
  """Drops the cached clients (they keep the endpoint and credentials they were made with)."""
  _gcs_client.cache_clear()
  _s3_client.cache_clear()


def _blob(url: str):
  _, bucket, key = split(url)
  return _gcs_client().bucket(bucket).blob(key)


def _s3_status(error) -> int:
  return int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _refused(url: str, error) -> ConfigError:
  """The one line for a bucket that is missing or refuses these credentials."""
  return ConfigError(f"{url}: {' '.join(str(error).split())[:200]} (check that the bucket "
                     "exists and that these credentials may read and write it)")


# --- versioned reads and conditional writes --------------------------------------------------

def read_versioned(url: str) -> tuple[bytes, Version] | None:
  """The object's bytes and version, or None if there is no such object."""
  scheme = split(url)[0]
  if scheme == "gs":
    from google.api_core import exceptions
    _, bucket, key = split(url)
    for _ in range(RETRY_ATTEMPTS):
      try:
        blob = _gcs_client().bucket(bucket).get_blob(key)
        if blob is None:
          return None
        # Only if still the generation just read: bytes and version of one write.
        return (blob.download_as_bytes(if_generation_match=blob.generation),
                int(blob.generation))
      except exceptions.PreconditionFailed:
        continue  # rewritten in between: read again
      except exceptions.NotFound:
        return None
      except exceptions.Forbidden as e:
        raise _refused(url, e) from None
    raise ConfigError(f"{url} kept changing while it was read ({RETRY_ATTEMPTS} tries)")
  import botocore.exceptions
  _, bucket, key = split(url)
  try:
    response = _s3_client().get_object(Bucket=bucket, Key=key)
  except botocore.exceptions.ClientError as e:
    if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
      return None
    raise _refused(url, e) from None
  return response["Body"].read(), response["ETag"]


def _write(url: str, data: bytes, version: Version | None) -> Version | None:
  """Writes data if the object is at `version` (0: absent); the new version, or None when
  the precondition failed."""
  scheme, bucket, key = split(url)
  if scheme == "gs":
    from google.api_core import exceptions
    blob = _blob(url)
    try:
      blob.upload_from_string(data, if_generation_match=int(version))
    except exceptions.PreconditionFailed:
      return None
    except (exceptions.NotFound, exceptions.Forbidden) as e:
      raise _refused(url, e) from None
    return int(blob.generation)
  import botocore.exceptions
  condition = {"IfNoneMatch": "*"} if version == 0 else {"IfMatch": version}
  try:
    response = _s3_client().put_object(Bucket=bucket, Key=key, Body=data, **condition)
  except botocore.exceptions.ClientError as e:
    # 412: the precondition failed; 409: a concurrent conditional write to the same key won.
    if _s3_status(e) in (412, 409):
      return None
    if version != 0 and e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
      return None  # If-Match on an object someone deleted
    raise _refused(url, e) from None
  return response["ETag"]


def create_exclusive(url: str, data: bytes) -> Version | None:
  """Creates the object only if none exists: its version, or None if one exists already
  (of two writers racing, exactly one gets a version)."""
  return _write(url, data, 0)


def replace_if(url: str, data: bytes, version: Version) -> Version | None:
  """Overwrites the object only if it is still at `version`: the new version, or None if it
  was written or deleted since."""
  if version == 0:
    raise ValueError("replace_if needs the version read or written last; 0 is create_exclusive")
  return _write(url, data, version)


def delete_if(url: str, version: Version) -> bool:
  """Deletes the object only if it is still at `version`. True if deleted."""
  scheme, bucket, key = split(url)
  if scheme == "gs":
    from google.api_core import exceptions
    current = _gcs_client().bucket(bucket).get_blob(key)
    if current is None or int(current.generation) != int(version):
      return False  # (also what the precondition below says; test servers may ignore it)
    try:
      current.delete(if_generation_match=int(version))
    except (exceptions.PreconditionFailed, exceptions.NotFound):
      return False
    return True
  import botocore.exceptions
  try:
    _s3_client().delete_object(Bucket=bucket, Key=key, IfMatch=version)
  except botocore.exceptions.ClientError as e:
    if _s3_status(e) in (404, 409, 412):
      return False
    raise _refused(url, e) from None
  return True


def copy(source: str, destination: str) -> None:
  """A server-side copy of one object (the bytes never leave the storage service), e.g. to set
  a damaged checkpoint aside where a local disk would rename its folder."""
  scheme, bucket, key = split(source)
  scheme_to, bucket_to, key_to = split(destination)
  if scheme != scheme_to:
    raise ValueError(f"cannot copy {source} to another kind of storage ({destination})")
  if scheme == "gs":
    client = _gcs_client()
    client.bucket(bucket).copy_blob(client.bucket(bucket).blob(key), client.bucket(bucket_to),
                                    key_to)
    return
  _s3_client().copy_object(Bucket=bucket_to, Key=key_to,
                           CopySource={"Bucket": bucket, "Key": key})


def check_writable(url: str, what: str) -> None:
  """Refuses (ConfigError, one line naming `what` and the URL) a bucket that does not exist
  or that these credentials cannot write, before anything is trained: writes and deletes a
  probe object under the URL."""
  import secrets
  probe = f"{url.rstrip('/')}/.t5lite-write-check-{secrets.token_hex(6)}"
  try:
    version = create_exclusive(probe, b"t5lite write check\n")
  except ConfigError as e:
    raise ConfigError(f"{what} {url} is not writable: {e}") from None
  if version is not None:
    delete_if(probe, version)
