"""PEFT (TrainConfig.peft = @PeftConfig()): adapters trained on a frozen base.

The base is read in its own dtype (what the record fingerprints), checked against the run's
model, cut to what the adapted model reads (peft_record.base_part), then cast to
PeftConfig.base_dtype and placed by the run's partitioning rules: the step's fixed_params. The
family trained is t5lite.families.peft.Peft around the adapted model (its config has the
adapter: what MODEL_DIR/model_config.json keeps); the train state holds the adapter half only.
MODEL_DIR/peft.json records the base (t5lite.interop.peft.record): a resumed run on another
base is refused.
"""
from __future__ import annotations

import dataclasses

import jax

from t5lite.errors import ConfigError
from t5lite.families import peft as peft_lib
from t5lite.families.peft import Peft, PeftConfig, adapted_config, saved_modules
from t5lite.interop import frozen_model
from t5lite.interop.peft import record as peft_record
from t5lite.models import adapters
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.runtime import partitioning
from t5lite.train.recipes.base import Recipe
from t5lite.train.recipes.registry import register


@register
class PeftRecipe(Recipe):
  """Adapters (LoRA, soft prompts, prefixes) on a frozen base; see the module docstring."""

  name = "peft"
  field = "peft"
  options_type = PeftConfig

  def check_config(self, config) -> None:
    if config.initial_checkpoint_path:
      raise ConfigError("TrainConfig.peft names the base the adapters train on "
                        "(PeftConfig.base); INITIAL_CHECKPOINT_PATH is for full finetuning: "
                        "unset it")

  def prepare(self, family, *, mesh, rules):
    options = self.options
    self.where, base_config, host = frozen_model.read(options.base, role="base")
    config = adapted_config(family.config, base_config, options)
    # The same class (adapted_config keeps family and architecture) over the adapted config.
    inner = dataclasses.replace(family, config=config)
    loaded = frozen_model.load(self.where, base_config, host, mesh, rules)
    full = inner.abstract_params()
    saved = saved_modules(full, loaded, options)
    wrapped = Peft.wrap(inner, options, saved)
    base_shardings, _ = adapters.split(partitioning.param_shardings(config, mesh, rules), saved)
    base = peft_record.base_part(loaded, adapters.split(full, saved)[0], options.base)
    dtype = options.base_dtype or None
    self.fixed_params = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype or x.dtype), p),
                                out_shardings=base_shardings)(base)
    self.run_record = peft_record.make(self.where.path, base_config, loaded, options.adapter,
                                       saved)
    return wrapped

  def fresh_init(self, family, vocabulary, seed):
    """A soft prompt starts from the base's embeddings (AdapterConfig.prompt_init)."""
    c = family.config
    ids = peft_lib.prompt_init_ids(c.adapter, vocabulary, c.vocab_size, seed)
    if not ids:
      return family.init_params, False

    def init(rng, base):
      return family.with_initial_prompt(family.init_params(rng), base, ids)
    return init, True

  def model_params(self, family, params):
    """The adapters joined to the base."""
    return family.whole(self.fixed_params, params)

  def check(self, model_dir, vocabulary) -> None:
    """The base the adapters were trained on, and no other."""
    peft_record.check_same(model_dir, self.run_record)
    model_dir_lib.check_vocabulary(self.where.home, vocabulary, "the PEFT base")

  def record(self, model_dir) -> None:
    peft_record.write(model_dir, self.run_record)
