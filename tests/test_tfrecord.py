"""TFRecord without TensorFlow: CRCs, framing errors, Example parsing, array_record conversion.

Records are written here by a small independent writer (bit-by-bit CRC32C), and the
Examples built with tfds's own pure-python copy of TensorFlow's proto.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import struct

import numpy as np
import pytest

from t5lite.data.sources import crc32c
from t5lite.data.sources.readers import TfdsSource, prepare_tfds_dataset
from t5lite.data.sources.tfrecord import (ArrayRecordSource, TfRecordSource,
                                  convert_tfds_dataset_to_array_record,
                                  convert_tfrecord_to_array_record, read_tfrecord)
from t5lite.data.sources.tfrecord_example import make_example, parse_example


def ref_crc32c(data: bytes) -> int:
  """Bit-at-a-time CRC32C (Castagnoli, reflected): the textbook definition."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc ^= byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
  return crc ^ 0xFFFFFFFF


def ref_masked(data: bytes) -> int:
  crc = ref_crc32c(data)
  return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def write_tfrecord(path: str, records: list[bytes]) -> str:
  """TFRecord framing: u64 length, u32 masked crc(length), data, u32 masked crc(data)."""
  out = bytearray()
  for data in records:
    length = struct.pack("<Q", len(data))
    out += length + struct.pack("<I", ref_masked(length)) + data
    out += struct.pack("<I", ref_masked(data))
  with (gzip.open if path.endswith(".gz") else open)(path, "wb") as f:
    f.write(bytes(out))
  return path


def tf_example(text: str | bytes, ids: list[int], scores: list[float]) -> bytes:
  """A tf.train.Example built with tfds's copy of TensorFlow's proto (not ours)."""
  from tensorflow_datasets.proto import tf_example_pb2
  ex = tf_example_pb2.Example()
  ex.features.feature["text"].bytes_list.value.append(
      text.encode("utf-8") if isinstance(text, str) else text)
  ex.features.feature["ids"].int64_list.value.extend(ids)
  ex.features.feature["scores"].float_list.value.extend(scores)
  return ex.SerializeToString()


ROWS = [(f"doc {i} héllo 日本 🙂", list(range(i, i + 1 + i % 4)), [i / 4.0, -1.5])
        for i in range(10)]


def assert_row(example: dict, row) -> None:
  text, ids, scores = row
  assert example["text"] == text
  np.testing.assert_array_equal(np.atleast_1d(example["ids"]), ids)
  np.testing.assert_array_equal(example["scores"], np.float32(scores))


@pytest.fixture
def shards(tmp_path):
  """Two TFRecord shards (one gzip-compressed) holding ROWS[:6] and ROWS[6:]."""
  records = [tf_example(*row) for row in ROWS]
  return [write_tfrecord(str(tmp_path / "data-00000-of-00002.tfrecord"), records[:6]),
          write_tfrecord(str(tmp_path / "data-00001-of-00002.tfrecord.gz"), records[6:])]


def test_crc32c_matches_reference():
  assert crc32c.crc32c(b"123456789") == 0xE3069283 == ref_crc32c(b"123456789")
  rng = random.Random(0)
  buffers = [bytes(rng.getrandbits(8) for _ in range(n))
             for n in (0, 1, 3, 4, 5, 63, 64, 65, 128, 200, 1000, 4100)]
  expected = [ref_crc32c(b) for b in buffers]
  assert crc32c._numpy_crc32c_many(buffers).tolist() == expected  # the fallback itself
  assert crc32c.crc32c_many(buffers).tolist() == expected  # whatever backend is installed
  assert crc32c.masked_crc32c_many(buffers).tolist() == [ref_masked(b) for b in buffers]


def test_tfrecord_source_random_access(shards):
  source = TfRecordSource(shards[0][:-len("00000-of-00002.tfrecord")] + "*")
  assert len(source) == len(ROWS)
  for i in random.Random(0).sample(range(len(ROWS)), len(ROWS)):
    assert_row(source[i], ROWS[i])
  with pytest.raises(IndexError, match="of length 10"):
    source[10]
  assert [parse_example(r) for r in read_tfrecord(shards[1])][0]["text"] == ROWS[6][0]


def test_parse_example_kinds():
  data = tf_example(b"\xff\xfe not utf-8", [7], [0.5, 1.0])
  assert parse_example(data)["text"] == b"\xff\xfe not utf-8"  # kept as bytes
  assert parse_example(data)["ids"] == 7  # squeezed
  raw = parse_example(tf_example("a", [7], []), decode_text=False, squeeze=False)
  assert raw["text"] == [b"a"] and raw["ids"].tolist() == [7] and raw["scores"].size == 0
  # make_example is the inverse, and bytes-compatible with the reference proto.
  ours = make_example({"text": "hé", "ids": [1, 2], "f": [0.25]})
  assert parse_example(ours)["text"] == "hé" and parse_example(ours)["ids"].tolist() == [1, 2]
  from tensorflow_datasets.proto import tf_example_pb2
  assert tf_example_pb2.Example.FromString(ours).features.feature["f"].float_list.value == [0.25]


def test_truncated_and_corrupted_files(tmp_path):
  records = [tf_example(*row) for row in ROWS[:3]]
  good = write_tfrecord(str(tmp_path / "good.tfrecord"), records)
  with open(good, "rb") as f:
    data = f.read()
  last = len(data) - (len(records[-1]) + 16)  # offset of the last record
  for name, cut in (("cut_data.tfrecord", len(data) - 5), ("cut_header.tfrecord", last + 7)):
    with open(tmp_path / name, "wb") as f:
      f.write(data[:cut])
    with pytest.raises(ValueError, match=rf"{name}: truncated record.* at offset {last}"):
      len(TfRecordSource(str(tmp_path / name)))
  flipped = bytearray(data)
  flipped[last + 20] ^= 1  # one bit of the last record's data
  (tmp_path / "flip.tfrecord").write_bytes(bytes(flipped))
  with pytest.raises(ValueError, match=rf"flip\.tfrecord: corrupted record data at offset {last}"):
    len(TfRecordSource(str(tmp_path / "flip.tfrecord")))
  assert len(TfRecordSource(str(tmp_path / "flip.tfrecord"), verify_crc=False)) == 3
  flipped = bytearray(data)
  flipped[last + 1] ^= 1  # the length itself
  (tmp_path / "len.tfrecord").write_bytes(bytes(flipped))
  with pytest.raises(ValueError, match=rf"corrupted record length at offset {last}"):
    len(TfRecordSource(str(tmp_path / "len.tfrecord")))


def test_convert_to_array_record_and_read_back(shards, tmp_path):
  per_file = convert_tfrecord_to_array_record(shards, str(tmp_path / "ar1"))
  assert [os.path.basename(p) for p in per_file] == [
      "data-00000-of-00002.array_record", "data-00001-of-00002.array_record"]
  resharded = convert_tfrecord_to_array_record(shards, str(tmp_path / "ar3"), num_shards=3)
  assert os.path.basename(resharded[2]) == "data.array_record-00002-of-00003"
  tfrecords = TfRecordSource(shards)
  for outputs in (per_file, resharded):
    source = ArrayRecordSource(outputs)
    assert len(source) == len(ROWS)
    for i in range(len(ROWS)):
      got, want = source[i], tfrecords[i]
      assert got.keys() == want.keys()
      for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_tfrecord_tfds_dataset_converted_for_tfds_source(tmp_path):
  """A TFDS dataset stored as tfrecord (as TF would) becomes readable without TF."""
  data_dir = str(tmp_path / "tfds")
  splits = {"train": [{"text": row[0], "n": i} for i, row in enumerate(ROWS)]}
  prepare_tfds_dataset("t5lite_tfr_corpus", splits, data_dir, {"text": "text", "n": "int64"})
  version_dir = os.path.join(data_dir, "t5lite_tfr_corpus", "1.0.0")
  shard = "t5lite_tfr_corpus-train.array_record-00000-of-00001"
  # The tfds array_record records are tf.train.Example too: read them directly.
  direct = ArrayRecordSource(os.path.join(version_dir, shard))
  assert [direct[i]["text"] for i in range(len(ROWS))] == [r[0] for r in ROWS]
  # Rewrite the dataset as tfrecord shards, as a TensorFlow-prepared one would be.
  write_tfrecord(os.path.join(version_dir, shard.replace("array_record", "tfrecord")),
                 [bytes(direct._open()[i]) for i in range(len(ROWS))])
  os.remove(os.path.join(version_dir, shard))
  info_path = os.path.join(version_dir, "dataset_info.json")
  with open(info_path) as f:
    info = json.load(f)
  info["fileFormat"] = "tfrecord"
  with open(info_path, "w") as f:
    json.dump(info, f)
  with pytest.raises(ValueError, match=r"stored as \['tfrecord'\].*convert_tfds_dataset"):
    len(TfdsSource("t5lite_tfr_corpus", "train", data_dir=data_dir))
  convert_tfds_dataset_to_array_record(version_dir)
  source = TfdsSource("t5lite_tfr_corpus", "train[:50%]", data_dir=data_dir)
  assert [source[i] for i in range(len(source))] == [
      {"text": r[0], "n": i} for i, r in enumerate(ROWS[:5])]
