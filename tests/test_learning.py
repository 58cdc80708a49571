"""Proof that the pieces are wired: a tiny T5 learns to copy short strings, measured by the
task's own metric on greedy decodes (train loop -> checkpoint -> decoding -> postprocess ->
metrics), as a user's finetuning run would be.
"""
import json

import numpy as np
import pytest

from helpers import tiny
from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, TaskRegistry, add_task
from t5lite.data.sources.readers import FunctionSource
from t5lite.eval import metrics
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.trainer import TrainConfig, train
from train_tasks import FEATURES

# 400 training steps, then greedy decodes: a long run.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LETTERS = list("abcdefghij")
EXACT_MATCH_GOAL = 90.0  # percent of validation strings copied exactly


def strings(n: int, seed: int) -> list[dict]:
  rng = np.random.RandomState(seed)
  return [{"text": "".join(rng.choice(LETTERS, rng.randint(3, 9)))} for _ in range(n)]


def _train():
  return strings(4096, 0)


def _validation():
  return strings(64, 1)


@pytest.fixture(scope="module")
def copy_task():
  TaskRegistry.remove("learn_copy")
  yield add_task("learn_copy", {"train": FunctionSource(_train),
                                "validation": FunctionSource(_validation)}, FEATURES,
                 [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, CACHE_POINT,
                  pp.append_eos_after_trim], metric_fns=[metrics.sequence_accuracy])
  TaskRegistry.remove("learn_copy")


def test_tiny_t5_learns_to_copy_strings(copy_task, tmp_path):
  config = TrainConfig(
      model_dir=str(tmp_path), train_steps=400, batch_size=32, mixture_or_task_name="learn_copy",
      task_feature_lengths={"inputs": 12, "targets": 12}, log_period=100, eval_period=0,
      infer_eval_period=400, infer_eval_examples=64, run_eval_before_training=True,
      optimizer=OptimizerConfig(name="adamw", schedule=ScheduleConfig(
          name="linear", value=3e-3, warmup_steps=40, decay_steps=360, end_value=3e-4)),
      checkpoint=CheckpointConfig(period=1000, keep=1,
                                  best_metric="eval/learn_copy/sequence_accuracy"))
  messages = []
  result = train(tiny(vocab_size=384, d_model=64, d_ff=128, d_kv=16), config,
                 log=messages.append)
  before = [m for m in messages if m.startswith("step 0 eval:")]
  assert before and "eval/learn_copy/sequence_accuracy 0.0000" in before[0]  # an untrained model
  exact = result.eval_metrics["eval/learn_copy/sequence_accuracy"]
  assert exact >= EXACT_MATCH_GOAL, result.eval_metrics
  assert result.losses[400] < 0.2 * result.losses[100]
  best = json.loads((tmp_path / "best_checkpoint.json").read_text())
  assert best == {"step": 400, "metric": "eval/learn_copy/sequence_accuracy", "value": exact}
  predictions = (tmp_path / "inference_eval" / "learn_copy-400.jsonl").read_text().splitlines()
  assert len(predictions) == 64
