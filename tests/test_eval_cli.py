"""`t5lite eval` and `t5lite infer` on a checkpoint, as users run them (gin run files)."""
import json
import os
import subprocess

import jax
import numpy as np
import pytest

import train_tasks
from helpers.cli import run_t5lite
from helpers.terminal import on_terminal, redrawn
from helpers import quiet, tiny, train_config
from t5lite import cli
from t5lite.data.registry import TaskRegistry
from t5lite.eval import metrics, run
from t5lite.eval.evaluator import DecodeConfig
from t5lite.models.decoding import search as decoding
from t5lite.runtime import partitioning as part
from t5lite.runtime.model_dir import load_params
from t5lite.train.trainer import train

LENGTHS = "{'inputs': 64, 'targets': 16}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A tiny model trained 3 steps on the copy task (whose metrics are then evaluated)."""
  task = TaskRegistry.get("train_test_copy")
  object.__setattr__(task, "metric_fns", (metrics.sequence_accuracy, metrics.bleu,
                                          metrics.mean_log_likelihood))
  directory = tmp_path_factory.mktemp("run")
  train(tiny(vocab_size=384), train_config(directory), log=quiet)
  yield directory
  object.__setattr__(task, "metric_fns", ())


def test_eval_writes_metrics_and_predictions(model_dir, capsys):
  argv = ["eval", "--gin_file=gin/runs/eval.gin", f"--gin.CHECKPOINT_PATH={model_dir}",
          "--gin.MIXTURE_OR_TASK_NAME=train_test_copy", f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}",
          "--gin.EvalConfig.max_examples=10", "--gin.BATCH_SIZE=4"]
  assert cli.main(argv) == 0
  said = capsys.readouterr()
  assert "checkpoint step 3" in said.out
  # Progress on stderr (not a terminal here: a plain line): 10 examples decoded and scored.
  assert "eval train_test_copy: 20/20 examples (100%)" in said.err
  saved = json.loads((model_dir / "eval" / "metrics-3.json").read_text())
  assert saved["step"] == 3
  assert {"eval/train_test_copy/sequence_accuracy", "eval/train_test_copy/bleu",
          "eval/train_test_copy/mean_log_likelihood"} <= set(saved)
  records = [json.loads(line) for line in open(model_dir / "eval" / "train_test_copy-3.jsonl")]
  assert len(records) == 10
  assert records[0]["inputs"] == train_tasks.documents(64, 1)[0]["text"]
  # The predictions are the model's own greedy decodes, and the scores its log-likelihoods.
  # Decoded as eval lays the model out, in a batch of eval's size: its compiled program.
  mesh, rules = part.make_mesh(part.MeshConfig()), part.logical_axis_rules()
  model_config, params, _ = load_params(model_dir, mesh, rules)
  first = np.zeros((4, 64), np.int32)
  ids = np.append(train_tasks.VOCAB.encode(records[0]["inputs"])[:63], 1)
  first[0, :len(ids)] = ids
  with part.activate(mesh, rules):
    tokens = decoding.generate(model_config, params, first, max_decode_length=16)
  assert records[0]["prediction"] == train_tasks.VOCAB.decode(tokens[0].tolist())
  assert saved["eval/train_test_copy/mean_log_likelihood"] == pytest.approx(
      np.mean([r["score"] for r in records]))
  assert all(r["score"] < 0 for r in records)


@pytest.mark.e2e
@pytest.mark.slow
def test_infer_reads_lines_and_jsonl_and_writes_jsonl(model_dir, tmp_path):
  inputs = tmp_path / "inputs.txt"
  inputs.write_text('alpha beta gamma\n{"inputs": "théta eta"}\n\ndelta\n', encoding="utf-8")
  out = tmp_path / "out.jsonl"
  assert cli.main(["infer", "--gin_file=gin/runs/infer.gin", f"--gin.CHECKPOINT_PATH={model_dir}",
                   f"--gin.INFER_INPUT={inputs}", f"--gin.INFER_OUTPUT={out}",
                   "--gin.INPUTS_LENGTH=64", "--gin.MAX_DECODE_LENGTH=8",
                   "--gin.BATCH_SIZE=2"]) == 0
  records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
  assert [r["inputs"] for r in records] == ["alpha beta gamma", "théta eta", "delta"]
  assert all(isinstance(r["prediction"], str) for r in records)
  # The same through stdin and stdout, in a subprocess, as `echo ... | t5lite infer`.
  result = run_t5lite("infer", "--gin_file=gin/runs/infer.gin",
                      f"--gin.CHECKPOINT_PATH={model_dir}", "--gin.INPUTS_LENGTH=64",
                      "--gin.MAX_DECODE_LENGTH=8", "--gin.BATCH_SIZE=2",
                      input=inputs.read_text(encoding="utf-8"), timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert [json.loads(line) for line in result.stdout.splitlines()] == records
  assert "3 inputs decoded" in result.stderr
  assert "infer: 3/3 inputs (100%)" in result.stderr


def test_bad_jsonl_line_is_named(model_dir, tmp_path, capsys):
  inputs = tmp_path / "bad.jsonl"
  inputs.write_text('{"text": "no inputs field"}\n')
  assert cli.main(["infer", "--gin_file=gin/runs/infer.gin", f"--gin.CHECKPOINT_PATH={model_dir}",
                   f"--gin.INFER_INPUT={inputs}"]) == 2
  assert "bad.jsonl line 1: a JSON object needs an 'inputs' field" in capsys.readouterr().err


def test_eval_of_a_task_without_metrics_says_so(model_dir, capsys):
  assert cli.main(["eval", "--gin_file=gin/runs/eval.gin", f"--gin.CHECKPOINT_PATH={model_dir}",
                   "--gin.MIXTURE_OR_TASK_NAME=train_test_sc"]) == 2
  assert "have no metric_fns" in capsys.readouterr().err


def test_only_process_0_writes_files_and_prints(model_dir, tmp_path, monkeypatch, capsys):
  """In a pod job every process runs eval and infer (they decode together, the model laid
  out over all devices); the others write and print nothing."""
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  said = []
  metrics = run.evaluate_checkpoint(run.EvalConfig(
      checkpoint_path=str(model_dir), mixture_or_task_name="train_test_copy",
      task_feature_lengths={"inputs": 64, "targets": 16}, output_dir=str(tmp_path / "eval"),
      max_examples=4, decode=DecodeConfig(batch_size=4)), log=said.append)
  assert "eval/train_test_copy/sequence_accuracy" in metrics
  inputs = tmp_path / "inputs.txt"
  inputs.write_text("alpha beta\ngamma\n", encoding="utf-8")
  assert run.infer(run.InferConfig(
      checkpoint_path=str(model_dir), input_path=str(inputs), output_path="-", inputs_length=64,
      decode=DecodeConfig(max_decode_length=8, batch_size=2))) == 2
  assert os.listdir(tmp_path) == ["inputs.txt"] and not said
  quiet = capsys.readouterr()
  assert quiet.out == "" and "eval train_test_copy:" not in quiet.err and "infer:" not in quiet.err


def test_checkpoint_urls_of_other_schemes_than_buckets_are_refused(capsys):
  assert cli.main(["infer", "--gin_file=gin/runs/infer.gin",
                   "--gin.CHECKPOINT_PATH=hdfs://b/run"]) == 2
  assert ("CHECKPOINT_PATH='hdfs://b/run': t5lite reads and writes gs://BUCKET/PATH and "
          "s3://BUCKET/PATH URLs and local folders") in capsys.readouterr().err


def test_eval_on_a_terminal_shows_a_progress_bar(model_dir, monkeypatch, tmp_path):
  with on_terminal(monkeypatch) as screen:
    assert cli.main(["eval", "--gin_file=gin/runs/eval.gin", f"--gin.CHECKPOINT_PATH={model_dir}",
                     "--gin.MIXTURE_OR_TASK_NAME=train_test_copy",
                     f"--gin.TASK_FEATURE_LENGTHS={LENGTHS}", "--gin.EvalConfig.max_examples=6",
                     "--gin.BATCH_SIZE=4", f"--gin.EVAL_OUTPUT_DIR={tmp_path}"]) == 0
  shown = screen()
  # tqdm's bar, redrawn in place: 6 examples decoded and scored, in batches of 4.
  assert redrawn(shown) and "eval train_test_copy: 100%|" in shown and "12/12" in shown
