"""TFRecord files without TensorFlow: read them, parse tf.train.Example, convert to array_record.

A TFRecord file is a sequence of records, each framed as
  uint64 length | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
(little-endian). Files ending in .gz are read as one gzip stream (TF's "GZIP" option).

Published TFDS data is mostly tfrecord, which has no index: converting it once to
array_record gives random access. Converted layout: one array_record file per input file
(".tfrecord" in the name becomes ".array_record"; or `num_shards` contiguous shards named
"{name}.array_record-00000-of-0000N"), written with group_size:1, each record the input
record's data unchanged (for TFDS and C4: a serialized tf.train.Example), in input order.
"""
from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from t5lite.data.sources import crc32c
from t5lite.data.sources.files import (ByteSpans, IndexedFileSource, Patterns, checked_index,
                               expand_patterns, read_buffer)
from t5lite.data.sources.tfrecord_example import parse_example
from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.util import staging
from t5lite.util.progress import Progress

_HEADER = struct.Struct("<QI")  # length, masked crc of the length
_CRC_BATCH_BYTES = 1 << 25  # verify data CRCs 32 MiB at a time
Parser = Callable[[bytes], dict[str, Any]]


def _check_length_crcs(path: str, data: np.ndarray, offsets: np.ndarray) -> None:
  """Compares the stored masked CRCs of the record lengths with computed ones."""
  headers = data[offsets[:, None] + np.arange(8)]
  stored = data[(offsets + 8)[:, None] + np.arange(4)].copy().view("<u4").ravel()
  bad = np.flatnonzero(crc32c.masked_crc32c_many([h.tobytes() for h in headers]) != stored)
  if len(bad):
    raise ConfigError(f"{path}: corrupted record length at offset {offsets[bad[0]]} "
                      "(length CRC mismatch)")


def _check_data_crcs(path: str, data: np.ndarray, offsets: np.ndarray, starts: np.ndarray,
                     ends: np.ndarray) -> None:
  """Compares the stored masked CRCs of the record data with computed ones (vectorized)."""
  stored = data[ends[:, None] + np.arange(4)].copy().view("<u4").ravel()
  # Batches of ~32 MiB bound the temporary copies of record data.
  batch = np.cumsum(ends - starts) // _CRC_BATCH_BYTES
  bounds = [0, *(np.flatnonzero(np.diff(batch)) + 1).tolist(), len(starts)]
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    records = [data[s:e].tobytes() for s, e in zip(starts[lo:hi], ends[lo:hi])]
    bad = np.flatnonzero(crc32c.masked_crc32c_many(records) != stored[lo:hi])
    if len(bad):
      raise ConfigError(f"{path}: corrupted record data at offset {offsets[lo + bad[0]]} "
                        "(data CRC mismatch)")


def tfrecord_index(path: str, buf: Any, *, verify_crc: bool = True) -> ByteSpans:
  """Walks a TFRecord file's framing, checking the lengths' CRCs (cheap: 8 bytes each)
  and, when verify_crc, the data CRCs.

  A truncated or corrupted file is a ValueError naming the file and the record's offset.
  """
  size, pos = len(buf), 0
  offsets, lengths = [], []
  while pos < size:
    if pos + _HEADER.size > size:
      raise ConfigError(f"{path}: truncated record header at offset {pos} "
                        f"(file ends at byte {size})")
    length, length_crc = _HEADER.unpack_from(buf, pos)
    end = pos + _HEADER.size + length + 4
    if end > size:
      if crc32c.masked_crc32c(bytes(buf[pos:pos + 8])) != length_crc:
        raise ConfigError(f"{path}: corrupted record length at offset {pos} "
                          "(length CRC mismatch)")
      raise ConfigError(f"{path}: truncated record at offset {pos}: {length} data bytes "
                        f"announced, file ends at byte {size}")
    offsets.append(pos)
    lengths.append(length)
    pos = end
  offsets = np.array(offsets, dtype=np.int64)
  starts = offsets + _HEADER.size
  ends = starts + np.array(lengths, dtype=np.int64)
  if len(offsets):
    data = np.frombuffer(buf, dtype=np.uint8)
    _check_length_crcs(path, data, offsets)
    if verify_crc:
      _check_data_crcs(path, data, offsets, starts, ends)
  return ByteSpans(starts, ends)


def read_tfrecord(path: str, *, verify_crc: bool = True) -> list[bytes]:
  """All record payloads of one TFRecord file, in order."""
  buf = read_buffer(path)
  index = tfrecord_index(path, buf, verify_crc=verify_crc)
  return [bytes(buf[s:e]) for s, e in zip(index.starts.tolist(), index.ends.tolist())]


class TfRecordSource(IndexedFileSource):
  """Random access to the records of TFRecord files, parsed as tf.train.Example.

  The offsets of all records are found once (first use), checking every CRC (the data
  CRCs unless verify_crc=False). Examples come from `parse_example(data, decode_text, squeeze)`, or
  from `parser(data)` for records that are not tf.train.Example.
  """

  def __init__(self, patterns: Patterns, *, verify_crc: bool = True, decode_text: bool = True,
               squeeze: bool = True, parser: Parser | None = None):
    super().__init__(patterns)
    self.verify_crc, self.decode_text, self.squeeze, self.parser = (
        verify_crc, decode_text, squeeze, parser)

  def _index_file(self, path: str, buf: Any) -> ByteSpans:
    return tfrecord_index(path, buf, verify_crc=self.verify_crc)

  def _example(self, file_id: int, index: int) -> dict[str, Any]:
    ix = self._indexes[file_id]
    data = bytes(self._buffer(file_id)[int(ix.starts[index]):int(ix.ends[index])])
    if self.parser is not None:
      return self.parser(data)
    return parse_example(data, decode_text=self.decode_text, squeeze=self.squeeze)


class ArrayRecordSource:
  """Random access to array_record files of serialized tf.train.Example (as converted here).

  Also reads the array_record shards of a TFDS dataset directory directly.
  """

  def __init__(self, patterns: Patterns, *, decode_text: bool = True, squeeze: bool = True,
               parser: Parser | None = None):
    self._patterns = patterns
    self.decode_text, self.squeeze, self.parser = decode_text, squeeze, parser
    self._source = None

  def _open(self):
    """The array_record data source (opened once per process)."""
    if self._source is None:
      from array_record.python import array_record_data_source as ards  # pylint: disable=import-outside-toplevel
      # array_record reads local files only: shards in a bucket are copied to local disk once.
      files = [staging.local_copy(f) for f in expand_patterns(self._patterns)]
      source = ards.ArrayRecordDataSource(files)
      if not len(source):
        raise ConfigError(f"{self!r} has no examples: these files are empty: {files}")
      self._source = source
    return self._source

  @property
  def files(self) -> list[str]:
    """The matched files (as named: bucket URLs stay URLs)."""
    return expand_patterns(self._patterns)

  def __len__(self) -> int:
    return len(self._open())

  def __getitem__(self, index: int) -> dict[str, Any]:
    source = self._open()
    data = source[checked_index(index, len(source), self)]
    if self.parser is not None:
      return self.parser(data)
    return parse_example(data, decode_text=self.decode_text, squeeze=self.squeeze)

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_source": None}

  def __repr__(self) -> str:
    return f"ArrayRecordSource({self._patterns!r})"


def _array_record_name(path: str) -> str:
  """'c4-train.tfrecord-00000-of-01024' -> 'c4-train.array_record-00000-of-01024'."""
  base = os.path.basename(path)
  base = base[:-3] if base.endswith(".gz") else base
  if re.search(r"tfrecords?", base):
    return re.sub(r"tfrecords?", "array_record", base, count=1)
  return base + ".array_record"


def _write_array_record(path: str, records: Sequence[bytes]) -> None:
  """Writes records to `path` atomically (a temporary name, then a rename)."""
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=import-outside-toplevel
  tmp = f"{path}.incomplete-{os.getpid()}"
  writer = ArrayRecordWriter(tmp, "group_size:1")  # group_size 1: one record per read
  for record in records:
    writer.write(record)
  writer.close()
  os.replace(tmp, path)


def convert_tfrecord_to_array_record(patterns: Patterns, output_dir: str, *,
                                     num_shards: int | None = None, name: str = "data",
                                     verify_crc: bool = True) -> list[str]:
  """Copies TFRecord records, unchanged and in order, into array_record files.

  num_shards=None writes one output per input file (names: see the module docstring);
  otherwise `num_shards` files of contiguous, near-equal record ranges. Returns the
  written paths, in order. Holds one input file's records in memory at a time (all of
  them when resharding).
  """
  files = expand_patterns(patterns)
  os.makedirs(output_dir, exist_ok=True)
  if num_shards is None:
    outputs = [os.path.join(output_dir, _array_record_name(f)) for f in files]
    if len(set(outputs)) != len(outputs):
      raise ConfigError(f"input files {files} map to clashing output names; pass num_shards")
    with Progress("convert tfrecord -> array_record", len(files), "file") as bar:
      for src, dst in zip(files, outputs):
        _write_array_record(dst, read_tfrecord(src, verify_crc=verify_crc))
        bar.update()
    return outputs
  records = [r for f in files for r in read_tfrecord(f, verify_crc=verify_crc)]
  bounds = [len(records) * i // num_shards for i in range(num_shards + 1)]
  outputs = [os.path.join(output_dir, f"{name}.array_record-{i:05d}-of-{num_shards:05d}")
             for i in range(num_shards)]
  with Progress("convert tfrecord -> array_record", num_shards, "shard") as bar:
    for i, dst in enumerate(outputs):
      _write_array_record(dst, records[bounds[i]:bounds[i + 1]])
      bar.update()
  return outputs


def convert_tfds_dataset_to_array_record(dataset_dir: str, *, verify_crc: bool = True) -> None:
  """Makes a tfrecord TFDS dataset readable by TfdsSource, without TensorFlow.

  dataset_dir is DATA_DIR/NAME[/CONFIG]/VERSION. Each "*.tfrecord-XXXXX-of-YYYYY" shard
  gets an "*.array_record-XXXXX-of-YYYYY" twin beside it (same records, same order, so
  the split's shard lengths still hold) and "array_record" is added to the dataset
  info's alternative file formats, which `tfds` uses for random access.
  """
  shards = sorted(f for f in os.listdir(dataset_dir) if re.search(r"\.tfrecord-\d+-of-\d+$", f))
  if not shards:
    raise ConfigFileNotFoundError(f"no '*.tfrecord-XXXXX-of-YYYYY' shards in {dataset_dir}")
  with Progress(f"convert {dataset_dir} to array_record", len(shards), "shard") as bar:
    for shard in shards:
      _write_array_record(os.path.join(dataset_dir, _array_record_name(shard)),
                          read_tfrecord(os.path.join(dataset_dir, shard), verify_crc=verify_crc))
      bar.update()
  info_path = os.path.join(dataset_dir, "dataset_info.json")
  with open(info_path, encoding="utf-8") as f:
    info = json.load(f)
  formats = info.setdefault("alternativeFileFormats", [])
  if info.get("fileFormat") != "array_record" and "array_record" not in formats:
    formats.append("array_record")
    with open(info_path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(info, f, indent=2)
    os.replace(info_path + ".tmp", info_path)
