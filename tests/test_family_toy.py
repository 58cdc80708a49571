"""A model family is one module: a fourth family defined in this file alone trains through
t5lite.train. Its network is an encoder with a per-token binary head (its own Flax module),
its loss says which tokens the MLM objective chose (binary cross entropy, not token cross
entropy), and it freezes its token embedding through the trainable mask."""
from __future__ import annotations

import os
import re
import subprocess

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import train_tasks  # noqa: F401 (registers train_test_mlm)
from helpers import assert_trees_equal, metrics_records, quiet, tiny_encoder_only
from helpers import train_config
from t5lite.data.converters import sequence as converters
from t5lite.data.objectives.chains import mlm_preprocessors
from t5lite.families import Family, family_of, register
from t5lite.models.layers import Dense, Embed
from t5lite.models.transformer import Encoder
from t5lite.runtime import checkpoint_reader
from t5lite.runtime.model_dir import load_model_config
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.schedules import ScheduleConfig
from t5lite.train.trainer import Trainer, train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ChosenTokenDetector(nn.Module):
  """Encoder -> one logit per token: was this token chosen by the MLM objective?"""
  config: object
  deterministic: bool = True
  INPUTS = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions")

  @staticmethod
  def dummy_inputs(config):
    return {"encoder_input_tokens": jnp.ones((1, 1), jnp.int32)}

  @nn.compact
  def __call__(self, encoder_input_tokens, encoder_segment_ids=None, encoder_positions=None):
    cfg = self.config
    embedder = Embed(cfg.vocab_size, cfg.d_model, name="token_embedder")
    if encoder_segment_ids is None:
      encoder_segment_ids = (encoder_input_tokens > 0).astype(jnp.int32)
    if encoder_positions is None:
      encoder_positions = jnp.broadcast_to(jnp.arange(encoder_input_tokens.shape[1]),
                                           encoder_input_tokens.shape)
    x = Encoder(cfg, embedder, self.deterministic, name="encoder")(
        encoder_input_tokens, encoder_segment_ids, encoder_positions)
    return Dense((cfg.d_model,), (1,), ("embed", None), cfg.d_model ** -0.5,
                 name="detector")(x)[..., 0]  # (B, L)


@register
class ChosenTokenFamily(Family):
  name = "test_chosen_token_detection"
  token_features = ("encoder_input_tokens",)

  def converter(self, pack=True):
    return converters.EncoderOnlyFeatureConverter(pack=pack)

  def pretraining_preprocessors(self, vocabulary):
    return mlm_preprocessors(mask_id=vocabulary.vocab_size - 1)

  def make_model(self, *, enable_dropout=False, cache_length=0):
    return ChosenTokenDetector(self.config, deterministic=not enable_dropout)

  def trainable_mask(self, params):
    return {name: jax.tree.map(lambda _: name != "token_embedder", sub)
            for name, sub in params.items()}

  def loss_fn(self, params, batch, rng):
    logits = self.logits(params, batch, rng)
    labels = batch["mlm_loss_weights"].astype(jnp.float32)
    real = (batch["encoder_segment_ids"] > 0).astype(jnp.float32)
    loss = optax.sigmoid_binary_cross_entropy(logits, labels)
    hits = ((logits > 0) == (labels > 0)).astype(jnp.float32) * real
    return jnp.sum(loss * real), {"normalizer": jnp.sum(real), "weight_sum": jnp.sum(real),
                                  "correct": jnp.sum(hits)}

  def metrics(self, sums, normalizer):
    return {"accuracy": sums["correct"] / jnp.maximum(sums["weight_sum"], 1.0)}

  def flops_per_example(self, lengths):
    c = self.config
    per_layer = 4 * c.d_model * c.num_heads * c.d_kv + 2 * c.d_model * c.d_ff
    length = lengths["encoder_input_tokens"]
    return float(6 * c.num_encoder_layers * per_layer * length)


STEPS = 20


def test_a_family_defined_in_a_test_file_trains_through_t5lite_train(tmp_path):
  # One layer: what is tested is the family's plumbing, and XLA compiles a program per layer.
  model = tiny_encoder_only(family="test_chosen_token_detection", num_encoder_layers=1)
  family = family_of(model)
  assert isinstance(family, ChosenTokenFamily)
  config = train_config(tmp_path, mixture_or_task_name="train_test_mlm", train_steps=STEPS,
                        task_feature_lengths={"inputs": 32}, log_period=1, eval_period=STEPS,
                        eval_steps=2, optimizer=OptimizerConfig(
                            name="adamw", schedule=ScheduleConfig(name="constant", value=3e-3,
                                                                  warmup_steps=0)))
  result = train(model, config, log=quiet)
  assert result.step == STEPS
  losses = [result.losses[s] for s in sorted(result.losses)]
  assert losses[-1] < 0.3 * losses[0], losses  # [MASK] tokens are easy to spot
  assert load_model_config(tmp_path).family == "test_chosen_token_detection"
  records = metrics_records(tmp_path)
  logged = [r for r in records if "loss" in r]
  assert {"accuracy", "loss_mean", "grad_norm", "tokens_per_s"} <= set(logged[-1])
  assert logged[-1]["accuracy"] > 0.9
  evals = [r for r in records if "eval/train_test_mlm/loss" in r]
  assert len(evals) == 1 and evals[0]["eval/train_test_mlm/token_accuracy"] > 0.9
  # The frozen embedding is bitwise the init; the rest trained.
  trainer = Trainer(model, config)
  params, _ = checkpoint_reader.restore_params(str(tmp_path), trainer.abstract_params)
  init = family.init_params(jax.random.key(config.seed))
  assert_trees_equal(params["token_embedder"], init["token_embedder"])
  assert not (jax.device_get(params["detector"]["kernel"])
              == jax.device_get(init["detector"]["kernel"])).all()


def test_nothing_outside_the_families_and_models_branches_on_the_family():
  """At most 3 lines of t5lite/ outside t5lite/models and t5lite/families name a family or
  read .architecture (a lookup by name is fine; a branch per family is what they replace)."""
  out = subprocess.run(["grep", "-rnE", r"\b(encoder_decoder|decoder_only|encoder_only)\b|"
                        r"\.architecture\b", "t5lite", "--include=*.py"], cwd=REPO,
                       capture_output=True, text=True, check=True).stdout.splitlines()
  # The HF layouts (interop/hf/<model_type>.py) are per-family mappings by design: each says
  # which architecture its HF model is; checkpoints.py and layout.py dispatch without branching.
  # A study preset (study/presets/) declares its arms' models as gin bindings, as gin files do.
  outside = [line for line in out
             if not re.match(r"t5lite/(models|families|study/presets)/|"
                             r"t5lite/interop/hf/(?!layout|checkpoints)\w+\.py",
                             line)]
  assert len(outside) <= 3, "\n".join(outside)
