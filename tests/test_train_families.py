"""Decoder-only (causal LM, prefix LM) and encoder-only (MLM) models trained by the trainer.

test_trainer.py runs encoder-decoders through t5lite.train.trainer.train; here the other
families go the same way, on the small tasks of train_tasks.py (the same word documents as
causal LM, prefix LM and BERT MLM examples): the trainer picks each family's feature
converter and loss from ModelConfig.architecture, the loss falls within 30 steps, metrics.jsonl
holds a row per logged step and the end-of-run eval, and a Mixture-of-Experts causal LM
resumed from a checkpoint (dropout and router jitter on) continues with the very losses and
params of the uninterrupted run, as does an ELECTRA pair (generator and discriminator in one
train state).
"""
import os
import shutil

import pytest

import train_tasks  # noqa: F401 (registers train_test_lm, train_test_prefix_lm, train_test_mlm)
from helpers import (assert_trees_equal, checkpoint_params, logged_losses, metrics_records,
                     quiet, tiny_decoder_only, tiny_encoder_only, train_config)
from t5lite.models.electra_config import ElectraConfig
from t5lite.models.moe.config import MoeConfig
from t5lite.runtime.checkpoints import CheckpointConfig
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.trainer import train

# Checkpoints at 15 and 30 only: the resumed runs need one halfway and the last; each save
# more costs every family's run its time.
STEPS, LOG_PERIOD, CHECKPOINT_PERIOD = 30, 5, 15
# family -> (model, task, task feature lengths)
FAMILIES = {
    "causal_lm": (tiny_decoder_only(dropout_rate=0.1), "train_test_lm", {"targets": 32}),
    "prefix_lm": (tiny_decoder_only(prefix_lm=True), "train_test_prefix_lm",
                  {"inputs": 16, "targets": 16}),
    "mlm": (tiny_encoder_only(), "train_test_mlm", {"inputs": 32}),
    # ELECTRA: a half-width generator beside the discriminator, one train state. One layer:
    # with two, the 30 steps' loss fell to 0.85 of its first logged value, close to the test's
    # 0.9; with one, to 0.65 (the compile takes as long either way).
    "electra": (tiny_encoder_only(family="electra",
                                  electra=ElectraConfig(generator_hidden_fraction=0.5),
                                  type_vocab_size=2, embedding_norm=True, dropout_rate=0.1,
                                  num_encoder_layers=1),
                "train_test_mlm", {"inputs": 32}),
    # Mixture-of-Experts: top-2 with jitter and dropout. (Top-1 Switch layers in an encoder
    # stack train through the trainer in test_moe_parallel.py, on one device and sharded.)
    "moe_causal_lm": (tiny_decoder_only(dropout_rate=0.1, moe=MoeConfig(
        num_experts=3, top_k=2, jitter_noise=0.01, encoder_sparse_step=1)),
        "train_test_lm", {"targets": 32}),
}


def run_config(model_dir, family: str):
  """STEPS AdamW steps (constant 1e-2) on the family's task, logged every LOG_PERIOD, one
  2-batch eval at the end, a checkpoint every CHECKPOINT_PERIOD (all kept)."""
  _, task, lengths = FAMILIES[family]
  return train_config(model_dir, train_steps=STEPS, mixture_or_task_name=task,
                      task_feature_lengths=lengths, log_period=LOG_PERIOD, eval_period=STEPS,
                      eval_steps=2,
                      optimizer=OptimizerConfig(name="adamw", schedule=ScheduleConfig(
                          "constant", 1e-2, warmup_steps=0)),
                      checkpoint=CheckpointConfig(period=CHECKPOINT_PERIOD, keep=None))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """family -> (model dir, TrainResult) of an uninterrupted STEPS-step run, made on first use."""
  done = {}

  def run(family):
    if family not in done:
      model_dir = tmp_path_factory.mktemp(family)
      done[family] = model_dir, train(FAMILIES[family][0], run_config(model_dir, family),
                                      log=quiet)
    return done[family]
  return run


def grouped(families):
  """Each family's tests in one xdist group: the worker that made a family's run for one test
  reuses it (the `runs` fixture) and its compiled programs for the next, where on another
  worker the resume test would train the whole reference run again."""
  return [pytest.param(f, marks=pytest.mark.xdist_group(f"train_families_{f}")) for f in families]


@pytest.mark.parametrize("family", grouped(sorted(FAMILIES)))
def test_the_loss_falls_and_metrics_jsonl_has_every_logged_step(runs, family):
  model_dir, result = runs(family)
  _, task, _ = FAMILIES[family]
  records = metrics_records(model_dir)
  rows = [r for r in records if "loss" in r]
  assert [r["step"] for r in rows] == list(range(LOG_PERIOD, STEPS + 1, LOG_PERIOD))
  assert {"learning_rate", "accuracy", "grad_norm", "tokens_per_s"} <= set(rows[0])
  # XLA's estimate of the compiled step, once: the train state is an argument of it.
  assert rows[0]["step_memory_bytes"] > rows[0]["step_argument_bytes"] > 0
  assert "step_memory_bytes" not in rows[1]
  assert logged_losses(model_dir) == {r["step"]: r["loss"] for r in rows}
  first, last = rows[0]["loss"], rows[-1]["loss"]
  # ELECTRA's first logged loss (step 5) is mostly 50 x a discriminator that already says
  # "original" everywhere (about H(0.15) nats); learning which tokens were replaced is slower.
  assert last < (0.9 if family == "electra" else 0.8) * first, [r["loss"] for r in rows]
  assert 0.0 <= rows[-1]["accuracy"] <= 1.0
  # The end-of-run eval of the validation split goes through the family's loss too.
  [evaluation] = [r for r in records if f"eval/{task}/loss" in r]
  assert evaluation["step"] == STEPS and 0 < evaluation[f"eval/{task}/loss"] < first
  assert result.step == STEPS
  if family == "electra":  # both losses and the discriminator's figures, in train and eval
    assert {"generator_loss", "discriminator_loss", "discriminator_accuracy",
            "replaced_precision", "replaced_recall"} <= set(rows[-1])
    assert 0.5 < rows[-1]["discriminator_accuracy"] <= 1.0
    assert f"eval/{task}/discriminator_accuracy" in evaluation
  if family.startswith("moe_"):  # router losses and routing figures, in train and eval
    experts = FAMILIES[family][0].moe.num_experts
    loads = [rows[-1][f"expert_load_{e}"] for e in range(experts)]
    assert abs(sum(loads) - 1.0) < 1e-5 and 0.0 <= rows[-1]["dropped_fraction"] < 1.0
    assert rows[-1]["router_z_loss"] > 0 and rows[-1]["router_aux_loss"] > 0
    assert f"eval/{task}/dropped_fraction" in evaluation


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("family", grouped(["electra", "moe_causal_lm"]))
def test_a_resumed_run_continues_bitwise(runs, family, tmp_path):
  """Restarted from its step-15 checkpoint (params, optimizer state, data position, dropout
  rng; ELECTRA's two networks and its sampling rng; the MoE causal LM's jitter rng besides its
  dropout), the run logs the losses and ends with the params of the uninterrupted one."""
  reference, _ = runs(family)
  model_dir = tmp_path / "resumed"
  shutil.copytree(reference, model_dir)
  for step in os.listdir(model_dir / "checkpoints"):
    if step.isdigit() and int(step) > CHECKPOINT_PERIOD:
      shutil.rmtree(model_dir / "checkpoints" / step)
  os.remove(model_dir / "metrics.jsonl")
  result = train(FAMILIES[family][0], run_config(model_dir, family), log=quiet)
  assert sorted(result.losses) == list(range(CHECKPOINT_PERIOD + LOG_PERIOD, STEPS + 1,
                                             LOG_PERIOD))
  expected = logged_losses(reference)
  assert logged_losses(model_dir) == {s: expected[s] for s in result.losses}  # bitwise
  _, params, step = checkpoint_params(model_dir)
  _, expected_params, expected_step = checkpoint_params(reference)
  assert step == expected_step == STEPS
  assert_trees_equal(params, expected_params)
