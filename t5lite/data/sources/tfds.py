"""TFDS datasets without TensorFlow: read array_record builders, and make one from local data.

`TfdsSource` wraps `tfds.data_source` (random access, split slices like "train[:10%]").
`prepare_tfds_dataset` stores Python examples as a TFDS array_record dataset, with a
`GeneratorBasedBuilder` made at runtime (tfds's own `store_as_tfds_dataset` touches
TensorFlow and `importlib_resources`, neither of which we install).

  prepare_tfds_dataset("demo", {"train": [{"text": "a"}, {"text": "b"}]}, "/data",
                       features={"text": "text"})
  TfdsSource("demo", "train[:50%]", data_dir="/data")[0]  # -> {"text": "a"}
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from t5lite.util import atomic, paths, progress, staging
from t5lite.data.sources.files import checked_index
from t5lite.errors import ConfigError, ConfigFileNotFoundError

_PREPARE_HINT = (
    "Prepare it once in the array_record format: from local data with "
    "t5lite.data.sources.tfds.prepare_tfds_dataset(...), or for a catalog dataset with "
    "`tfds build NAME --file_format=array_record --data_dir=DIR` (its build may need "
    "TensorFlow, elsewhere). Data prepared as tfrecord needs a one-time conversion: "
    "t5lite.data.sources.tfrecord.convert_tfds_dataset_to_array_record(VERSION_DIR).")


def _tfds():
  """tensorflow_datasets, imported on first use (it takes ~0.5 s)."""
  import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
  return tfds


def _text_keys(features: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
  """Paths of the `Text` features in a (nested) FeaturesDict."""
  tfds = _tfds()
  if isinstance(features, tfds.features.Text):
    return [prefix]
  if isinstance(features, tfds.features.FeaturesDict):
    return [p for k, f in features.items() for p in _text_keys(f, prefix + (k,))]
  if isinstance(features, tfds.features.Sequence) and isinstance(
      features.feature, tfds.features.Text):
    return [prefix]
  return []


def _decode(value: Any) -> Any:
  """bytes -> str; an array of bytes -> list of str."""
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray) and value.dtype == object:
    return [_decode(v) for v in value]
  return value


def _local_data_dir(name: str, data_dir: str | None) -> str | None:
  """data_dir itself, or for a bucket URL its local copy (staging.local_copy) holding the
  version folder TFDS picks for `name` there: array_record reads local files only."""
  if not paths.is_url(data_dir):
    return data_dir
  remote = _tfds().builder(name, data_dir=data_dir)  # TFDS resolves config and version
  version_dir = os.fspath(remote.data_dir)
  if not version_dir.startswith(data_dir.rstrip("/") + "/"):
    raise ConfigError(f"TFDS placed {name!r} at {version_dir}, outside data_dir={data_dir!r}")
  names = paths.files_under(version_dir)
  if not names:
    raise ConfigFileNotFoundError(f"TFDS dataset {name!r} is not prepared in "
                                  f"data_dir={data_dir!r} (looked in {version_dir}). "
                                  f"{_PREPARE_HINT}")
  for rel in names:
    staging.local_copy(paths.join(version_dir, rel))
  return staging.cache_path(data_dir)


class TfdsSource:
  """Random access to a prepared TFDS array_record dataset; Text features come back as str.

  name is "dataset[/config][:version]"; split can be sliced ("train[:10%]", "train[5:]").
  Nothing is downloaded: a dataset that is not prepared in `data_dir` is an error saying
  how to prepare it.
  """

  def __init__(self, name: str, split: str = "train", data_dir: str | None = None,
               decoders: Mapping[str, Any] | None = None):
    self.name, self.split, self.data_dir, self.decoders = name, split, data_dir, decoders
    self._source = None
    self._text_keys: list[tuple[str, ...]] = []

  def _open(self):
    """The tfds data source, built once per process."""
    if self._source is not None:
      return self._source
    tfds = _tfds()
    where = f"data_dir={self.data_dir!r}" if self.data_dir else "the default TFDS data_dir"
    try:
      builder = tfds.builder(self.name, data_dir=_local_data_dir(self.name, self.data_dir))
    except tfds.core.registered.DatasetNotFoundError:
      raise ConfigFileNotFoundError(f"TFDS dataset {self.name!r} is neither in {where} nor in "
                                    "the TFDS catalog (check its name, config and version). "
                                    f"{_PREPARE_HINT}") from None
    if not builder.is_prepared():
      raise ConfigFileNotFoundError(f"TFDS dataset {self.name!r} is not prepared in {where} "
                                    f"(looked in {builder.data_dir}). {_PREPARE_HINT}")
    formats = {f.value for f in builder.info.available_file_formats()}
    if "array_record" not in formats:
      raise ConfigError(f"TFDS dataset {self.name!r} in {builder.data_dir} is stored as "
                        f"{sorted(formats)}; random access needs array_record. {_PREPARE_HINT}")
    self._source = builder.as_data_source(split=self.split, decoders=self.decoders,
                                          file_format="array_record")
    self._text_keys = _text_keys(builder.info.features)
    return self._source

  def __len__(self) -> int:
    return len(self._open())

  def __getitem__(self, index: int) -> dict[str, Any]:
    source = self._open()
    example = source[checked_index(index, len(source), self)]
    for path in self._text_keys:
      parent = example
      for key in path[:-1]:
        parent = parent.get(key, {})
      if path[-1] in parent:
        parent[path[-1]] = _decode(parent[path[-1]])
    return example

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_source": None}  # reopen in each worker process

  def __repr__(self) -> str:
    data_dir = f", data_dir={self.data_dir!r}" if self.data_dir else ""
    return f"TfdsSource({self.name!r}, split={self.split!r}{data_dir})"


def _feature(kind: Any):
  """A tfds FeatureConnector from a short name.

  "text" -> Text; "bytes" -> scalar bytes; "int32", "int64", "float32", "bool", ... ->
  Scalar; "int32[]" -> a 1-D Tensor of any length. A FeatureConnector passes through.
  """
  tfds = _tfds()
  if not isinstance(kind, str):
    return kind
  if kind == "text":
    return tfds.features.Text()
  if kind == "bytes":
    return tfds.features.Tensor(shape=(), dtype=np.object_)
  dtype = kind[:-2] if kind.endswith("[]") else kind
  try:
    np_dtype = np.dtype(dtype)
  except TypeError:
    raise ConfigError(f"unknown feature kind {kind!r}: use 'text', 'bytes', a numpy dtype "
                      "name like 'int32', or 'int32[]' for a variable-length vector") from None
  if kind.endswith("[]"):
    return tfds.features.Tensor(shape=(None,), dtype=np_dtype)
  return tfds.features.Scalar(dtype=np_dtype)


def _builder_class(name: str, version: str, features: Any,
                   split_examples: Mapping[str, Iterable[dict]], description: str):
  """A GeneratorBasedBuilder subclass that writes the given examples in the given order."""
  tfds = _tfds()

  class Builder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Builder made at runtime by t5lite.data.sources.tfds.prepare_tfds_dataset."""
    VERSION = tfds.core.Version(version)
    RELEASE_NOTES = {version: description}
    # tfds looks for a checksums file beside the builder's code via importlib_resources,
    # a package missing on Python >= 3.9 installs; this builder downloads nothing.
    code_path = None

    def _info(self):
      # disable_shuffling keeps the given order: example i of a split is the i-th given.
      return tfds.core.DatasetInfo(builder=self, description=description, features=features,
                                   disable_shuffling=True)

    def _split_generators(self, dl_manager):
      del dl_manager
      return {split: self._generate_examples(examples)
              for split, examples in split_examples.items()}

    def _generate_examples(self, examples):
      for i, example in enumerate(examples):
        yield i, example

  Builder.name = name
  Builder.__name__ = Builder.__qualname__ = f"Builder_{name}"
  return Builder


def prepare_tfds_dataset(name: str, split_examples: Mapping[str, Iterable[dict]],
                         data_dir: str, features: Mapping[str, Any], version: str = "1.0.0",
                         *, description: str = "Local data stored by t5lite.") -> None:
  """Stores local examples as a TFDS array_record dataset in DATA_DIR/NAME/VERSION.

  Deterministic (split order as given, no shuffling) and offline; a no-op when that
  version is already prepared. `features` maps each key to a kind ("text", "int32",
  "int32[]", ...; see `_feature`). Read it back with TfdsSource(name, split, data_dir).
  Atomic: a killed build leaves nothing that looks prepared, and the next call rebuilds.
  """
  tfds = _tfds()
  if not split_examples:
    raise ConfigError("prepare_tfds_dataset: no splits given")
  feature_dict = tfds.features.FeaturesDict({k: _feature(v) for k, v in features.items()})
  builder_cls = _builder_class(name, version, feature_dict, split_examples, description)
  version_dir = builder_cls(data_dir=os.fspath(data_dir), file_format="array_record").data_dir

  def build(staging: str) -> None:
    # tfds renames its own `incomplete.*` folder into place, but a killed build leaves that
    # folder in data_dir, and two builders at once collide; so tfds builds in a private
    # folder, which becomes DATA_DIR/NAME/VERSION in one rename.
    staged = builder_cls(data_dir=staging, file_format="array_record")
    # Nothing is downloaded; keep tfds's empty downloads/ folder out of data_dir.
    with tempfile.TemporaryDirectory() as download_dir, progress.stage(
        f"building the {name} dataset (once) in {data_dir}"):
      staged.download_and_prepare(download_dir=download_dir)
    for entry in os.listdir(staged.data_dir):
      os.rename(os.path.join(staged.data_dir, entry), os.path.join(staging, entry))
    shutil.rmtree(os.path.join(staging, name))

  atomic.build_dir(version_dir, build, is_prepared_dir)


def is_prepared_dir(version_dir: str) -> bool:
  """Whether DATA_DIR/NAME/VERSION holds a whole array_record dataset: its dataset_info.json
  and every shard that it lists."""
  try:
    with open(os.path.join(version_dir, "dataset_info.json"), encoding="utf-8") as f:
      info = json.load(f)
    for split in info["splits"]:
      count = len(split.get("shardLengths", []))
      for i in range(count):
        shard = f"{info['name']}-{split['name']}.array_record-{i:05d}-of-{count:05d}"
        if not os.path.isfile(os.path.join(version_dir, shard)):
          return False
  except (OSError, ValueError, KeyError, TypeError):  # missing, half written, not tfds's
    return False
  return True
