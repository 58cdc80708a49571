"""A PEFT run's trainer pieces: its base read, checked against the run's model and placed; the
adapted family; the record its MODEL_DIR keeps (t5lite.interop.peft.record).

The base's params are read in their own dtype (what the record fingerprints), cut to what the
adapted model reads (peft_record.base_part), then cast to PeftConfig.base_dtype and placed by
the run's partitioning rules: they are the train step's fixed_params.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from t5lite.families.base import LossOptions
from t5lite.families.peft import Peft, PeftConfig, adapted_config, saved_modules
from t5lite.families.registry import family_of
from t5lite.models import adapters
from t5lite.models.config import ModelConfig
from t5lite.runtime import partitioning
from t5lite.interop import frozen_model
from t5lite.interop.peft import record as peft_record

Tree = Any


@dataclasses.dataclass(frozen=True)
class PeftRun:
  family: Peft
  model_config: ModelConfig
  """The run's model config with the adapter (what MODEL_DIR/model_config.json holds)."""
  base: Tree
  """The base's params the model reads, cast and placed: the step's fixed_params."""
  where: frozen_model.Located
  record: dict


def prepare(model_config: ModelConfig, options: PeftConfig, loss: LossOptions, mesh, rules
            ) -> PeftRun:
  where, base_config, host = frozen_model.read(options.base, role="base")
  config = adapted_config(model_config, base_config, options)
  inner = family_of(config, loss)
  loaded = frozen_model.load(where, base_config, host, mesh, rules)
  full = inner.abstract_params()
  saved = saved_modules(full, loaded, options)
  family = Peft.wrap(inner, options, saved)
  base_shardings, _ = adapters.split(partitioning.param_shardings(config, mesh, rules), saved)
  base = peft_record.base_part(loaded, adapters.split(full, saved)[0], options.base)
  dtype = options.base_dtype or None
  base = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype or x.dtype), p),
                 out_shardings=base_shardings)(base)
  record = peft_record.make(where.path, base_config, loaded, options.adapter, saved)
  return PeftRun(family, config, base, where, record)
