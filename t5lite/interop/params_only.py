"""Params-only MODEL_DIRs: what imports write and `t5lite export params` makes of a run.

    OUT/model_config.json, vocabulary.json (+ spiece.model)
    OUT/checkpoints/<step>/state      {"step", "params"}: no optimizer state, no data state
    OUT/checkpoints/<step>/t5lite_checksums.json   sealed like a training step

Everything that reads params (eval, infer, export hf/serving, INITIAL_CHECKPOINT_PATH of
finetune.gin) reads these like a training checkpoint, on any mesh: orbax places each array as
the reader's shardings say, and verifies its checksums first (a flipped byte is refused by
name, not loaded). A training run cannot *resume* from one (there is no optimizer state); it
starts from one.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from t5lite.data.vocab.vocabularies import Vocabulary
from t5lite.errors import ConfigError
from t5lite.models.config import ModelConfig
from t5lite.runtime import checkpoints, integrity, model_dir

CAST_DTYPES = ("float32", "bfloat16")
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # a step folder orbax had not committed


def write_model_dir(out: str | os.PathLike, config: ModelConfig, params, *, step: int,
                    vocabulary: Vocabulary | None) -> str:
  """Writes a params-only MODEL_DIR at `out`; returns the step folder.

  Refuses an `out` that already holds checkpoints, so an export never overwrites a run. What
  a killed write left (orbax's uncommitted `*.orbax-checkpoint-tmp*` folders) is no
  checkpoint: it is cleared and the write done again.
  """
  out = os.path.abspath(os.fspath(out))
  directory = checkpoints.checkpoint_dir(out)
  held = sorted(name for name in (os.listdir(directory) if os.path.isdir(directory) else ())
                if TMP_SUFFIX not in name)
  if held:
    raise FileExistsError(f"{directory} already holds checkpoints ({', '.join(held[:3])}); "
                          "choose an empty --out")
  model_dir.prepare(out, config, vocabulary)
  params = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), params)
  with integrity.quiet_orbax():
    manager = ocp.CheckpointManager(directory, item_names=("state",),
                                    options=ocp.CheckpointManagerOptions(
                                        cleanup_tmp_directories=True))
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(
        {"step": np.asarray(step, np.int32), "params": params})))
    manager.wait_until_finished()
    manager.close()
  step_dir = os.path.join(directory, str(step))
  integrity.seal(step_dir)
  return step_dir


def cast_params(params, dtype: str | None):
  """Floating params cast to `dtype` ('float32' or 'bfloat16'); None keeps them as they are."""
  if dtype is None:
    return params
  if dtype not in CAST_DTYPES:
    raise ConfigError(f"--dtype {dtype!r}: choose one of {CAST_DTYPES}")
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params)
