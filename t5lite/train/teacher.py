"""A distillation run's teacher (t5lite.families.distillation): its config, its params placed
on the mesh, and the record MODEL_DIR keeps of it.

The trainer reads the teacher's config first (the recipe's loss needs its shapes), loads its
params once, sharded by the run's partitioning rules and cast to DistillationConfig's
teacher_dtype, and passes them to every step beside the train state. MODEL_DIR/
distillation.json names the teacher (path, config, a fingerprint of its params): a resumed run
whose teacher differs is refused, since the student would learn from another model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import numpy as np

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.export import hf, limits
from t5lite.families.distillation import DistillationConfig
from t5lite.models.config import ModelConfig
from t5lite.models.decoding import to_host
from t5lite.runtime import model_dir, partitioning

Tree = Any
RECORD_FILE = "distillation.json"


@dataclasses.dataclass(frozen=True)
class Teacher:
  """Where a teacher is: `path` as given (absolute), `hf` whether it is an HF directory (one
  with a config.json, checked first: `t5lite export hf` may write one inside a MODEL_DIR),
  else `home` is its MODEL_DIR; the vocabulary, when saved, is in `home`."""
  path: str
  home: str
  hf: bool


def locate(path: str | os.PathLike) -> Teacher:
  """The Teacher at `path`: an HF directory, or a t5lite MODEL_DIR (or a checkpoint of one)."""
  path = os.path.abspath(os.path.expanduser(os.fspath(path)))
  hf_config = limits.file_inside(path, "config.json")
  if hf_config is not None and os.path.isfile(hf_config):
    return Teacher(path, path, True)
  try:
    return Teacher(path, model_dir.model_dir_of(path), False)
  except FileNotFoundError:
    raise ConfigFileNotFoundError(
        f"teacher {path} is neither a t5lite MODEL_DIR (no model_config.json there or two "
        "folders up) nor an HF model directory (no config.json): name the teacher's run "
        "folder or its HF export") from None


def read(options: DistillationConfig) -> tuple[Teacher, ModelConfig, Tree | None]:
  """(where, config, host params or None) of DistillationConfig's teacher: an HF directory is
  read whole (its config depends on its weights, e.g. T5's tied output layer), a MODEL_DIR
  only for its config (load() reads its newest checkpoint straight into its shards). The
  config's dtypes are teacher_dtype's when set, else the checkpoint's."""
  where = locate(options.teacher)
  if where.hf:
    config, params = hf.load_hf(where.path)
  else:
    config, params = model_dir.load_model_config(where.home), None
  if options.teacher_dtype:
    config = config.replace(dtype=options.teacher_dtype, param_dtype=options.teacher_dtype)
  return where, config, params


def load(where: Teacher, config: ModelConfig, params: Tree | None, mesh, rules) -> Tree:
  """The teacher's params in config's storage dtype, placed as the partitioning rules shard
  its family's params (host params from read(), or its MODEL_DIR's newest checkpoint)."""
  if params is None:
    _, params, _ = model_dir.load_params(where.path, mesh, rules)
  shardings = partitioning.param_shardings(config, mesh, rules)
  dtype = config.storage_dtype
  return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
                 out_shardings=shardings)(params)


def fingerprint(params: Tree) -> str:
  """sha256 over every leaf's path, dtype, shape and bytes: exact (sums miss a swap of two
  values) and the same whatever mesh the params were loaded on."""
  digest = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    array = np.ascontiguousarray(to_host(leaf))  # one leaf on the host at a time
    digest.update(f"{jax.tree_util.keystr(path)}:{array.dtype}:{array.shape};".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()


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
