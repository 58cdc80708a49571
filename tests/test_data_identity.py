"""A data state names the files it points into: a resume on changed files is refused by name
(or accepted when asked), on indexed and streamed sources, in-process and with workers."""
import gzip
import json
import os

import numpy as np
import pytest

from t5lite.data import pipeline
from t5lite.data import preprocessors as pp
from t5lite.data.converters import sequence as conv
from t5lite.data.registry import Feature, TaskRegistry, add_task
from t5lite.data.sources.readers import FunctionSource, JsonlSource
from t5lite.data.sources.streams import JsonlStream
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError

VOCAB = ByteVocabulary()
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}
COPY = [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, pp.append_eos_after_trim]


def lines(n, tag):
  return [json.dumps({"text": f"{tag} {i} " + "word " * (i % 7)}) + "\n" for i in range(n)]


def _function_docs():
  return [{"text": f"doc {i}"} for i in range(40)]


NAMES = ("id_indexed", "id_streamed", "id_function")


def register(folder):
  """The tasks over the files in folder, with fresh sources (as a new process has)."""
  sources = {"id_indexed": JsonlSource(str(folder / "train.jsonl"), "text"),
             "id_streamed": JsonlStream(str(folder / "part-*.jsonl.gz"), "text"),
             "id_function": FunctionSource(_function_docs)}
  for name, source in sources.items():
    TaskRegistry.remove(name)
    add_task(name, {"train": source}, FEATURES, COPY)


@pytest.fixture
def tasks(tmp_path):
  (tmp_path / "train.jsonl").write_text("".join(lines(60, "a")))
  for s in range(3):
    with gzip.open(tmp_path / f"part-{s}.jsonl.gz", "wt") as f:
      f.writelines(lines(30, f"s{s}"))
  register(tmp_path)
  yield tmp_path
  for name in NAMES:
    TaskRegistry.remove(name)


def batches(name, state=None, num_workers=0, **config):
  config = pipeline.PipelineConfig(global_batch_size=4, seed=1, task_feature_lengths={
      "inputs": 32, "targets": 32}, **config)
  it = pipeline.get_dataset(name, config, conv.EncDecFeatureConverter(pack=False),
                            num_workers=num_workers)
  if state is not None:
    it.set_state(state)
  return it


def saved_state(name, n=3, **kwargs):
  it = batches(name, **kwargs)
  for _ in range(n):
    next(it)
  return json.loads(json.dumps(it.get_state()))


def test_a_replaced_file_is_refused_by_name_and_accepted_when_asked(tasks):
  state = saved_state("id_indexed")
  batches("id_indexed", state)  # unchanged: restores
  path = tasks / "train.jsonl"
  subset = lines(60, "a")[::2]
  np.random.default_rng(0).shuffle(subset)
  path.write_text("".join(subset))  # the case: a shuffled subset of the file
  with pytest.raises(ConfigError, match=r"task 'id_indexed' split 'train' changed since the "
                     r"data state was saved: .*train\.jsonl changed size \(\d+ -> \d+ bytes\)"
                     r".*accept_data_changes=True"):
    batches("id_indexed", state)
  batches("id_indexed", state, accept_data_changes=True)


def test_same_size_edits_and_new_or_removed_shards_are_noticed(tasks):
  state = saved_state("id_indexed")
  path = tasks / "train.jsonl"
  text = path.read_text()
  os.utime(path, ns=(1, 1))  # touched, or copied to another host: the same data
  batches("id_indexed", state)
  path.write_text(text.replace("a 3 ", "a 9 ", 1))  # same size, other contents
  with pytest.raises(ConfigError, match="same size, other contents"):
    batches("id_indexed", state)
  streamed = saved_state("id_streamed")
  with gzip.open(tasks / "part-3.jsonl.gz", "wt") as f:
    f.writelines(lines(30, "s3"))
  register(tasks)  # the run restarts: its glob finds the new shard
  with pytest.raises(ConfigError, match=r"part-3\.jsonl\.gz is new"):
    batches("id_streamed", streamed)
  os.remove(tasks / "part-3.jsonl.gz")
  os.remove(tasks / "part-0.jsonl.gz")
  register(tasks)
  with pytest.raises(ConfigError, match=r"part-0\.jsonl\.gz is gone"):
    batches("id_streamed", streamed)


def test_states_without_files_or_from_older_runs_restore(tasks):
  state = saved_state("id_function")
  assert state["data"] == {}  # a function's examples have no files to fingerprint
  batches("id_function", state)
  older = saved_state("id_indexed")
  del older["data"]  # saved before data states named their files
  (tasks / "train.jsonl").write_text("".join(lines(10, "b")))
  batches("id_indexed", older)


@pytest.mark.slow
def test_worker_processes_refuse_a_changed_file_too(tasks):
  state = saved_state("id_indexed", num_workers=1)
  assert [f[0] for f in state["data"]["id_indexed/train"]] == ["train.jsonl"]
  (tasks / "train.jsonl").write_text("".join(lines(61, "a")))
  with pytest.raises(ConfigError, match="changed size"):
    batches("id_indexed", state, num_workers=1)
