"""A self-describing MODEL_DIR: what a run writes beside its checkpoints, and reading it back.

  MODEL_DIR/
    model_config.json      the ModelConfig (t5lite.ModelConfig.from_json reads it)
    vocabulary.json        the vocabulary (t5lite.data.vocabularies.load_vocabulary reads it,
    spiece.model           as does T5LITE_VOCAB=MODEL_DIR) and its sentencepiece model
    config.gin             the gin config the run was started with
    checkpoints/<step>/    orbax checkpoints: state (TrainState) + data (iterator state)
    metrics.jsonl          one JSON object per logged step; tensorboard/ the same as events

Export, import, eval and infer need nothing else: no gin files, no task registry.
"""
from __future__ import annotations

import json
import os

from t5lite.data.vocabularies import Vocabulary
from t5lite.models.config import ModelConfig

MODEL_CONFIG_FILE = "model_config.json"
GIN_FILE = "config.gin"
# Fields a resumed run may change: they alter computation, not the saved arrays.
RUNTIME_FIELDS = frozenset({"dropout_rate", "dtype", "remat_policy"})


def load_model_config(model_dir: str | os.PathLike) -> ModelConfig:
  path = os.path.join(os.fspath(model_dir), MODEL_CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: {model_dir} is not a t5lite MODEL_DIR")
  with open(path, encoding="utf-8") as f:
    return ModelConfig.from_json(f.read())


def model_dir_of(checkpoint_path: str | os.PathLike) -> str:
  """The MODEL_DIR a checkpoint path belongs to: the path itself, or the folder above its
  checkpoints/ folder (for MODEL_DIR/checkpoints or MODEL_DIR/checkpoints/<step>)."""
  path = os.path.abspath(os.path.expanduser(os.fspath(checkpoint_path)))
  for candidate in (path, os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
    if os.path.isfile(os.path.join(candidate, MODEL_CONFIG_FILE)):
      return candidate
  raise FileNotFoundError(f"{checkpoint_path} is not in a t5lite MODEL_DIR (no "
                          f"{MODEL_CONFIG_FILE} there or two folders up)")


def load_params(checkpoint_path: str | os.PathLike, mesh=None, rules=None):
  """(model_config, params, step) of a checkpoint: a MODEL_DIR (its newest step) or a step
  folder. Params only, laid out on `mesh` by `rules` (default: every device, data parallel)."""
  from t5lite.models.params import abstract_params
  from t5lite.train import checkpoints, partitioning
  model_config = load_model_config(model_dir_of(checkpoint_path))
  mesh = mesh if mesh is not None else partitioning.make_mesh(partitioning.MeshConfig())
  rules = rules if rules is not None else partitioning.logical_axis_rules()
  shardings = partitioning.param_shardings(model_config, mesh, rules)
  abstract = partitioning.abstract_sharded(abstract_params(model_config), shardings)
  params, step = checkpoints.restore_params(checkpoint_path, abstract)
  return model_config, params, step


def write_json(path: str, value) -> None:
  _write_atomic(path, json.dumps(value, indent=2) + "\n")


def _write_atomic(path: str, text: str) -> None:
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def check_compatible(saved: ModelConfig, current: ModelConfig, model_dir: str) -> None:
  """Raises ValueError when `current` cannot continue a run saved with `saved`."""
  a, b = saved.to_dict(), current.to_dict()
  differ = sorted(k for k in a if a[k] != b.get(k) and k not in RUNTIME_FIELDS)
  if differ:
    changes = ", ".join(f"{k}: {a[k]!r} -> {b.get(k)!r}" for k in differ)
    raise ValueError(f"MODEL_DIR {model_dir} was trained with another model config ({changes}); "
                     "use a new MODEL_DIR, or the model gin file it was trained with")


def prepare(model_dir: str | os.PathLike, model_config: ModelConfig,
            vocabulary: Vocabulary | None, gin_config_text: str | None = None) -> None:
  """Writes (or, when present, checks) model_config.json, the vocabulary and config.gin.

  Call on the primary process only. A MODEL_DIR that already holds another model config is
  refused before anything is overwritten.
  """
  model_dir = os.fspath(model_dir)
  os.makedirs(model_dir, exist_ok=True)
  config_path = os.path.join(model_dir, MODEL_CONFIG_FILE)
  if os.path.isfile(config_path):
    check_compatible(load_model_config(model_dir), model_config, model_dir)
  _write_atomic(config_path, model_config.to_json() + "\n")
  if vocabulary is not None:
    vocabulary.save(model_dir)
  if gin_config_text is not None:
    _write_atomic(os.path.join(model_dir, GIN_FILE), gin_config_text)

