"""Streamed sources: examples read shard by shard, in file order, never a whole file at once.

For corpora bigger than memory (C4's 1,024 `json.gz` shards, Parquet or Arrow exports, HF
datasets): a streamed source only says how many shards it has and reads one shard's records
from a position. Memory is one decompressor and one read buffer per open shard, whatever the
corpus size. The pipeline (t5lite.data.stream_rows) gives each batch row its own shards and
shuffles within a bounded window; `t5lite cache` converts a streamed task to array_record
when random access pays.

  src = JsonlStream("c4/en/c4-train.*-of-01024.json.gz", text_fields=("text",))
  src.num_shards                 # 1024
  next(src.examples(0))          # {"text": "Beginners BBQ Class ...", "url": ...}

Compression is read from the file name: .gz (gzip), .bz2, .xz (standard library), .zst
(the `zstandard` package). Objects in a bucket (gs://, s3://) are read as a stream through
fsspec, never downloaded whole.
"""
from __future__ import annotations

import abc
import bz2
import contextlib
import gzip
import io
import itertools
import json
import lzma
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from t5lite.data.sources import crc32c
from t5lite.data.sources.files import Patterns, expand_patterns
from t5lite.data.sources.readers import check_text_fields, json_example, parquet_file
from t5lite.data.sources.tfrecord_example import parse_example
from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.util import paths

_READ_BUFFER = 1 << 20  # bytes buffered per open shard
_BATCH_ROWS = 1024  # Parquet rows decoded at a time per open shard


@contextlib.contextmanager
def open_stream(path: str):
  """A binary stream of a file's decompressed bytes (compression from its suffix); the file
  and the decompressor are both closed when the block ends."""
  raw = paths.open_binary(path) if paths.is_url(path) else open(path, "rb", buffering=_READ_BUFFER)
  with raw:
    if path.endswith(".gz"):
      stream = gzip.GzipFile(fileobj=raw, mode="rb")
    elif path.endswith(".bz2"):
      stream = bz2.BZ2File(raw, "rb")
    elif path.endswith(".xz"):
      stream = lzma.LZMAFile(raw, "rb")
    elif path.endswith((".zst", ".zstd")):
      try:
        import zstandard  # pylint: disable=import-outside-toplevel
      except ImportError:
        raise ConfigError(f"{path} is zstd-compressed: pip install zstandard to read it"
                          ) from None
      stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), _READ_BUFFER)
    else:
      yield raw
      return
    with stream:
      yield stream


class StreamingSource(abc.ABC):
  """Examples of shards read in order. Subclasses implement `_records(shard, start)` (raw
  records from the start-th on, cheap: not parsed) and `_parse(record, shard, number)`.

  num_examples: the number of examples, where the files do not say it cheaply (lines of
  compressed text); only mixtures with `rate_num_examples` ask for it.
  """
  streaming = True  # the pipeline reads it as a stream, not by index

  def __init__(self, patterns: Patterns, num_examples: int | None = None):
    self._patterns, self.num_examples = patterns, num_examples
    self._files: list[str] | None = None

  @property
  def files(self) -> list[str]:
    if self._files is None:
      self._files = expand_patterns(self._patterns)
    return self._files

  @property
  def num_shards(self) -> int:
    return len(self.files)

  @abc.abstractmethod
  def _records(self, shard: int, start: int) -> Iterator[Any]:
    """The shard's raw records from the start-th (0-based) on."""

  @abc.abstractmethod
  def _parse(self, record: Any, shard: int, number: int) -> dict[str, Any]:
    """A raw record (the number-th of its shard) as an example."""

  def examples(self, shard: int, *, stride: int = 1, offset: int = 0,
               skip: int = 0) -> Iterator[dict[str, Any]]:
    """The shard's examples offset, offset + stride, offset + 2 stride, ..., after the first
    `skip` of those: only the examples returned are parsed."""
    if not 0 <= shard < self.num_shards:
      raise IndexError(f"shard {shard} out of range for {self!r} with {self.num_shards} shards")
    start = offset + stride * skip
    records = self._records(shard, start)
    for k, record in enumerate(itertools.islice(records, 0, None, stride)):
      yield self._parse(record, shard, start + k * stride)

  def _count(self) -> int | None:
    """The number of examples when the files hold it (metadata), else None."""
    return None

  def __len__(self) -> int:
    if self.num_examples is None:
      self.num_examples = self._count()
    if self.num_examples is None:
      raise ConfigError(f"{self!r} does not know its number of examples without reading every "
                        "file: give it num_examples=N (a mixture's rate_num_examples needs it)")
    return self.num_examples

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self._patterns!r})"


class TextLineStream(StreamingSource):
  """One example {field: line} per non-empty line, BOM and "\\r\\n" dropped."""

  def __init__(self, patterns: Patterns, field: str = "text", *,
               num_examples: int | None = None):
    super().__init__(patterns, num_examples)
    self.field = field

  def _records(self, shard: int, start: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the non-empty lines."""
    path = self.files[shard]
    with open_stream(path) as f:
      lines = ((n, line.rstrip(b"\r\n")) for n, line in enumerate(f, 1))
      yield from itertools.islice(((n, line) for n, line in lines if line.strip(b"\r\n")),
                                  start, None)

  def _text(self, record: tuple[int, bytes], shard: int) -> str:
    number, line = record
    try:
      text = line.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ConfigError(f"{self.files[shard]}:{number}: invalid UTF-8 ({e.reason} at byte "
                        f"{e.start} of the line)") from None
    return text[1:] if number == 1 and text.startswith("\ufeff") else text

  def _parse(self, record, shard: int, number: int) -> dict[str, Any]:
    return {self.field: self._text(record, shard)}


class JsonlStream(TextLineStream):
  """One JSON object per line (.jsonl, C4's .json.gz); text_fields as JsonlSource's."""

  def __init__(self, patterns: Patterns, text_fields: Sequence[str] = (), *,
               num_examples: int | None = None):
    super().__init__(patterns, num_examples=num_examples)
    self.text_fields = (text_fields,) if isinstance(text_fields, str) else tuple(text_fields)

  def _parse(self, record, shard: int, number: int) -> dict[str, Any]:
    return json_example(self._text(record, shard), lambda: f"{self.files[shard]}:{record[0]}",
                        self.text_fields)


class TfRecordStream(StreamingSource):
  """TFRecord files (.gz ok) read record by record, CRCs checked; records parsed as
  tf.train.Example unless `parser` is given."""
  _header = struct.Struct("<QI")

  def __init__(self, patterns: Patterns, *, decode_text: bool = True, squeeze: bool = True,
               parser=None, num_examples: int | None = None):
    super().__init__(patterns, num_examples)
    self.decode_text, self.squeeze, self.parser = decode_text, squeeze, parser

  def _records(self, shard: int, start: int) -> Iterator[bytes]:
    path = self.files[shard]
    with open_stream(path) as f:
      for number in itertools.count():
        offset = f.tell()
        header = f.read(self._header.size)
        if not header:
          return
        where = f"{path}: record {number} at offset {offset}"
        if len(header) < self._header.size:
          raise ConfigError(f"{where}: truncated record header")
        length, length_crc = self._header.unpack(header)
        if crc32c.masked_crc32c(header[:8]) != length_crc:
          raise ConfigError(f"{where}: corrupted record length (length CRC mismatch)")
        body = f.read(length + 4)
        if len(body) < length + 4:
          raise ConfigError(f"{where}: truncated record ({length} data bytes announced)")
        if number >= start:  # earlier records are skipped, their framing still checked
          data = body[:length]
          if crc32c.masked_crc32c(data) != struct.unpack("<I", body[length:])[0]:
            raise ConfigError(f"{where}: corrupted record data (data CRC mismatch)")
          yield data

  def _parse(self, record: bytes, shard: int, number: int) -> dict[str, Any]:
    if self.parser is not None:
      return self.parser(record)
    return parse_example(record, decode_text=self.decode_text, squeeze=self.squeeze)


def _row(columns: dict[str, list], i: int) -> dict[str, Any]:
  """Row i of a decoded batch; lists come back as numpy arrays (as ParquetSource's)."""
  return {k: np.asarray(v[i]) if isinstance(v[i], list) else v[i] for k, v in columns.items()}


class _ColumnarStream(StreamingSource):
  """Shards of record batches (Parquet, Arrow): one batch decoded at a time."""

  def __init__(self, patterns: Patterns, columns: Sequence[str] | None = None, *,
               num_examples: int | None = None, text_fields: Sequence[str] = ()):
    super().__init__(patterns, num_examples)
    self.columns = None if columns is None else list(columns)
    self.text_fields = (text_fields,) if isinstance(text_fields, str) else tuple(text_fields)

  @abc.abstractmethod
  def _batches(self, shard: int, start: int) -> Iterator[tuple[int, Any]]:
    """(first row number, pyarrow batch) of the shard's batches, from the one holding row
    start on (whole batches before it may be skipped without decoding)."""

  def _records(self, shard: int, start: int) -> Iterator[dict[str, Any]]:
    for first, batch in self._batches(shard, start):
      if first + batch.num_rows <= start:
        continue
      if self.columns is not None:
        missing = [c for c in self.columns if c not in batch.schema.names]
        if missing:
          raise ConfigError(f"{self.files[shard]} has no column {missing[0]!r} (columns: "
                            f"{batch.schema.names})")
        batch = batch.select(self.columns)
      columns = batch.to_pydict()
      for i in range(max(0, start - first), batch.num_rows):
        yield _row(columns, i)

  def _parse(self, record: dict[str, Any], shard: int, number: int) -> dict[str, Any]:
    return check_text_fields(record, lambda: f"{self.files[shard]}: row {number + 1}",
                             self.text_fields)


class ParquetStream(_ColumnarStream):
  """Parquet files read 1,024 rows at a time (pyarrow); rows before a resume position are
  skipped by whole row groups, from the footer's counts."""

  def _open(self, shard: int):
    return parquet_file(self.files[shard])

  def _batches(self, shard: int, start: int):
    parquet = self._open(shard)
    first = 0
    for group in range(parquet.metadata.num_row_groups):
      rows = parquet.metadata.row_group(group).num_rows
      if first + rows > start:
        # At most _BATCH_ROWS rows decoded at a time: writers' row groups reach a million rows.
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group],
                                          columns=self.columns):
          yield first, batch
          first += batch.num_rows
      else:
        first += rows

  def _count(self) -> int:
    return sum(self._open(s).metadata.num_rows for s in range(self.num_shards))


class ArrowStream(_ColumnarStream):
  """Arrow IPC stream files, as HF `datasets` writes them (`Dataset.save_to_disk` folders,
  the cache's `*.arrow`): give the folder, or the files' glob. Batches are read one at a time
  through a memory map, so a batch's pages are read only when its rows are."""

  def __init__(self, patterns: Patterns, columns: Sequence[str] | None = None, *,
               num_examples: int | None = None, text_fields: Sequence[str] = ()):
    if isinstance(patterns, (str, os.PathLike)) and os.path.isdir(os.path.expanduser(patterns)):
      patterns = _saved_dataset_files(os.path.expanduser(os.fspath(patterns)))
    super().__init__(patterns, columns, num_examples=num_examples, text_fields=text_fields)

  def _reader(self, shard: int):
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    path = self.files[shard]
    return pa.ipc.open_stream(paths.open_binary(path) if paths.is_url(path) else
                              pa.memory_map(path))

  def _batches(self, shard: int, start: int):
    first = 0
    for batch in self._reader(shard):
      yield first, batch
      first += batch.num_rows

  def _count(self) -> int:
    return sum(batch.num_rows for s in range(self.num_shards) for batch in self._reader(s))


def _saved_dataset_files(folder: str) -> list[str]:
  """The Arrow files of a `Dataset.save_to_disk` folder, in the order its state.json lists."""
  state = os.path.join(folder, "state.json")
  if not os.path.exists(state):
    raise ConfigFileNotFoundError(f"{folder} is not a saved HF dataset (no state.json): give "
                                  "a folder written by Dataset.save_to_disk, or a glob of "
                                  ".arrow files")
  with open(state, encoding="utf-8") as f:
    files = [entry["filename"] for entry in json.load(f)["_data_files"]]
  return [os.path.join(folder, name) for name in files]


class HfStream(StreamingSource):
  """An HF `datasets` dataset read with `load_dataset(..., streaming=True)`: the builders'
  own formats (json, parquet, csv, text, arrow, a dataset folder's scripts-free layout), from
  local files or bucket URLs (fsspec). Shards are the dataset's own (`n_shards`: its files).

  Example: HfStream("json", data_files="corpus/*.jsonl.gz", split="train",
  text_fields=("text",)) (text_fields as JsonlSource's: a null there names the shard and row).
  Needs the `datasets` package (pip install t5lite[hf-datasets]).
  """

  def __init__(self, path: str, *, split: str = "train", data_files=None,
               num_examples: int | None = None, text_fields: Sequence[str] = (), **load_kwargs):
    super().__init__(data_files if data_files is not None else path, num_examples)
    self.path, self.split, self.data_files, self.load_kwargs = path, split, data_files, load_kwargs
    self.text_fields = (text_fields,) if isinstance(text_fields, str) else tuple(text_fields)
    self._dataset = None

  def _load(self):
    if self._dataset is None:
      try:
        import datasets  # pylint: disable=import-outside-toplevel
      except ImportError:
        raise ConfigError(f"{self!r} needs the datasets package: pip install "
                          "t5lite[hf-datasets]") from None
      self._dataset = datasets.load_dataset(self.path, data_files=self.data_files,
                                            split=self.split, streaming=True, **self.load_kwargs)
    return self._dataset

  @property
  def files(self) -> list[str]:
    return [f"{self.path}[{i}]" for i in range(self.num_shards)]

  @property
  def num_shards(self) -> int:
    return self._load().num_shards

  def _records(self, shard: int, start: int):
    part = self._load().shard(num_shards=self.num_shards, index=shard, contiguous=True)
    return iter(part.skip(start) if start else part)

  def _parse(self, record: dict[str, Any], shard: int, number: int) -> dict[str, Any]:
    example = {k: np.asarray(v) if isinstance(v, list) else v for k, v in record.items()}
    return check_text_fields(example, lambda: f"{self.files[shard]}: row {number + 1}",
                             self.text_fields)

  def __getstate__(self) -> dict[str, Any]:
    return {**self.__dict__, "_dataset": None}

  def __repr__(self) -> str:
    return f"HfStream({self.path!r}, split={self.split!r}, data_files={self.data_files!r})"
