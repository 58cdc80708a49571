"""A distillation run's teacher (t5lite.families.distillation): its config, its params placed
on the mesh, and the record MODEL_DIR keeps of it.

The trainer reads the teacher's config first (the recipe's loss needs its shapes), loads its
params once, sharded by the run's partitioning rules and cast to DistillationConfig's
teacher_dtype, and passes them to every step beside the train state. MODEL_DIR/
distillation.json names the teacher (path, config, a fingerprint of its params): a resumed run
whose teacher differs is refused, since the student would learn from another model.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from t5lite.errors import ConfigError
from t5lite.export import hf, limits
from t5lite.families.distillation import DistillationConfig
from t5lite.models.config import ModelConfig
from t5lite.runtime import model_dir, partitioning

Tree = Any
RECORD_FILE = "distillation.json"


def teacher_config(options: DistillationConfig) -> ModelConfig:
  """The teacher's ModelConfig, from its MODEL_DIR's model_config.json or its HF config.json."""
  path = os.path.expanduser(options.teacher)
  try:
    config = model_dir.load_model_config(model_dir.model_dir_of(path))
  except FileNotFoundError:
    hf_file = limits.file_inside(path, "config.json")
    if hf_file is None or not os.path.isfile(hf_file):
      raise ConfigError(f"DistillationConfig.teacher={options.teacher!r} is neither a t5lite "
                        "MODEL_DIR nor an HF model directory (no model_config.json, no "
                        "config.json)") from None
    config = hf.config_from_hf(limits.read_json(hf_file))
  if options.teacher_dtype:
    config = config.replace(dtype=options.teacher_dtype, param_dtype=options.teacher_dtype)
  return config


def load_teacher(options: DistillationConfig, config: ModelConfig, mesh, rules) -> Tree:
  """The teacher's params, placed as the partitioning rules shard its family's params."""
  path = os.path.expanduser(options.teacher)
  try:
    model_dir.model_dir_of(path)
    _, params, _ = model_dir.load_params(path, mesh, rules)
  except FileNotFoundError:
    _, params = hf.load_hf(path)
  shardings = partitioning.param_shardings(config, mesh, rules)
  dtype = config.storage_dtype
  return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
                 out_shardings=shardings)(params)


def fingerprint(params: Tree) -> str:
  """A short hash of a params tree's values (float64 sums of each leaf and its squares)."""
  sums = [f"{float(jnp.sum(x.astype(jnp.float32))):.9e},{float(jnp.sum(jnp.square(x.astype(jnp.float32)))):.9e}"
          for x in jax.tree.leaves(params)]
  return hashlib.sha256(";".join(sums).encode()).hexdigest()[:16]


def record(options: DistillationConfig, config: ModelConfig, params: Tree) -> dict:
  """What MODEL_DIR/distillation.json holds about the teacher."""
  return {"teacher": os.path.abspath(os.path.expanduser(options.teacher)),
          "teacher_config": config.to_dict(), "teacher_fingerprint": fingerprint(params)}


def check_record(directory: str, teacher: dict) -> None:
  """Refuses a run whose teacher differs from the one MODEL_DIR/distillation.json names
  (a resumed run must learn from the teacher it started with)."""
  path = os.path.join(directory, RECORD_FILE)
  if not os.path.isfile(path):
    return
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  changed = [k for k in ("teacher_config", "teacher_fingerprint") if saved.get(k) != teacher[k]]
  if changed:
    raise ConfigError(f"MODEL_DIR {directory} was distilled from another teacher "
                      f"({saved.get('teacher')}; {' and '.join(changed)} differ): resume with "
                      "that teacher, or use a new MODEL_DIR")


def write_record(directory: str, teacher: dict) -> None:
  model_dir.write_json(os.path.join(directory, RECORD_FILE), teacher)
