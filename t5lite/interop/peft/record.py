"""A PEFT run's MODEL_DIR: adapters only, and the base they adapt named and fingerprinted.

    RUN_DIR/model_config.json   the adapted ModelConfig (its `adapter` set)
    RUN_DIR/peft.json           {"base": path, "base_fingerprint": sha256, "base_config": {...},
                                 "adapter": {...}, "saved_modules": ["classifier", ...]}
    RUN_DIR/checkpoints/        train states (or a params-only step) of the adapter half only

The base is a t5lite MODEL_DIR or an HF directory, read where peft.json says. Reading a run
(load_params: eval, infer, export) loads the base, checks its fingerprint (sha256 of its params
as read, before any cast) and joins the two halves; a base that changed since is refused, since
the adapters were trained against other weights. `saved_modules` are param path prefixes
trained whole beside the adapters (peft's modules_to_save): a new finetuning head the base
lacks.
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax

from t5lite.errors import ConfigError
from t5lite.models import adapters
from t5lite.models.config import ModelConfig
from t5lite.runtime import model_dir
from t5lite.interop import frozen_model
from t5lite.util import paths

Tree = Any
RECORD_FILE = model_dir.PEFT_RECORD_FILE


def make(base: str, base_config: ModelConfig, base_params: Tree, adapter: adapters.AdapterConfig,
         saved_modules: tuple[tuple[str, ...], ...] = ()) -> dict:
  """The record of a run adapting the base at `base` (its params as read, before any cast)."""
  return {"base": paths.absolute(base),
          "base_fingerprint": frozen_model.fingerprint(base_params),
          "base_config": base_config.to_dict(), "adapter": adapter.to_dict(),
          "saved_modules": ["/".join(p) for p in saved_modules]}


def read(directory: str | os.PathLike) -> dict | None:
  """The record of a PEFT run's MODEL_DIR; None for any other MODEL_DIR."""
  path = paths.join(directory, RECORD_FILE)
  if not paths.isfile(path):
    return None
  return json.loads(paths.read_text(path))


def write(directory: str | os.PathLike, record: dict) -> None:
  model_dir.write_json(paths.join(directory, RECORD_FILE), record)


def saved_prefixes(record: dict) -> tuple[tuple[str, ...], ...]:
  return tuple(tuple(p.split("/")) for p in record.get("saved_modules", ()))


def check_same(directory: str | os.PathLike, record: dict) -> None:
  """Refuses to resume a PEFT run with another base or adapter than it started with."""
  saved = read(directory)
  if saved is None:
    return
  as_json = lambda value: json.loads(json.dumps(value))  # noqa: E731 (tuples read as lists)
  changed = [k for k in ("base_fingerprint", "adapter", "saved_modules")
             if saved.get(k) != as_json(record.get(k))]
  if changed:
    raise ConfigError(f"MODEL_DIR {directory} holds adapters of another "
                      f"{' and '.join(changed).replace('_', ' ')} (base {saved.get('base')}): "
                      "resume with the base and AdapterConfig it was trained with, or use a new "
                      "MODEL_DIR")


def check_fingerprint(record: dict, fingerprint: str, where: str) -> None:
  if fingerprint != record["base_fingerprint"]:
    raise ConfigError(f"{where}'s adapters were trained on the base {record['base']} with "
                      f"fingerprint {record['base_fingerprint'][:16]}..., but that base's params "
                      f"now have fingerprint {fingerprint[:16]}...: give the base it was trained "
                      "on (a changed or retrained base makes the adapters meaningless)")


def base_part(base_params: Tree, wanted: Tree, where: str) -> Tree:
  """The base's params that the adapted model reads (`wanted`: the base half of its abstract
  params); others (an MLM head a classifier run does not use) are left out. A wanted param the
  base lacks, or holds in another shape, is refused by name."""
  from flax import traverse_util
  have = traverse_util.flatten_dict(base_params)
  need = traverse_util.flatten_dict(wanted)
  missing = sorted("/".join(k) for k in need if k not in have)
  wrong = sorted(f"{'/'.join(k)} {tuple(have[k].shape)} (wanted {tuple(v.shape)})"
                 for k, v in need.items() if k in have and tuple(have[k].shape) != tuple(v.shape))
  if missing or wrong:
    raise ConfigError(f"the base {where} does not fit the adapted model: "
                      + "; ".join(filter(None, [
                          missing and f"missing {', '.join(missing[:5])}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""),
                          wrong and f"other shapes: {', '.join(wrong[:5])}"]))
                      + ". Use the model config the base was trained with")
  return traverse_util.unflatten_dict({k: have[k] for k in need})


def load_params(checkpoint_path: str | os.PathLike, config: ModelConfig, record: dict,
                mesh, rules) -> tuple[Tree, int]:
  """(whole params, step) of a PEFT run's checkpoint: its adapter half joined to the base's
  params that the model reads, fingerprint checked."""
  from t5lite.families import family_of
  from t5lite.families.peft import Peft, PeftConfig
  from t5lite.runtime import checkpoint_reader, partitioning
  where, base_config, host = frozen_model.read(record["base"], role="base")
  base = frozen_model.load(where, base_config, host, mesh, rules)
  check_fingerprint(record, frozen_model.fingerprint(base),
                    model_dir.model_dir_of(checkpoint_path))
  inner = family_of(config)
  wanted_base, _ = adapters.split(partitioning.abstract_sharded(
      inner.abstract_params(), partitioning.param_shardings(inner, mesh, rules)),
      saved_prefixes(record))
  # The adapter half as the run trained it (a prefix MLP, not its prefixes).
  family = Peft.wrap(inner, PeftConfig(base=record["base"], adapter=config.adapter),
                     saved_prefixes(record))
  wanted_adapter = partitioning.abstract_sharded(
      family.abstract_params(), partitioning.param_shardings(family, mesh, rules))
  base = base_part(base, wanted_base, record["base"])
  base = jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), base, wanted_base)
  adapter, step = checkpoint_reader.restore_params(checkpoint_path, wanted_adapter)
  return family.whole(base, adapter), step


def load_run(checkpoint_path: str | os.PathLike, mesh=None, rules=None):
  """(model_config, params, step) of any MODEL_DIR or step folder: a PEFT run's adapters
  joined to its base (fingerprint checked), any other as model_dir.load_params reads it."""
  from t5lite.runtime import partitioning
  record = read(model_dir.model_dir_of(checkpoint_path))
  if record is None:
    return model_dir.load_params(checkpoint_path, mesh, rules)
  config = model_dir.load_model_config(model_dir.model_dir_of(checkpoint_path))
  mesh = mesh if mesh is not None else partitioning.make_mesh(partitioning.MeshConfig())
  rules = rules if rules is not None else partitioning.logical_axis_rules()
  params, step = load_params(checkpoint_path, config, record, mesh, rules)
  return config, params, step
