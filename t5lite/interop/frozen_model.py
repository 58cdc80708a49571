"""A frozen model beside a run: a distillation teacher, or the base a PEFT run adapts.

Either is named by a path: an HF directory (one with a config.json, checked first: `t5lite
export hf` may write one inside a MODEL_DIR) or a t5lite MODEL_DIR (its newest checkpoint).
Its params are loaded once, sharded by the run's partitioning rules, optionally cast (a bf16
base or teacher takes half the memory), and passed to every step beside the train state: no
gradient, no optimizer state, never donated or checkpointed. A fingerprint of them lets a
resumed run or a reader check that it has the same model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import jax
import numpy as np

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.interop.hf import checkpoints as hf
from t5lite.interop import limits
from t5lite.models.config import ModelConfig
from t5lite.models.decoding.search import to_host
from t5lite.runtime import model_dir, partitioning
from t5lite.util import paths

Tree = Any
DTYPES = ("", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class Located:
  """Where a frozen model is: `path` as given (absolute), `hf` whether it is an HF directory,
  else `home` is its MODEL_DIR; the vocabulary, when saved, is in `home`."""
  path: str
  home: str
  hf: bool


def locate(path: str | os.PathLike, role: str = "model") -> Located:
  """The model at `path`: an HF directory, or a t5lite MODEL_DIR (or a checkpoint of one)."""
  path = paths.absolute(path)
  if paths.is_url(path):  # a t5lite run on a bucket (orbax reads its arrays there)
    try:
      return Located(path, model_dir.model_dir_of(path), False)
    except FileNotFoundError:
      raise ConfigFileNotFoundError(
          f"{role} {path} is not a t5lite MODEL_DIR (no model_config.json there or two folders "
          "up); an HF model directory is read from a local folder: copy it down first") from None
  hf_config = limits.file_inside(path, "config.json")
  if hf_config is not None and os.path.isfile(hf_config):
    return Located(path, path, True)
  try:
    return Located(path, model_dir.model_dir_of(path), False)
  except FileNotFoundError:
    raise ConfigFileNotFoundError(
        f"{role} {path} is neither a t5lite MODEL_DIR (no model_config.json there or two "
        f"folders up) nor an HF model directory (no config.json): name the {role}'s run "
        "folder or its HF export") from None


def read(path: str | os.PathLike, dtype: str = "", role: str = "model"
         ) -> tuple[Located, ModelConfig, Tree | None]:
  """(where, config, host params or None): an HF directory is read whole (its config depends
  on its weights, e.g. T5's tied output layer), a MODEL_DIR only for its config (load() reads
  its newest checkpoint straight into its shards). The config's dtypes are `dtype`'s when
  set, else the checkpoint's."""
  if dtype not in DTYPES:
    raise ConfigError(f"the {role}'s dtype {dtype!r} is not one of {DTYPES}")
  where = locate(path, role)
  if where.hf:
    config, params = hf.load_hf(where.path)
  else:
    config, params = model_dir.load_model_config(where.home), None
  if dtype:
    config = config.replace(dtype=dtype, param_dtype=dtype)
  return where, config, params


def load(where: Located, config: ModelConfig, params: Tree | None, mesh, rules) -> Tree:
  """The model's params in config's storage dtype, placed as the partitioning rules shard
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
