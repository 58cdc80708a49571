"""The embedded default tasks (stdlib prose) and the `t5lite tasks` / `t5lite cache` verbs."""
import json
import re

import numpy as np
import pytest

import t5lite_tasks  # noqa: F401 (registers the tasks)
from t5lite import cli
from t5lite.data import describe, pipeline
from t5lite.data.converters import EncDecFeatureConverter
from t5lite.data.registry import TaskRegistry
from t5lite_tasks import embedded

LENGTHS = {"inputs": 128, "targets": 32}


def test_corpus_is_prepared_once_with_a_trained_vocabulary():
  directory = embedded.prepare()
  train, validation = embedded.source("train"), embedded.source("validation")
  assert len(train) > 700 and 20 < len(validation) < 80
  assert not {train[i]["name"] for i in range(len(train))} & \
      {validation[i]["name"] for i in range(len(validation))}
  vocab = embedded.VOCABULARY
  assert vocab.vocab_size == embedded.VOCAB_PIECES + embedded.EXTRA_IDS
  text = "Return a list of the words in the string, using sep as the delimiter."
  assert vocab.decode(vocab.encode(text).tolist()) == text
  assert len(vocab.encode(text)) < len(text) / 2.5  # a real subword vocabulary, not bytes
  assert embedded.prepare() == directory


def test_span_corruption_task_makes_t5_examples():
  ex = describe.preprocessed_examples(TaskRegistry.get("stdlib_span_corruption"), "train",
                                      LENGTHS, 3)
  vocab = embedded.VOCABULARY
  for e in ex:
    assert len(e["inputs"]) == 128 and e["inputs"][-1] == 1 and e["targets"][-1] == 1
    assert e["targets"][0] == vocab.vocab_size - 1  # <extra_id_0> opens the targets


def test_docstring_summary_task_and_its_metric():
  task = TaskRegistry.get("stdlib_docstring_summary")
  ex = describe.preprocessed_examples(task, "validation", {"inputs": 256, "targets": 32}, 2)
  for e in ex:
    assert e["inputs_pretokenized"].startswith("summarize: ")
    assert e["targets_pretokenized"].endswith(".") and e["targets"][-1] == 1
  reference = [e["targets_pretokenized"] for e in ex]
  scores = task.metric_fns[0](reference, [task.postprocess_fn(" " + r + " ") for r in reference])
  assert scores["rouge1"] == pytest.approx(100.0)


def test_tasks_cli_list_show_stats(capsys):
  assert cli.main(["tasks", "list"]) == 0
  out = capsys.readouterr().out
  assert "stdlib_span_corruption" in out and "glue_v002_proportional" in out
  assert cli.main(["tasks", "show", "stdlib_docstring_summary", "-n", "1", "--split",
                   "validation", "--lengths", "inputs=256,targets=32"]) == 0
  out = capsys.readouterr().out
  assert "raw example 0" in out and re.search(r"decoded: ['\"]summarize:", out)
  assert cli.main(["tasks", "stats", "stdlib_span_corruption", "--max_examples", "50",
                   "--lengths", "inputs=128,targets=32"]) == 0
  stats = json.loads(capsys.readouterr().out)
  assert stats["examples"] == 50 and stats["inputs"]["max"] == 128
  assert 0.9 < stats["packing_efficiency"] <= 1.0
  assert cli.main(["tasks", "show", "stdlib_sumary"]) == 2
  assert "closest: stdlib_docstring_summary" in capsys.readouterr().err


def test_cache_cli_and_cached_training_data(tmp_path, capsys):
  assert cli.main(["cache", "stdlib_span_corruption", "--split", "train",
                   "--cache_dir", str(tmp_path)]) == 0
  info = json.loads(capsys.readouterr().out.splitlines()[-1])
  assert info["examples"] == info["source_examples"] > 700
  converter = EncDecFeatureConverter()
  runs = []
  for cached in (True, False):
    config = pipeline.PipelineConfig(global_batch_size=4, task_feature_lengths=LENGTHS,
                                     use_cached=cached, cache_dir=str(tmp_path))
    runs.append(next(pipeline.get_dataset("stdlib_span_corruption", config, converter)))
  for key in runs[0]:
    np.testing.assert_array_equal(runs[0][key], runs[1][key])
