"""Streamed sources: each format read as written, rows on their own shards, exact resume on
any process count, disjoint shards per process, caches and mixtures over streams."""
import gzip
import json
import zlib

import numpy as np
import pytest

from t5lite.data import cache, cache_parallel, pipeline
from t5lite.data import preprocessors as pp
from t5lite.data.converters import sequence as conv
from t5lite.data.objectives.chains import span_corruption_preprocessors
from t5lite.data.registry import (CACHE_POINT, Feature, MixtureRegistry, TaskRegistry, add_mixture,
                                  add_task, rate_num_examples)
from t5lite.data.sources import streams
from t5lite.data.sources.crc32c import masked_crc32c
from t5lite.data.sources.tfrecord_example import make_example
from t5lite.data.stream_rows import StreamRow, row_units
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError

VOCAB = ByteVocabulary(extra_ids=100)
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}
LENGTHS = {"inputs": 64, "targets": 16}
WORDS = ["alpha", "beta", "gamma", "délta", "ζeta", "eta"]


def corpus(num_shards: int, tag: str = "s") -> list[list[dict]]:
  """Shards of documents of uneven sizes; each text names its shard and number."""
  rng = np.random.default_rng(num_shards)
  return [[{"text": f"{tag}{s} d{i}: " + " ".join(rng.choice(WORDS, rng.integers(2, 30))),
            "n": i} for i in range(int(rng.integers(5, 40)))] for s in range(num_shards)]


def write_jsonl_gz(folder, shards) -> str:
  folder.mkdir(parents=True, exist_ok=True)
  for s, docs in enumerate(shards):
    with gzip.open(folder / f"part-{s:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
      f.writelines(json.dumps(d) + "\n" for d in docs)
  return str(folder / "part-*.jsonl.gz")


def write_parquet(folder, shards) -> str:
  import pyarrow as pa
  import pyarrow.parquet as pq
  folder.mkdir(parents=True, exist_ok=True)
  for s, docs in enumerate(shards):
    pq.write_table(pa.Table.from_pylist(docs), folder / f"part-{s:05d}.parquet", row_group_size=7)
  return str(folder / "part-*.parquet")


def write_hf_dataset(folder, shards, num_shards: int) -> str:
  import datasets
  datasets.Dataset.from_list([d for docs in shards for d in docs]).save_to_disk(
      str(folder), num_shards=num_shards)
  return str(folder)


def streamed(source) -> list[dict]:
  return [ex for shard in range(source.num_shards) for ex in source.examples(shard)]


def texts(examples) -> list[str]:
  return [ex["text"] for ex in examples]


# ------------------------------------------------------------------ the formats


def test_each_format_streams_the_rows_as_written(tmp_path):
  shards = corpus(3)
  flat = [d["text"] for docs in shards for d in docs]
  assert texts(streamed(streams.JsonlStream(write_jsonl_gz(tmp_path / "j", shards), "text"))) == flat
  parquet = streams.ParquetStream(write_parquet(tmp_path / "p", shards))
  assert texts(streamed(parquet)) == flat and len(parquet) == len(flat)  # counted from footers
  arrow = streams.ArrowStream(write_hf_dataset(tmp_path / "hf", shards, 2))
  assert arrow.num_shards == 2 and texts(streamed(arrow)) == flat and len(arrow) == len(flat)
  hf = streams.HfStream("json", data_files=sorted(
      str(p) for p in (tmp_path / "j").glob("*.jsonl.gz")))
  assert hf.num_shards == 3 and texts(streamed(hf)) == flat
  # Skips and strides land on the same records in every format.
  for source in (parquet, hf, streams.JsonlStream(str(tmp_path / "j" / "*.gz"))):
    got = texts(source.examples(1, stride=3, offset=2, skip=2))
    assert got == [d["text"] for d in shards[1]][2 + 3 * 2::3], source


def test_text_lines_compressions_and_tfrecords(tmp_path):
  raw = "\ufefffirst\r\n\n  second\nthird"
  (tmp_path / "a.txt").write_text(raw, encoding="utf-8")
  with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
    f.write(raw)
  import bz2
  import lzma
  import zstandard
  (tmp_path / "c.txt.bz2").write_bytes(bz2.compress(raw.encode()))
  (tmp_path / "d.txt.xz").write_bytes(lzma.compress(raw.encode()))
  (tmp_path / "e.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(raw.encode()))
  source = streams.TextLineStream(str(tmp_path / "*.*"))
  assert source.num_shards == 5
  for shard in range(5):
    assert texts(source.examples(shard)) == ["first", "  second", "third"]
  with pytest.raises(ConfigError, match="give it num_examples=N"):
    len(source)
  assert len(streams.TextLineStream(str(tmp_path / "a.txt"), num_examples=3)) == 3
  (tmp_path / "bad.txt").write_bytes(b"ok\n\xff\xfe\n")
  with pytest.raises(ConfigError, match=r"bad\.txt:2: invalid UTF-8"):
    list(streams.TextLineStream(str(tmp_path / "bad.txt")).examples(0))
  # TFRecord of tf.train.Example, gzipped, CRCs checked as it streams.
  records = [make_example({"text": t}) for t in ["x", "yy", "zzz"]]
  framed = b"".join(len(r).to_bytes(8, "little") + masked_crc32c(len(r).to_bytes(8, "little"))
                    .to_bytes(4, "little") + r + masked_crc32c(r).to_bytes(4, "little")
                    for r in records)
  (tmp_path / "r.tfrecord.gz").write_bytes(gzip.compress(framed))
  tf = streams.TfRecordStream(str(tmp_path / "r.tfrecord.gz"))
  assert texts(tf.examples(0)) == ["x", "yy", "zzz"] and texts(tf.examples(0, skip=2)) == ["zzz"]
  damaged = bytearray(framed)
  damaged[-6] ^= 1  # inside the last record's data
  (tmp_path / "d.tfrecord").write_bytes(bytes(damaged))
  with pytest.raises(ConfigError, match=r"d\.tfrecord: record 2 at offset \d+: corrupted "
                     r"record data"):
    list(streams.TfRecordStream(str(tmp_path / "d.tfrecord")).examples(0))


# ------------------------------------------------------------------ rows


@pytest.mark.parametrize("num_shards, rows", [(1, 1), (5, 2), (7, 7), (12, 5), (3, 8), (2, 7)])
def test_rows_together_read_every_record_once_per_epoch(num_shards, rows):
  sizes = [int(n) for n in np.random.default_rng(rows).integers(rows, 30, num_shards)]
  claimed = []
  for row in range(rows):
    for unit in row_units(num_shards, row, rows):
      claimed += [(unit.shard, i) for i in range(unit.offset, sizes[unit.shard], unit.stride)]
  assert sorted(claimed) == [(s, i) for s in range(num_shards) for i in range(sizes[s])]


@pytest.mark.parametrize("row, rows, window", [(1, 3, 4), (6, 8, 5), (0, 2, 1), (0, 1, 1000)])
def test_a_row_resumes_exactly_from_any_position(tmp_path, row, rows, window):
  source = streams.JsonlStream(write_jsonl_gz(tmp_path, corpus(5)), "text")
  dataset = StreamRow(source, row, rows, seed=3, window=window, shuffle=True, num_epochs=3,
                      what="row")
  dataset.outputs = 1
  whole = texts(dataset)
  per_epoch = len(whole) // 3
  assert whole[:per_epoch] != whole[per_epoch:2 * per_epoch]  # each epoch shuffles anew
  assert sorted(whole[:per_epoch]) == sorted(whole[per_epoch:2 * per_epoch])
  for k in sorted({0, 1, window, window + 1, per_epoch, len(whole) - 1, len(whole)} & set(range(len(whole) + 1))):
    it = iter(dataset)
    for _ in range(k):
      next(it)
    resumed = iter(dataset)
    resumed.set_state(json.loads(json.dumps(it.get_state())))
    assert texts(resumed) == whole[k:], k


# ------------------------------------------------------------------ the pipeline


@pytest.fixture(scope="module")
def streamed_tasks(tmp_path_factory):
  """The same span-corruption task over JSONL.gz (10 shards), Parquet (10) and an HF dataset
  saved in 4 shards (fewer than the 8 batch rows: rows share them)."""
  folder = tmp_path_factory.mktemp("streams")
  shards = corpus(10)
  sources = {"jsonl_gz": streams.JsonlStream(write_jsonl_gz(folder / "j", shards), "text"),
             "parquet": streams.ParquetStream(write_parquet(folder / "p", shards), ["text"]),
             "hf_dataset": streams.ArrowStream(write_hf_dataset(folder / "hf", shards, 4))}
  steps = [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT,
           *span_corruption_preprocessors()]
  copy = [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, CACHE_POINT,
          pp.append_eos_after_trim]
  names = []
  for kind, source in sources.items():
    for task, chain in ((f"stream_sc_{kind}", steps), (f"stream_copy_{kind}", copy)):
      TaskRegistry.remove(task)
      add_task(task, {"train": source}, FEATURES, chain, shuffle_buffer_size=16)
      names.append(task)
  MixtureRegistry.remove("stream_mix")
  add_mixture("stream_mix", [("stream_copy_parquet", rate_num_examples),
                             ("stream_copy_hf_dataset", rate_num_examples)])
  yield shards
  for name in names:
    TaskRegistry.remove(name)
  MixtureRegistry.remove("stream_mix")


def batches(name, *, process_index=0, process_count=1, state=None, pack=True, **config):
  config = pipeline.PipelineConfig(**{"global_batch_size": 8, "task_feature_lengths": LENGTHS,
                                      "seed": 11, **config})
  it = pipeline.get_dataset(name, config, conv.EncDecFeatureConverter(pack=pack),
                            process_index=process_index, process_count=process_count)
  if state is not None:
    it.set_state(state)
  return it


def concat_rows(parts):
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def assert_same(a, b, what):
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=f"{what}: {key}")


# Unpacked copy tasks move every row's stream one example per batch, through windows (16
# examples) and epochs (~27 documents per row); the packed span corruption is what C4 runs.
@pytest.mark.parametrize("name, pack", [
    ("stream_copy_jsonl_gz", False), ("stream_copy_parquet", False),
    ("stream_copy_hf_dataset", False), ("stream_mix", False), ("stream_sc_jsonl_gz", True)])
def test_resume_after_n_batches_on_1_2_and_4_processes(streamed_tasks, name, pack):
  n = int(np.random.default_rng(zlib.crc32(name.encode())).integers(3, 60))  # drawn per source
  uninterrupted = batches(name, pack=pack)
  expected = [next(uninterrupted) for _ in range(n + 3)][n:]
  for saved_with, restored_with in ((1, 1), (2, 2), (4, 4), (2, 4), (4, 1)):
    saving = [batches(name, process_index=i, process_count=saved_with, pack=pack)
              for i in range(saved_with)]
    for _ in range(n):
      for it in saving:
        next(it)
    state = json.loads(json.dumps(pipeline.merge_states([it.get_state() for it in saving])))
    restored = [batches(name, process_index=i, process_count=restored_with, state=state,
                        pack=pack) for i in range(restored_with)]
    for step, want in enumerate(expected):
      assert_same(concat_rows([next(it) for it in restored]), want,
                  f"{name}: after {n} batches on {saved_with}, step {step} on {restored_with}")


def _epoch_texts(name, process_index, process_count, global_batch_size=4):
  it = batches(name, process_index=process_index, process_count=process_count, pack=False,
               num_epochs=1, global_batch_size=global_batch_size)
  seen = []
  for batch in it:
    for row, segments in zip(batch["encoder_input_tokens"], batch["encoder_segment_ids"]):
      if segments.any():
        seen.append(VOCAB.decode(row[(segments > 0) & (row != 1)].tolist()))
  return seen


def test_two_processes_read_disjoint_shards_that_cover_the_corpus(streamed_tasks):
  ids = sorted(d["text"].split(":")[0] for docs in streamed_tasks for d in docs)
  per_process = [_epoch_texts("stream_copy_jsonl_gz", p, 2) for p in range(2)]
  got = [text.split(":")[0] for seen in per_process for text in seen]  # inputs are cut at 64
  assert sorted(got) == ids  # every document once per epoch
  shards = [{text.split()[0] for text in seen} for seen in per_process]
  assert shards[0] and shards[1] and not shards[0] & shards[1]


def test_a_mixture_of_streams_keeps_its_rates(streamed_tasks):
  parquet, hf = (TaskRegistry.get(f"stream_copy_{k}") for k in ("parquet", "hf_dataset"))
  total = sum(len(docs) for docs in streamed_tasks)
  assert rate_num_examples(parquet) == rate_num_examples(hf) == total  # from the files
  rates = dict((t.name, r) for t, r in MixtureRegistry.get("stream_mix").task_rates())
  assert rates == {"stream_copy_parquet": total, "stream_copy_hf_dataset": total}


def test_cache_of_a_streamed_task_in_parallel_processes(streamed_tasks, tmp_path):
  task = TaskRegistry.get("stream_copy_jsonl_gz")
  infos = cache_parallel.cache_in_parallel(task, "train", str(tmp_path), num_workers=3,
                                           processes=2, progress=False)
  total = sum(len(docs) for docs in streamed_tasks)
  assert [i["worker_index"] for i in infos] == [0, 1, 2]
  assert sum(i["examples"] for i in infos) == total
  cached = cache.cached_source(task, "train", str(tmp_path))
  got = sorted(VOCAB.decode(cached[i]["inputs"].tolist()) for i in range(len(cached)))
  assert got == sorted(d["text"] for docs in streamed_tasks for d in docs)
  # Training reads the cache by index, every example once per epoch.
  epoch = _epoch_texts_cached(task.name, tmp_path)
  assert sorted(t.split(":")[0] for t in epoch) == sorted(t.split(":")[0] for t in got)


def _epoch_texts_cached(name, cache_dir):
  it = batches(name, pack=False, num_epochs=1, global_batch_size=4, use_cached=True,
               cache_dir=str(cache_dir))
  return [VOCAB.decode(row[(segments > 0) & (row != 1)].tolist())
          for batch in it for row, segments in zip(batch["encoder_input_tokens"],
                                                   batch["encoder_segment_ids"]) if segments.any()]


def test_an_empty_row_is_explained(tmp_path):
  source = streams.JsonlStream(write_jsonl_gz(tmp_path, [[{"text": "only"}]]), "text")
  TaskRegistry.remove("stream_tiny")
  add_task("stream_tiny", {"train": source}, FEATURES,
           [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize])
  try:
    with pytest.raises(ConfigError, match="batch row 1 got no example from its shards"):
      next(batches("stream_tiny", global_batch_size=2))
  finally:
    TaskRegistry.remove("stream_tiny")


def test_shards_in_a_bucket_stream_without_a_local_copy(bucket, tmp_path, monkeypatch):
  """gs:// and s3:// shards (local servers) read as streams: the same examples, resumable,
  and nothing copied to the object cache."""
  _, url = bucket
  from t5lite.util import paths, staging
  monkeypatch.setenv(staging.CACHE_ENV, str(tmp_path / "objects"))
  shards = corpus(3)
  local = tmp_path / "local"
  write_jsonl_gz(local, shards)
  write_parquet(local, shards)
  # Plain JSON lines for datasets: its reader of compressed files passes aiohttp's options
  # to every filesystem, and s3fs refuses them (datasets 5.2).
  for s, docs in enumerate(shards):
    (local / f"plain-{s}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  for path in sorted(local.iterdir()):
    with paths.open_binary(f"{url}/{path.name}", "wb") as f:
      f.write(path.read_bytes())
  hf = streams.HfStream("json", data_files=[f"{url}/plain-{s}.jsonl" for s in range(3)])
  flat = [d["text"] for docs in shards for d in docs]
  for source in (streams.JsonlStream(f"{url}/part-*.jsonl.gz", "text"),
                 streams.ParquetStream(f"{url}/part-*.parquet"), hf):
    assert source.num_shards == 3 and texts(streamed(source)) == flat
    assert texts(source.examples(2, skip=4)) == [d["text"] for d in shards[2]][4:]
  assert not (tmp_path / "objects").exists()


def test_a_state_of_the_other_reading_is_refused_in_one_line(streamed_tasks, tmp_path):
  """A checkpoint saved while a task was read by index (C4 JSON before it streamed, or a
  cache) does not restore into a streamed row, nor the other way round."""
  streamed = batches("stream_copy_jsonl_gz", pack=False)
  next(streamed)
  indexed_row = {"next_index": 5}
  state = streamed.get_state()
  with pytest.raises(ConfigError, match="saved by an indexed reading of the task"):
    batches("stream_copy_jsonl_gz", pack=False, state={
        **state, "rows": {r: indexed_row for r in state["rows"]}})
  task = TaskRegistry.get("stream_copy_jsonl_gz")
  cache.cache_task(task, "train", str(tmp_path))
  with pytest.raises(ConfigError, match="saved by a streamed reading of the task"):
    batches("stream_copy_jsonl_gz", pack=False, use_cached=True, cache_dir=str(tmp_path),
            state={**state, "data": None})


def test_a_cache_worker_without_records_writes_an_empty_shard(tmp_path):
  source = streams.JsonlStream(write_jsonl_gz(tmp_path / "j", [[{"text": "one"}]]), "text")
  TaskRegistry.remove("stream_one")
  add_task("stream_one", {"train": source}, FEATURES,
           [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, CACHE_POINT])
  try:
    task = TaskRegistry.get("stream_one")
    infos = [cache.cache_task(task, "train", str(tmp_path / "c"), worker_index=w, num_workers=2)
             for w in range(2)]
    assert [i["examples"] for i in infos] == [1, 0]
    assert len(cache.cached_source(task, "train", str(tmp_path / "c"))) == 1
  finally:
    TaskRegistry.remove("stream_one")
