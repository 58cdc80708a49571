"""Data sources: deterministic random access to raw examples, without TensorFlow.

Every source follows grain's `RandomAccessDataSource` protocol (`len(src)`, `src[i] -> dict`)
and returns dicts of Python str / numbers / numpy arrays. File sources expand their globs
in sorted order and index lazily on first use, so tasks can be registered at import time
for free and a source pickles cheaply into grain workers (open files are not pickled).

  src = JsonlSource("data/c4-train.*-of-01024.json.gz")
  src[0]  # -> {"text": "Beginners BBQ Class ...", "timestamp": "...", "url": "..."}

TFDS datasets: `TfdsSource` (tfds.py). TFRecord files: tfrecord.py. Corpora bigger
than memory, read shard by shard instead of by index: streams.py.
"""
from __future__ import annotations

import gzip
import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from t5lite.data.sources.files import (ByteSpans, IndexedFileSource, Patterns, checked_index,
                                       line_number, line_spans)
from t5lite.data.sources.files import expand_patterns, read_buffer  # noqa: F401 (re-export)
from t5lite.data.sources.tfds import TfdsSource, prepare_tfds_dataset  # noqa: F401 (re-export)
from t5lite.errors import ConfigError
from t5lite.util import paths


class TextLineSource(IndexedFileSource):
  """One example {field: line} per non-empty line ("\\n" or "\\r\\n" endings, .gz ok).

  The index holds two int64 offsets per line, not the text: random access is O(1).
  """

  def __init__(self, patterns: Patterns, field: str = "text", *, skip_header: bool = False):
    super().__init__(patterns)
    self.field = field
    self.skip_header = skip_header

  def _index_file(self, path: str, buf: Any) -> ByteSpans:
    starts, ends = line_spans(buf)
    if self.skip_header:  # the header is the first non-empty line
      starts, ends = starts[1:], ends[1:]
    return ByteSpans(starts, ends)

  def _line(self, file_id: int, index: int) -> str:
    """The decoded line; bad UTF-8 names the file and line number."""
    spans = self._indexes[file_id]
    buf = self._buffer(file_id)
    start, end = int(spans.starts[index]), int(spans.ends[index])
    try:
      text = bytes(buf[start:end]).decode("utf-8")
    except UnicodeDecodeError as e:
      raise ConfigError(f"{self.files[file_id]}:{line_number(buf, start)}: invalid UTF-8 "
                        f"({e.reason} at byte {e.start} of the line)") from None
    return text[1:] if start == 0 and text.startswith("\ufeff") else text  # drop a BOM

  def _where(self, file_id: int, index: int) -> str:
    """'FILE:LINE' of an example, for error messages."""
    start = int(self._indexes[file_id].starts[index])
    return f"{self.files[file_id]}:{line_number(self._buffer(file_id), start)}"

  def _example(self, file_id: int, index: int) -> dict[str, Any]:
    return {self.field: self._line(file_id, index)}

  def _repr_args(self) -> str:
    return f"{self._patterns!r}, field={self.field!r}"


class JsonlSource(TextLineSource):
  """One example per line holding a JSON object (.jsonl, .jsonl.gz, C4's .json.gz).

  Values come back as `json` parses them (str, numbers, lists, dicts, None). text_fields
  names the fields the task reads as text: a row without one, or with a number or null
  there, is a ConfigError naming the file, line and field (found later, a preprocessor
  could only say "KeyError", or encode the text "None").
  """

  def __init__(self, patterns: Patterns, text_fields: Sequence[str] = ()):
    super().__init__(patterns)
    self.text_fields = (text_fields,) if isinstance(text_fields, str) else tuple(text_fields)

  def _example(self, file_id: int, index: int) -> dict[str, Any]:
    return json_example(self._line(file_id, index), lambda: self._where(file_id, index),
                        self.text_fields)

  def _repr_args(self) -> str:
    fields = f", text_fields={self.text_fields!r}" if self.text_fields else ""
    return repr(self._patterns) + fields


def json_example(line: str, where: Callable[[], str], text_fields: Sequence[str]) -> dict:
  """A JSON line parsed into an example dict, its text fields checked; errors start with
  where() ('FILE:LINE', computed only on error)."""
  try:
    example = json.loads(line)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{where()}: invalid JSON ({e.msg} at column {e.colno})") from None
  except RecursionError:
    raise ConfigError(f"{where()}: JSON nested too deeply to read (thousands of levels)"
                      ) from None
  if not isinstance(example, dict):
    raise ConfigError(f"{where()}: expected a JSON object, got {type(example).__name__}")
  return check_text_fields(example, where, text_fields)


def check_text_fields(example: dict, where: Callable[[], str],
                      text_fields: Sequence[str]) -> dict:
  """example, once each of text_fields holds text (present, a str, no lone surrogate);
  otherwise a ConfigError starting with where() ('FILE:LINE', 'FILE: row N')."""
  for field in text_fields:
    if field not in example:
      raise ConfigError(f"{where()}: no field {field!r} (the row has {sorted(example)})")
    if not isinstance(example[field], str):
      raise ConfigError(f"{where()}: field {field!r} is {_json_kind(example[field])}, "
                        "expected text")
    try:  # JSON's \ud800 escapes can spell lone surrogates, which no tokenizer encodes
      example[field].encode("utf-8")
    except UnicodeEncodeError as e:
      raise ConfigError(f"{where()}: field {field!r} holds a lone surrogate "
                        f"({example[field][e.start]!r} at character {e.start}), which is not "
                        "text") from None
  return example


def _json_kind(value: Any) -> str:
  """'null', 'the number 5', 'a list', ... for error messages."""
  if value is None:
    return "null"
  if isinstance(value, (bool, int, float)):
    return f"the {'boolean' if isinstance(value, bool) else 'number'} {json.dumps(value)}"
  return f"a {'JSON object' if isinstance(value, dict) else type(value).__name__}"


class TsvSource(TextLineSource):
  """One example per line of tab-separated values, named by `field_names`.

  Example: field_names=("inputs", "targets"), line "hi\\tsalut" -> {"inputs": "hi",
  "targets": "salut"}. A line with another number of fields names its file and line.
  """

  def __init__(self, patterns: Patterns, field_names: Sequence[str], skip_header: bool = False):
    super().__init__(patterns, skip_header=skip_header)
    self.field_names = tuple(field_names)

  def _example(self, file_id: int, index: int) -> dict[str, Any]:
    values = self._line(file_id, index).split("\t")
    if len(values) != len(self.field_names):
      missing = self.field_names[len(values):]
      which = (f": no {', '.join(map(repr, missing))}" if missing else
               f": {len(values) - len(self.field_names)} more than {self.field_names[-1]!r}")
      raise ConfigError(f"{self._where(file_id, index)}: {len(values)} tab-separated fields, "
                        f"expected {len(self.field_names)} {self.field_names}{which}")
    return dict(zip(self.field_names, values))

  def _repr_args(self) -> str:
    return (f"{self._patterns!r}, field_names={self.field_names!r}, "
            f"skip_header={self.skip_header!r}")


class TextFileSource(IndexedFileSource):
  """One example {field: whole file text} per non-empty file (.gz ok)."""
  _uses_buffers = False

  def __init__(self, patterns: Patterns, field: str = "text"):
    super().__init__(patterns)
    self.field = field

  def _index_file(self, path: str, buf: Any) -> list[int]:
    # A .gz file of an empty text still has a header: look inside it.
    empty = (not _gzip_has_data(path)) if path.endswith(".gz") else os.path.getsize(path) == 0
    return [] if empty else [0]

  def _example(self, file_id: int, index: int) -> dict[str, Any]:
    path = self.files[file_id]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
      data = f.read()
    try:
      return {self.field: data.decode("utf-8")}
    except UnicodeDecodeError as e:
      raise ConfigError(f"{path}:{line_number(data, e.start)}: invalid UTF-8 ({e.reason})"
                        ) from None

  def _repr_args(self) -> str:
    return f"{self._patterns!r}, field={self.field!r}"


def _gzip_has_data(path: str) -> bool:
  """Whether a .gz file decompresses to at least one byte."""
  with gzip.open(path, "rb") as f:
    return bool(f.read(1))


def parquet_file(path: str):
  """pyarrow's ParquetFile; an object in a bucket through a seekable fsspec file, so that only
  the footer and the row groups asked for are fetched (ranged reads). A file that is not
  Parquet (or was cut short) is a ConfigError naming it."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  try:
    return pq.ParquetFile(paths.open_binary(path) if paths.is_url(path) else path)
  except pa.ArrowInvalid as e:
    raise ConfigError(f"{path}: not a readable Parquet file ({e})") from None


class ParquetSource(IndexedFileSource):
  """One example per row of Parquet files (pyarrow); lists come back as numpy arrays.
  text_fields as JsonlSource's: a null there names the file and row.

  Random access reads one row group at a time and keeps the last two decoded.
  """
  _uses_buffers = False

  def __init__(self, patterns: Patterns, columns: Sequence[str] | None = None,
               text_fields: Sequence[str] = ()):
    super().__init__(patterns)
    self.columns = None if columns is None else list(columns)
    self.text_fields = (text_fields,) if isinstance(text_fields, str) else tuple(text_fields)
    self._groups: dict[tuple[int, int], dict[str, list]] = {}

  def _index_file(self, path: str, buf: Any) -> np.ndarray:
    meta = parquet_file(path).metadata
    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    return np.cumsum(np.array(rows, dtype=np.int64))  # row group ends

  def _row_group(self, file_id: int, group: int) -> dict[str, list]:
    """A decoded row group, columns as Python lists (small cache)."""
    key = (file_id, group)
    with self._lock:
      if key not in self._groups:
        table = parquet_file(self.files[file_id]).read_row_group(group, columns=self.columns)
        if len(self._groups) >= 2:
          self._groups.pop(next(iter(self._groups)))
        self._groups[key] = table.to_pydict()
      return self._groups[key]

  def _count(self, file_index: np.ndarray) -> int:
    return int(file_index[-1]) if len(file_index) else 0

  def _example(self, file_id: int, index: int) -> dict[str, Any]:
    groups = self._indexes[file_id]
    group = int(np.searchsorted(groups, index, side="right"))
    row = index - (int(groups[group - 1]) if group else 0)
    columns = self._row_group(file_id, group)
    example = {k: np.asarray(v[row]) if isinstance(v[row], list) else v[row]
               for k, v in columns.items()}
    return check_text_fields(example, lambda: f"{self.files[file_id]}: row {index + 1}",
                             self.text_fields)

  def __getstate__(self) -> dict[str, Any]:
    return {**super().__getstate__(), "_groups": {}}

  def _repr_args(self) -> str:
    fields = f", text_fields={self.text_fields!r}" if self.text_fields else ""
    return f"{self._patterns!r}, columns={self.columns!r}{fields}"


class FunctionSource:
  """Examples from a function returning an iterable of dicts, materialized on first use.

  Example: FunctionSource(lambda: ({"text": t} for t in ["a", "b"]))[1] -> {"text": "b"}.
  For grain worker processes fn must pickle (a module-level function), unless already used.
  """

  def __init__(self, fn: Callable[[], Iterable[Mapping[str, Any]]]):
    self.fn = fn
    self._examples: list[dict[str, Any]] | None = None
    self._lock = threading.Lock()

  def _materialize(self) -> list[dict[str, Any]]:
    """Calls fn once (also when grain's threads ask at the same time)."""
    with self._lock:
      if self._examples is None:
        self._examples = self._call()
      return self._examples

  def _call(self) -> list[dict[str, Any]]:
    """fn's examples as a list of dicts, checked."""
    examples = []
    for i, ex in enumerate(self.fn()):
      if not isinstance(ex, Mapping):
        raise TypeError(f"{self!r}: item {i} is a {type(ex).__name__}, expected a dict")
      examples.append(dict(ex))
    if not examples:
      raise ConfigError(f"{self!r} has no examples: the function returned none")
    return examples

  def __len__(self) -> int:
    return len(self._materialize())

  def __getitem__(self, index: int) -> dict[str, Any]:
    examples = self._materialize()
    return dict(examples[checked_index(index, len(examples), self)])

  def __getstate__(self) -> dict[str, Any]:
    return {k: v for k, v in self.__dict__.items() if k != "_lock"}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state, _lock=threading.Lock())

  def __repr__(self) -> str:
    name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
    return f"FunctionSource({name})"
