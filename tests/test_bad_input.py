"""Bad input and a hostile environment: one error line and exit 2, never a traceback or a
silent change; first-use builds that survive being killed."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.paths import REPO
from t5lite import cli
from t5lite.data import describe, pipeline
from t5lite.util import atomic
from t5lite.util.checks import MAX_FEATURE_LENGTH
from t5lite.data.sources.readers import JsonlSource, TsvSource
from t5lite.data.sources.tfds import is_prepared_dir
from t5lite.data.vocab.vocabularies import SentencePieceVocabulary, load_vocabulary
from t5lite.errors import ConfigError
from t5lite.eval import run
from t5lite.eval.evaluator import DecodeConfig
from t5lite.train.trainer import TrainConfig
from t5lite_tasks import c4, embedded, glue

VERSION = "1.0.0"  # of the embedded dataset
TRAIN = ["train", "--gin_file=gin/runs/demo.gin", "--gin.MODEL_DIR=/tmp/t5lite_never_made"]


def _error(capsys) -> str:
  """The one error line on stderr (eval / infer first say how many processes run)."""
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if not line.startswith("t5lite: single process")]
  assert "Traceback" not in err and len(lines) == 1, err
  return lines[0]


# ------------------------------------------------------------------ 1. OSError is the setup

def test_a_file_where_a_folder_should_be_exits_2_naming_it(tmp_path, capsys):
  a_file = tmp_path / "cache"
  a_file.write_text("not a folder")
  assert cli.main(["cache", "stdlib_span_corruption", "--split", "train",
                   "--cache_dir", str(a_file)]) == 2
  line = _error(capsys)
  assert line.startswith("t5lite cache: error: ") and str(a_file) in line
  assert line.endswith("Not a directory")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EISDIR])
def test_permission_and_disk_errors_exit_2_with_path_and_errno_text(code, monkeypatch, capsys):
  def list_tasks():
    raise OSError(code, os.strerror(code), "/data/t5lite/x")
  monkeypatch.setattr(describe, "list_tasks", list_tasks)
  assert cli.main(["tasks", "list"]) == 2
  assert _error(capsys) == f"t5lite tasks: error: /data/t5lite/x: {os.strerror(code)}"


# ------------------------------------------------------------------ 2. garbage spiece.model

@pytest.mark.parametrize("content", [b"", np.random.default_rng(0).bytes(4096),
                                     b"<html>404 Not Found</html>"],
                         ids=["empty", "random_bytes", "html"])
def test_a_garbage_sentencepiece_model_names_the_file(content, tmp_path):
  path = tmp_path / "spiece.model"
  path.write_bytes(content)
  with pytest.raises(ConfigError, match=f"{path}.*(empty|not a sentencepiece model)"):
    SentencePieceVocabulary(path)
  with pytest.raises(ConfigError, match=str(path)):
    load_vocabulary(tmp_path)  # an HF-style folder with only spiece.model


def test_a_cut_short_vocabulary_json_names_the_file(tmp_path):
  (tmp_path / "vocabulary.json").write_text('{"kind": "byte", "extra')
  with pytest.raises(ConfigError, match="vocabulary.json is not a vocabulary.json"):
    load_vocabulary(tmp_path)


# ------------------------------------------------------------------ 3. rows of data files

def test_jsonl_rows_without_text_name_file_line_and_field(tmp_path):
  path = tmp_path / "c4-train.jsonl"
  path.write_text('{"text": "fine"}\n\n{"url": "x"}\n{"text": 5}\n{"text": null}\n')
  source = JsonlSource(str(path), text_fields=("text",))
  assert source[0] == {"text": "fine"}
  with pytest.raises(ConfigError, match=r"c4-train\.jsonl:3: no field 'text'"):
    source[1]
  with pytest.raises(ConfigError, match=r"c4-train\.jsonl:4: field 'text' is the number 5"):
    source[2]
  with pytest.raises(ConfigError, match=r"c4-train\.jsonl:5: field 'text' is null"):
    source[3]
  # C4 from JSON files checks its text field.
  with pytest.raises(ConfigError, match=r"c4-train\.jsonl:5: field 'text' is null"):
    list(c4.c4_source("train", json=str(path)).examples(0, offset=3))


def test_deep_json_lone_surrogates_and_cut_parquet_name_their_file(tmp_path):
  """Rows that used to end in a RecursionError, a UnicodeEncodeError in the tokenizer, or
  pyarrow's error without a file name: one line naming the file (and line)."""
  from t5lite.data.sources.readers import ParquetSource
  from t5lite.data.sources.streams import JsonlStream, ParquetStream
  path = tmp_path / "rows.jsonl"
  path.write_text('{"text": "fine"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
                  + '{"text": "a \\ud800 b"}\n')
  source = JsonlSource(str(path), text_fields=("text",))
  with pytest.raises(ConfigError, match=r"rows\.jsonl:2: JSON nested too deeply"):
    source[1]
  with pytest.raises(ConfigError, match=r"rows\.jsonl:3: field 'text' holds a lone surrogate "
                     r"\('\\ud800' at character 2\)"):
    source[2]
  with pytest.raises(ConfigError, match=r"rows\.jsonl:3: field 'text' holds a lone surrogate"):
    list(JsonlStream(str(path), "text").examples(0, skip=2))
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "cut.parquet")
  data = (tmp_path / "cut.parquet").read_bytes()
  (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
  for make in (lambda: len(ParquetSource(str(tmp_path / "cut.parquet"))),
               lambda: list(ParquetStream(str(tmp_path / "cut.parquet")).examples(0))):
    with pytest.raises(ConfigError, match=r"cut\.parquet: not a readable Parquet file"):
      make()


def test_a_null_in_a_parquet_or_arrow_text_column_names_the_file_and_row(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  from t5lite.data.sources.readers import ParquetSource
  from t5lite.data.sources.streams import ArrowStream, ParquetStream
  table = pa.table({"text": ["a", "b", None], "id": [1, 2, 3]})
  pq.write_table(table, tmp_path / "rows.parquet", row_group_size=2)
  with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink:
    with pa.ipc.new_stream(sink, table.schema) as writer:
      writer.write_table(table)
  assert ParquetSource(str(tmp_path / "rows.parquet"), text_fields="text")[1]["text"] == "b"
  with pytest.raises(ConfigError, match=r"rows\.parquet: row 3: field 'text' is null, expected "
                     "text"):
    ParquetSource(str(tmp_path / "rows.parquet"), text_fields=("text",))[2]
  for stream in (ParquetStream(str(tmp_path / "rows.parquet"), text_fields=("text",)),
                 ArrowStream(str(tmp_path / "rows.arrow"), text_fields=("text",))):
    with pytest.raises(ConfigError, match=r"rows\.(parquet|arrow): row 3: field 'text' is null"):
      list(stream.examples(0))


def test_local_glue_files_name_the_row_and_field(tmp_path, monkeypatch):
  cola = tmp_path / "glue" / "cola"
  cola.mkdir(parents=True)
  (cola / "train.jsonl").write_text('{"sentence": "He left.", "label": 1}\n'
                                    '{"sentence": null, "label": 0}\n')
  (cola / "validation.tsv").write_text("label\tidx\n1\t0\n")
  (cola / "test.tsv").write_text("sentence\tidx\nShe ran.\n")
  monkeypatch.setenv("T5LITE_LOCAL_DATA_DIR", str(tmp_path))
  open_split = lambda split: glue.open_split("glue/cola:2.0.0", split, ("sentence",))
  with pytest.raises(ConfigError, match=r"train\.jsonl:2: field 'sentence' is null"):
    open_split("train")[1]
  with pytest.raises(ConfigError, match=r"validation\.tsv:1: .* no field 'sentence'"):
    open_split("validation")
  with pytest.raises(ConfigError, match=r"test\.tsv:2: 1 tab-separated fields, expected 2 "
                     r".*no 'idx'"):
    open_split("test")[0]
  with pytest.raises(ConfigError, match="null"):
    glue.as_text(None)  # never the text "None"


def test_tsv_rows_missing_a_field_name_it(tmp_path):
  path = tmp_path / "pairs.tsv"
  path.write_text("hi\tsalut\nthanks\n")
  with pytest.raises(ConfigError, match=r"pairs\.tsv:2: 1 tab-separated .* no 'targets'"):
    TsvSource(str(path), ("inputs", "targets"))[1]


# ------------------------------------------------------------------ 4. feature lengths

@pytest.mark.parametrize("lengths, message", [
    ("{'inputs': 1000000000000, 'targets': 114}", r"TASK_FEATURE_LENGTHS\['inputs'\] = 1,000,000,000,000"),
    ("{'inputs': 512.5, 'targets': 114}", r"TASK_FEATURE_LENGTHS\['inputs'\] must be an integer"),
    ("{'inputs': '512', 'targets': 114}", r"TASK_FEATURE_LENGTHS\['inputs'\] must be an integer"),
    ("{'inputs': 0, 'targets': 114}", r"TASK_FEATURE_LENGTHS\['inputs'\] must be >= 1"),
])
def test_bad_feature_lengths_exit_2_before_any_allocation(lengths, message, capsys):
  assert cli.main(TRAIN + [f"--gin.TASK_FEATURE_LENGTHS={lengths}"]) == 2
  assert re.search(message, _error(capsys))


def test_lengths_and_batch_products_that_cannot_fit_are_refused():
  config = dict(model_dir="/tmp/x", train_steps=1, mixture_or_task_name="stdlib_span_corruption")
  with pytest.raises(ConfigError, match=r"TASK_FEATURE_LENGTHS\['inputs'\] = 1,000,000,000,000"):
    TrainConfig(batch_size=8, task_feature_lengths={"inputs": 10**12, "targets": 8}, **config)
  with pytest.raises(ConfigError, match="tokens per batch"):
    TrainConfig(batch_size=4096, task_feature_lengths={"inputs": MAX_FEATURE_LENGTH}, **config)
  with pytest.raises(ConfigError, match=r"task_feature_lengths\['targets'\]"):
    pipeline.PipelineConfig(global_batch_size=2, task_feature_lengths={"targets": 10**12})
  with pytest.raises(SystemExit) as exit_:
    cli.main(["tasks", "show", "stdlib_span_corruption", "--lengths", "inputs=1000000000000"])
  assert exit_.value.code == 2


# ------------------------------------------------------------------ 5. integer settings

@pytest.mark.parametrize("binding, message", [
    ("TRAIN_STEPS=10.5", r"TRAIN_STEPS \(TrainConfig.train_steps\) must be an integer, got "
                         r"10.5 \(float\): use 10 or 11"),
    ("BATCH_SIZE=2.5", r"BATCH_SIZE \(TrainConfig.batch_size\) must be an integer.*use 2 or 3"),
    ("BATCH_SIZE=True", r"BATCH_SIZE \(TrainConfig.batch_size\) must be an integer, got True"),
    ("TRAIN_STEPS='10'", r"TRAIN_STEPS \(TrainConfig.train_steps\) .* got '10' \(str\)"),
    ("EVAL_PERIOD=100.0", r"EVAL_PERIOD \(TrainConfig.eval_period\) .* write 100"),
    ("TrainConfig.log_period=1.5", r"TrainConfig.log_period must be an integer"),
    ("CheckpointConfig.period=2.5", r"CheckpointConfig.period must be an integer"),
    ("CheckpointConfig.keep=2.5", r"CheckpointConfig.keep must be an integer or None"),
])
def test_non_integer_settings_exit_2_naming_the_macro(binding, message, capsys):
  assert cli.main(TRAIN + [f"--gin.{binding}"]) == 2
  assert re.search(message, _error(capsys))


def test_train_config_refuses_non_integers_from_python():
  config = dict(model_dir="/tmp/x", mixture_or_task_name="t", task_feature_lengths={})
  with pytest.raises(ConfigError, match="TrainConfig.train_steps must be an integer, got 10.5"):
    TrainConfig(train_steps=10.5, batch_size=2, **config)
  with pytest.raises(ConfigError, match="TrainConfig.batch_size must be an integer, got True"):
    TrainConfig(train_steps=10, batch_size=True, **config)
  with pytest.raises(ConfigError, match="TrainConfig.eval_period"):
    TrainConfig(train_steps=10, batch_size=2, eval_period=2.5, **config)
  assert TrainConfig(train_steps=np.int64(10), batch_size=2, **config).train_steps == 10


# ------------------------------------------------------------------ 6. t5lite infer

def test_infer_refuses_null_and_number_inputs_naming_the_line(tmp_path):
  path = tmp_path / "in.jsonl"
  path.write_text('{"inputs": "fine"}\n{"inputs": null}\n')
  with pytest.raises(ConfigError, match=r"in\.jsonl line 2: 'inputs' is null, expected text"):
    list(run._read_inputs(str(path)))
  path.write_text('{"inputs": 5}\n')
  with pytest.raises(ConfigError, match=r"line 1: 'inputs' is int"):
    list(run._read_inputs(str(path)))


def test_max_decode_length_0_is_refused_and_none_is_the_default(capsys):
  assert cli.main(["infer", "--gin_file=gin/runs/infer.gin", "--gin.CHECKPOINT_PATH=/tmp/x",
                   "--gin.MAX_DECODE_LENGTH=0"]) == 2
  assert "MAX_DECODE_LENGTH (DecodeConfig.max_decode_length) must be >= 1, got 0" in \
      _error(capsys)
  config = run.InferConfig(checkpoint_path="/tmp/x", decode=DecodeConfig(max_decode_length=None))
  assert config.decode.max_decode_length is None
  with pytest.raises(ConfigError, match="MAX_DECODE_LENGTH"):
    run.EvalConfig(checkpoint_path="/tmp/x", mixture_or_task_name="t",
                   task_feature_lengths={"inputs": 8}, decode=DecodeConfig(max_decode_length=-1))


@pytest.mark.parametrize("where", ["folder", "missing_folder", "under_a_file"])
def test_a_bad_infer_output_exits_2_before_the_model_loads(where, tmp_path, monkeypatch, capsys):
  from t5lite.data.vocab import vocabularies
  from t5lite.runtime import model_dir

  def never(*args, **kwargs):
    raise AssertionError("loaded the model before checking INFER_OUTPUT")
  monkeypatch.setattr(vocabularies, "load_vocabulary", never)
  monkeypatch.setattr(model_dir, "load_params", never)
  inputs = tmp_path / "in.txt"
  inputs.write_text("hello\n")
  output = {"folder": tmp_path, "missing_folder": tmp_path / "nope" / "out.jsonl",
            "under_a_file": inputs / "out.jsonl"}[where]
  assert cli.main(["infer", "--gin_file=gin/runs/infer.gin", f"--gin.CHECKPOINT_PATH={tmp_path}",
                   f"--gin.INFER_INPUT={inputs}", f"--gin.INFER_OUTPUT={output}"]) == 2
  line = _error(capsys)
  assert f"INFER_OUTPUT={output}" in line
  assert sorted(os.listdir(tmp_path)) == ["in.txt"]


# ------------------------------------------------------------------ 7. atomic first-use builds

def _dead_pid() -> int:
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


def _complete(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "done"))


def _build(content: str):
  def build(path):
    with open(os.path.join(path, "data"), "w") as f:
      f.write(content)
    with open(os.path.join(path, "done"), "w") as f:
      f.write("")
  return build


def test_build_dir_recovers_from_killed_builds(tmp_path):
  target = str(tmp_path / "built")
  # A build killed halfway by an older version: the target exists, incomplete.
  os.makedirs(target)
  (tmp_path / "built" / "data").write_text("half")
  # One killed after this one's design: its temporary folder, its process gone.
  leftover = tmp_path / f".built.tmp-{atomic._HOST}-{_dead_pid()}-0123abcd"
  leftover.mkdir()
  (leftover / "data").write_text("half")

  def interrupted(path):
    (tmp_path / "seen").write_text(path)
    raise KeyboardInterrupt  # as Ctrl-C halfway
  with pytest.raises(KeyboardInterrupt):
    atomic.build_dir(target, interrupted, _complete)
  assert not os.path.exists((tmp_path / "seen").read_text())  # its temp folder went too
  assert atomic.build_dir(target, _build("full"), _complete) == target
  assert (tmp_path / "built" / "data").read_text() == "full"
  assert sorted(os.listdir(tmp_path)) == ["built", "seen"]


def test_two_builders_at_once_keep_one_copy(tmp_path):
  target = str(tmp_path / "built")

  def racing(path):  # another process publishes while this one builds
    _build("first")(path)
    other = atomic.temp_path(target)
    os.makedirs(other)
    _build("second")(other)
    assert atomic.publish_dir(other, target, _complete)
  atomic.build_dir(target, racing, _complete)
  assert (tmp_path / "built" / "data").read_text() == "second"
  assert os.listdir(tmp_path) == ["built"]  # the loser discarded its copy


def _killed_embedded_build_state(directory):
  """What a build of the embedded data killed halfway left before builds were atomic."""
  partial = directory / embedded.DATASET / "incomplete.Q1W2E3_1.0.0"
  partial.mkdir(parents=True)
  (partial / "t5lite_stdlib_docs-train.array_record-00000-of-00001").write_bytes(b"\0" * 100)
  (directory / "spiece.model").write_bytes(b"")


def _assert_same_as_reference(directory, reference):
  """directory holds what `reference` (a complete build) holds."""
  assert is_prepared_dir(str(directory / embedded.DATASET / VERSION))
  for split in ("train", "validation"):
    built = embedded.TfdsSource(embedded.DATASET, split, data_dir=str(directory))
    expected = embedded.TfdsSource(embedded.DATASET, split, data_dir=reference)
    assert len(built) == len(expected) and built[0] == expected[0] and built[-1] == expected[-1]
  assert (directory / "spiece.model").read_bytes() == \
      open(os.path.join(reference, "spiece.model"), "rb").read()
  assert sorted(os.listdir(directory / embedded.DATASET)) == [VERSION]
  assert not [n for n in os.listdir(directory) if n.startswith(".") and n != ".lock"]


def _fresh_build(tmp_path, monkeypatch) -> str:
  """A clean build of the embedded data in this process: what a rebuild must equal. (Not the
  suite's shared build: that one may come from a process in another state, e.g. with other
  TFDS builders registered by earlier tests.)"""
  monkeypatch.setenv("T5LITE_DATA_DIR", str(tmp_path / "clean"))
  return embedded.prepare.__wrapped__()


def test_embedded_data_is_rebuilt_after_a_killed_build(tmp_path, monkeypatch):
  reference = _fresh_build(tmp_path, monkeypatch)
  monkeypatch.setenv("T5LITE_DATA_DIR", str(tmp_path))
  directory = tmp_path / os.path.basename(embedded.data_dir())
  _killed_embedded_build_state(directory)
  assert embedded.prepare.__wrapped__() == str(directory)
  _assert_same_as_reference(directory, reference)


@pytest.mark.e2e
@pytest.mark.slow
def test_embedded_build_sigkilled_midway_is_rebuilt(tmp_path, monkeypatch):
  reference = _fresh_build(tmp_path, monkeypatch)
  monkeypatch.setenv("T5LITE_DATA_DIR", str(tmp_path))
  directory = tmp_path / os.path.basename(embedded.data_dir())
  child = subprocess.Popen([sys.executable, "-c", "from t5lite_tasks import embedded; "
                            "embedded.prepare()"], cwd=REPO, env=dict(os.environ),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  dataset = directory / embedded.DATASET
  deadline = time.time() + 120
  while not (dataset.is_dir() and os.listdir(dataset)) and child.poll() is None:
    assert time.time() < deadline
    time.sleep(0.01)
  child.send_signal(signal.SIGKILL)  # mid-build: its temporary folder is there
  assert child.wait() == -signal.SIGKILL
  assert not is_prepared_dir(str(dataset / VERSION))
  assert embedded.prepare.__wrapped__() == str(directory)
  _assert_same_as_reference(directory, reference)


def test_cache_shards_are_written_under_unique_temporary_names(tmp_path):
  from t5lite.data import cache
  from t5lite.data.registry import TaskRegistry
  task = TaskRegistry.get("stdlib_docstring_summary")
  out_dir = tmp_path / task.name / "validation"
  out_dir.mkdir(parents=True)
  # A killed run of older code: a fixed-name temporary and a cut-short info file.
  (out_dir / "shard-00000-of-00001.array_record.tmp").write_bytes(b"\0" * 10)
  (out_dir / "shard-00000-of-00001.json").write_text('{"task": ')
  with pytest.raises(FileNotFoundError, match="unreadable"):
    cache.cached_source(task, "validation", str(tmp_path))
  info = cache.cache_task(task, "validation", str(tmp_path))
  assert len(cache.cached_source(task, "validation", str(tmp_path))) == info["examples"]
  assert json.loads((out_dir / "shard-00000-of-00001.json").read_text()) == info
