"""Data sources over small files made in tmp dirs: random access equals a direct parse."""
from __future__ import annotations

import gzip
import json
import os
import pickle
import random
import sys

import numpy as np
import pytest

from t5lite.data.sources.readers import (FunctionSource, JsonlSource, ParquetSource, TextFileSource,
                                 TextLineSource, TfdsSource, TsvSource, expand_patterns,
                                 prepare_tfds_dataset)

UNICODE = ["héllo wörld", "日本語のテキスト", "emoji 🙂 ok", "plain ascii"]


def write(path, text: str | bytes) -> str:
  """Writes text (gzip-compressed for .gz names); returns the path."""
  data = text.encode("utf-8") if isinstance(text, str) else text
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
    f.write(data)
  return path


def assert_random_access(source, expected: list[dict]) -> None:
  """len, every index in a random order, and negative indices match `expected`."""
  assert len(source) == len(expected)
  order = list(range(len(expected)))
  random.Random(0).shuffle(order)
  for i in order:
    assert source[i] == expected[i], i
  assert source[np.int64(0)] == expected[0]
  assert source[-1] == expected[-1]


def test_text_lines_sharded_gz_unicode(tmp_path):
  contents = ["a first line\n\nsecond\r\n" + UNICODE[0] + "\n",
              "\n".join(UNICODE[1:]),  # no trailing newline
              "\n\n   \nlast of three\n"]
  for i, text in enumerate(contents):
    write(str(tmp_path / f"train-{i:05d}-of-00003.txt") + (".gz" if i == 1 else ""), text)
  source = TextLineSource(str(tmp_path / "train-*"))
  expected = [{"text": line} for text in contents for line in text.splitlines() if line]
  assert_random_access(source, expected)
  assert source.files == sorted(source.files) and len(source.files) == 3
  assert "TextLineSource(" in repr(source) and "train-*" in repr(source)
  # Picklable for grain workers, also after use (open files are reopened).
  assert_random_access(pickle.loads(pickle.dumps(source)), expected)


def test_text_lines_list_of_patterns_and_field(tmp_path):
  b = write(str(tmp_path / "b.txt"), "b1\nb2\n")
  a = write(str(tmp_path / "a.txt"), "a1\n")
  source = TextLineSource([b, str(tmp_path / "*.txt")], field="line")
  assert source.files == [b, a]  # pattern order, duplicates dropped
  assert [source[i] for i in range(3)] == [{"line": "b1"}, {"line": "b2"}, {"line": "a1"}]


def test_many_files_few_open_maps_and_threads(tmp_path, monkeypatch):
  from concurrent.futures import ThreadPoolExecutor
  from t5lite.data.sources import files
  monkeypatch.setattr(files, "_MAX_OPEN_MAPS", 2)  # each mmap holds a file descriptor
  for i in range(6):
    write(str(tmp_path / f"s{i}.txt"), f"{i}a\n{i}b\n{i}c\n")
  source = TextLineSource(str(tmp_path / "s*.txt"))
  expected = [{"text": f"{i}{c}"} for i in range(6) for c in "abc"]
  order = list(range(18)) * 20
  random.Random(0).shuffle(order)
  with ThreadPoolExecutor(4) as pool:  # grain reads with threads
    assert list(pool.map(source.__getitem__, order)) == [expected[i] for i in order]
  assert len(source._buffers) <= 2


def test_jsonl_sharded_c4_like(tmp_path):
  rows = [{"text": f"doc {i} {UNICODE[i % 4]}", "url": f"https://x/{i}", "n": i}
          for i in range(12)]
  for shard in range(3):
    lines = "\n".join(json.dumps(r, ensure_ascii=shard == 0) for r in rows[shard * 4:][:4])
    write(str(tmp_path / f"c4-train.{shard:05d}-of-00003.json.gz"), lines + "\n")
  write(str(tmp_path / "extra.jsonl"), json.dumps({"text": "x"}) + "\n")
  source = JsonlSource([str(tmp_path / "c4-train.*.json.gz"), str(tmp_path / "extra.jsonl")])
  assert_random_access(source, rows + [{"text": "x"}])


def test_tsv_header_and_field_count_error(tmp_path):
  path = write(str(tmp_path / "pairs.tsv"), "inputs\ttargets\nhi\tsalut\nthanks\tmerci\r\n")
  source = TsvSource(path, ("inputs", "targets"), skip_header=True)
  assert_random_access(source, [{"inputs": "hi", "targets": "salut"},
                                {"inputs": "thanks", "targets": "merci"}])
  bad = write(str(tmp_path / "bad.tsv"), "a\tb\nonly one field\n")
  with pytest.raises(ValueError, match=r"bad\.tsv:2: 1 tab-separated fields, expected 2"):
    TsvSource(bad, ("x", "y"))[1]


def test_text_files(tmp_path):
  write(str(tmp_path / "docs" / "b.txt.gz"), "second\ndoc " + UNICODE[1])
  write(str(tmp_path / "docs" / "a.txt"), "first doc\n" + UNICODE[2])
  write(str(tmp_path / "docs" / "c.txt"), "")  # empty files are skipped
  source = TextFileSource(str(tmp_path / "docs" / "*"))
  assert_random_access(source, [{"text": "first doc\n" + UNICODE[2]},
                                {"text": "second\ndoc " + UNICODE[1]}])


def test_parquet_row_groups_columns(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"text": f"row {i} {UNICODE[i % 4]}", "n": i, "ids": list(range(i % 3))}
          for i in range(11)]
  for shard, chunk in enumerate([rows[:7], rows[7:]]):
    pq.write_table(pa.Table.from_pylist(chunk), str(tmp_path / f"part-{shard}.parquet"),
                   row_group_size=3)
  source = ParquetSource(str(tmp_path / "part-*.parquet"))
  assert len(source) == 11
  for i in random.Random(1).sample(range(11), 11):
    ex = source[i]
    assert ex["text"] == rows[i]["text"] and ex["n"] == rows[i]["n"]
    np.testing.assert_array_equal(ex["ids"], rows[i]["ids"])
  assert ParquetSource(str(tmp_path / "part-1.parquet"), columns=["text"])[0] == {
      "text": rows[7]["text"]}


def test_function_source_materialized_once():
  calls = []

  def examples():
    calls.append(1)
    return ({"text": t, "i": i} for i, t in enumerate(UNICODE))

  source = FunctionSource(examples)
  assert calls == []  # lazy
  assert_random_access(source, [{"text": t, "i": i} for i, t in enumerate(UNICODE)])
  assert calls == [1]
  assert "examples" in repr(source)
  with pytest.raises(TypeError, match="item 1 is a str"):
    len(FunctionSource(lambda: [{"a": 1}, "b"]))
  with pytest.raises(ValueError, match="no examples"):
    len(FunctionSource(lambda: []))


def test_missing_pattern_errors(tmp_path):
  write(str(tmp_path / "train-00000.jsonl"), "{}\n")
  with pytest.raises(FileNotFoundError, match=r"no file matches .*trian-\*\.jsonl.*"
                     r"near names .*train-00000\.jsonl"):
    expand_patterns(str(tmp_path / "trian-*.jsonl"))
  with pytest.raises(FileNotFoundError, match=r"no file matches .*nodir.*does not exist"):
    len(TextLineSource(str(tmp_path / "nodir" / "x.txt")))


def test_empty_source_names_files(tmp_path):
  a = write(str(tmp_path / "a.txt"), "\n\n")
  b = write(str(tmp_path / "b.txt.gz"), "")
  with pytest.raises(ValueError, match=r"no examples: these files are empty: .*a\.txt.*b\.txt"):
    len(TextLineSource([a, b]))


def test_bad_utf8_and_bad_json_name_file_and_line(tmp_path):
  path = write(str(tmp_path / "bad.txt"), b"ok\n\nstill ok\nbad \xff byte\n")
  source = TextLineSource(path)
  assert source[1] == {"text": "still ok"}
  with pytest.raises(ValueError, match=r"bad\.txt:4: invalid UTF-8"):
    source[2]
  path = write(str(tmp_path / "bad.jsonl.gz"), '{"a": 1}\n{"a": 2}\n\n{"a": oops}\n[1]\n')
  source = JsonlSource(path)
  assert source[1] == {"a": 2}
  with pytest.raises(ValueError, match=r"bad\.jsonl\.gz:4: invalid JSON"):
    source[2]
  with pytest.raises(ValueError, match=r"bad\.jsonl\.gz:5: expected a JSON object"):
    source[3]


def test_index_out_of_range_says_length(tmp_path):
  source = TextLineSource(write(str(tmp_path / "a.txt"), "x\ny\n"))
  for i in (2, -3):
    with pytest.raises(IndexError, match=f"index {i} out of range .* of length 2"):
      source[i]
  with pytest.raises(IndexError, match="of length 4"):
    FunctionSource(lambda: [{}] * 4)[4]


def _demo_splits():
  return {"train": [{"text": f"doc {i} {UNICODE[i % 4]}", "n": i, "ids": list(range(i % 3))}
                    for i in range(8)],
          "validation": [{"text": "held out", "n": -1, "ids": [7]}]}


def test_prepare_tfds_dataset_and_tfds_source(tmp_path):
  data_dir = str(tmp_path / "tfds")
  features = {"text": "text", "n": "int64", "ids": "int32[]"}
  prepare_tfds_dataset("t5lite_test_corpus", _demo_splits(), data_dir, features)
  prepare_tfds_dataset("t5lite_test_corpus", _demo_splits(), data_dir, features)  # no-op
  expected = _demo_splits()
  train = TfdsSource("t5lite_test_corpus", "train", data_dir=data_dir)
  assert len(train) == 8
  for i, want in enumerate(expected["train"]):  # given order is kept (no shuffling)
    ex = train[i]
    assert ex["text"] == want["text"] and isinstance(ex["text"], str) and ex["n"] == want["n"]
    np.testing.assert_array_equal(ex["ids"], want["ids"])
  half = TfdsSource("t5lite_test_corpus", "train[:50%]", data_dir=data_dir)
  assert [half[i]["text"] for i in range(len(half))] == [e["text"] for e in expected["train"][:4]]
  assert TfdsSource("t5lite_test_corpus", "validation", data_dir=data_dir)[0]["text"] == "held out"
  assert repr(half) == f"TfdsSource('t5lite_test_corpus', split='train[:50%]', data_dir={data_dir!r})"
  assert pickle.loads(pickle.dumps(half))[1]["text"] == expected["train"][1]["text"]
  with pytest.raises(IndexError, match="of length 4"):
    half[4]
  # Deterministic: preparing again elsewhere writes the same bytes.
  other = str(tmp_path / "again")
  prepare_tfds_dataset("t5lite_test_corpus", _demo_splits(), other, features)
  version_dir = os.path.join(data_dir, "t5lite_test_corpus", "1.0.0")
  for name in sorted(os.listdir(version_dir)):
    with open(os.path.join(version_dir, name), "rb") as f1, open(
        os.path.join(other, "t5lite_test_corpus", "1.0.0", name), "rb") as f2:
      assert f1.read() == f2.read(), name


def test_tfds_source_not_prepared(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"not prepared .*prepare_tfds_dataset.*tfrecord"):
    len(TfdsSource("mnist", data_dir=str(tmp_path)))  # in the catalog, not on disk: no download
  with pytest.raises(FileNotFoundError, match=r"'no_such_dataset_xyz' is neither in"):
    len(TfdsSource("no_such_dataset_xyz", data_dir=str(tmp_path)))
  assert "tensorflow" not in sys.modules  # tfds ran without TensorFlow
