"""A user's own family, objective, task and recipe, in a module outside the repository, train
through `t5lite train --module PATH` (t5lite.cli.import_modules: imported before gin parses,
so the module's gin configurables can be bound by the gin files and flags).

The module (written into a temporary folder) registers: a family (the decoder-only network
with its own loss and metrics), an objective (an LM over each line followed by its mirror
image: the second half is predictable from the first, so the loss falls fast), a task on a
text file beside it, and a recipe that freezes the token embedding and keeps a record in
MODEL_DIR, selected by TrainConfig.recipe = @FreezeEmbedding() in a gin file.
"""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap

import jax
import numpy as np
import pytest

from t5lite import cli

MODULE = "t5lite_user_ext"  # imported once per test process (registries are global)
USER_MODULE = '''
"""A user's t5lite extension: registers a family, an objective + task, and a recipe."""
import dataclasses
import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5lite import data
from t5lite.data import preprocessors as pp
from t5lite.data.sources.readers import TextLineSource
from t5lite.families import register as register_family
from t5lite.families.decoder_only import DecoderOnlyFamily
from t5lite.train import recipes

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = data.ByteVocabulary()
EVENTS = []  # the recipe's hooks, as they run


def mirror(ex):
  """The objective: a line's tokens, then the same tokens reversed."""
  tokens = np.asarray(ex["targets"], np.int32)[:15]
  return {**ex, "targets": np.concatenate([tokens, tokens[::-1]])}


if "user_mirror_lm" not in data.TaskRegistry.names():
  data.add_task("user_mirror_lm",
                {"train": TextLineSource(os.path.join(HERE, "user_corpus.txt"))},
                {"targets": data.Feature(VOCAB, add_eos=False)},
                [pp.rekey({"targets": "text"}), pp.tokenize, mirror])


@register_family
class MirrorFamily(DecoderOnlyFamily):
  """The decoder-only network with a loss of its own (plain token cross entropy, written
  out) and a metric of its own."""

  name = "user_mirror"

  def pretraining_preprocessors(self, vocabulary):
    return [mirror]

  def loss_fn(self, params, batch, rng):
    logits = self.logits(params, batch, rng).astype(jnp.float32)
    targets = batch["decoder_target_tokens"]
    weights = batch["decoder_loss_weights"].astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    hits = (jnp.argmax(logits, -1) == targets).astype(jnp.float32) * weights
    return jnp.sum(loss * weights), {"normalizer": jnp.sum(weights),
                                     "weight_sum": jnp.sum(weights), "correct": jnp.sum(hits)}

  def metrics(self, sums, normalizer):
    return {"weight_sum": sums["weight_sum"],
            "mirror_accuracy": sums["correct"] / jnp.maximum(sums["weight_sum"], 1.0)}


@dataclasses.dataclass(frozen=True)
class FreezeEmbedding:
  note: str = ""


gin.external_configurable(FreezeEmbedding, module="t5lite_user_ext")


@recipes.register
class FreezeEmbeddingRecipe(recipes.Recipe):
  """Trains everything but the token embedding; MODEL_DIR/user_recipe.json says so."""

  name = "user_freeze_embedding"
  options_type = FreezeEmbedding
  compiles_ahead = True

  def trainable_mask(self, family, params):
    EVENTS.append("trainable_mask")
    mask = family.trainable_mask(params)
    return {**mask, "token_embedder": jax.tree.map(lambda _: False, mask["token_embedder"])}

  def check(self, model_dir, vocabulary):
    EVENTS.append("check")

  def record(self, model_dir):
    EVENTS.append("record")
    note = self.options.note if self.options is not None else ""
    with open(os.path.join(model_dir, "user_recipe.json"), "w") as f:
      json.dump({"recipe": self.name, "note": note}, f)
'''
MODEL_GIN = """
MODEL_CONFIG = @ModelConfig()
ModelConfig.architecture = 'decoder_only'
ModelConfig.family = 'user_mirror'
ModelConfig.vocab_size = 384
ModelConfig.d_model = 32
ModelConfig.d_ff = 64
ModelConfig.num_heads = 4
ModelConfig.d_kv = 8
ModelConfig.num_encoder_layers = 0
ModelConfig.num_decoder_layers = 2
ModelConfig.position_encoding = 'rope'
ModelConfig.mlp_activation = 'swiglu'
ModelConfig.dropout_rate = 0.0
"""
RUN_GIN = """
include 'runs/pretrain.gin'
MIXTURE_OR_TASK_NAME = 'user_mirror_lm'
TASK_FEATURE_LENGTHS = {'targets': 32}
TRAIN_STEPS = 30
BATCH_SIZE = 8
EVAL_PERIOD = 0
TrainConfig.log_period = 1
OptimizerConfig.name = 'adamw'
ScheduleConfig.name = 'constant'
ScheduleConfig.value = 3e-3
ScheduleConfig.warmup_steps = 0
TrainConfig.recipe = @FreezeEmbedding()
FreezeEmbedding.note = 'set in a gin file'
"""


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
  """The folder holding the user's module, its corpus and gin files (nothing of the repo)."""
  folder = tmp_path_factory.mktemp("user_ext")
  (folder / f"{MODULE}.py").write_text(textwrap.dedent(USER_MODULE))
  rng = np.random.RandomState(0)
  words = ["alpha", "beta", "gamma", "delta", "the", "a"]
  (folder / "user_corpus.txt").write_text(
      "\n".join(" ".join(rng.choice(words, rng.randint(2, 5))) for _ in range(128)) + "\n")
  (folder / "model.gin").write_text(MODEL_GIN)
  (folder / "run.gin").write_text(RUN_GIN)
  (folder / "plain_run.gin").write_text(RUN_GIN.split("TrainConfig.recipe")[0])
  return folder


def _logged(model_dir) -> list[dict]:
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if "loss" in r]


def test_a_users_family_task_objective_and_recipe_train_through_t5lite_train(ext, tmp_path):
  model_dir = tmp_path / "run"
  code = cli.main(["train", "--module", str(ext / f"{MODULE}.py"),
                   "--gin_file", str(ext / "run.gin"), "--gin_file", str(ext / "model.gin"),
                   f"--gin.MODEL_DIR={model_dir}"])
  assert code == 0
  user = sys.modules[MODULE]
  # The recipe's hooks ran: the mask when the step was built, the check before MODEL_DIR was
  # written, the record once the run went on.
  assert user.EVENTS[0] == "trainable_mask"
  assert user.EVENTS.index("check") < user.EVENTS.index("record")
  assert json.loads((model_dir / "user_recipe.json").read_text()) == {
      "recipe": "user_freeze_embedding", "note": "set in a gin file"}
  # MODEL_DIR has the config: the user's family by name, the gin config with the recipe.
  saved = json.loads((model_dir / "model_config.json").read_text())
  assert saved["family"] == "user_mirror"
  assert "FreezeEmbedding.note = 'set in a gin file'" in (model_dir / "config.gin").read_text()
  # The user's loss and metrics trained it: finite, falling, its own metric logged.
  logged = _logged(model_dir)
  losses = [r["loss"] for r in logged]
  assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
  assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses
  assert "mirror_accuracy" in logged[-1] and "z_loss" not in logged[-1]
  # The recipe's mask froze exactly the embedding: bitwise its fresh init; the rest moved.
  from t5lite.families import family_of
  from t5lite.runtime import model_dir as model_dir_lib
  model_config, params, step = model_dir_lib.load_params(str(model_dir))
  assert step == 30
  init = family_of(model_config).init_params(jax.random.key(0))
  np.testing.assert_array_equal(jax.device_get(params["token_embedder"]["embedding"]),
                                jax.device_get(init["token_embedder"]["embedding"]))
  moved = [not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(jax.device_get(params["decoder"])),
      jax.tree.leaves(jax.device_get(init["decoder"])))]
  assert all(moved)


def test_a_module_by_name_registers_what_the_cli_and_train_config_find(ext, monkeypatch,
                                                                       capsys):
  """A module name on PYTHONPATH (seqio's and T5X's MIXTURE_OR_TASK_MODULE way) works too;
  its recipe is found by name (TrainConfig.recipe = 'user_freeze_embedding')."""
  monkeypatch.syspath_prepend(str(ext))
  assert cli.main(["tasks", "--module", MODULE, "list"]) == 0
  assert "user_mirror_lm" in capsys.readouterr().out
  from t5lite.train import recipes
  from t5lite.train.trainer import TrainConfig
  config = TrainConfig(model_dir="/tmp/unused", train_steps=1, batch_size=8,
                       mixture_or_task_name="user_mirror_lm",
                       task_feature_lengths={"targets": 32}, recipe="user_freeze_embedding")
  recipe = recipes.recipe_of(config)
  assert type(recipe).__name__ == "FreezeEmbeddingRecipe" and recipe.options is None
  assert "user_freeze_embedding" in recipes.names()


@pytest.mark.parametrize("argv, message", [
    (["--module", "no/such/user_module.py"], "--module no/such/user_module.py: no such .py file"),
    (["--module", "no_such_user_module_xyz"], "no module named 'no_such_user_module_xyz'"),
    (["--gin.TrainConfig.recipe='no_such_recipe'"], "unknown recipe 'no_such_recipe'"),
])
def test_a_missing_module_or_recipe_is_a_setup_mistake(ext, tmp_path, capsys, argv, message):
  code = cli.main(["train", "--gin_file", str(ext / "plain_run.gin"),
                   "--gin_file", str(ext / "model.gin"), f"--gin.MODEL_DIR={tmp_path}", *argv])
  assert code == 2
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err
  assert not os.listdir(tmp_path)  # refused before MODEL_DIR is written
