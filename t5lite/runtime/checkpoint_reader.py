"""Params out of a t5lite checkpoint, for evaluation, inference, export and finetuning.

    params, step = restore_params("/tmp/run", abstract_params)  # MODEL_DIR: its newest step
    params, step = restore_params("/tmp/run/checkpoints/1000", abstract_params)

Params only (no optimizer state), placed as `abstract_params`' shardings say, so any
checkpoint loads onto any mesh. Read paths write nothing: a step that fails its checksums
(t5lite/runtime/integrity.py) or holds NaN is refused (CorruptCheckpointError, exit 2 from
the CLI), never moved; point the command at an older step folder instead.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.runtime import integrity
from t5lite.runtime.checkpoint_mirror import readable_step
from t5lite.runtime.checkpoints import CHECKPOINTS_DIR, checkpoint_dir
from t5lite.runtime.integrity import CorruptCheckpointError
from t5lite.runtime.processes import all_flags
from t5lite.util import paths

Tree = Any


def _step_state_dir(path: str) -> tuple[str, int]:
  """The `state` folder of a checkpoint and its step, from a MODEL_DIR (its newest committed
  step), a MODEL_DIR/checkpoints folder, or one step folder."""
  path = paths.absolute(path)
  if paths.basename(path).isdigit() and paths.isdir(paths.join(path, "state")):
    return paths.join(path, "state"), int(paths.basename(path))
  directory = path if paths.basename(path) == CHECKPOINTS_DIR else checkpoint_dir(path)
  if not paths.isdir(directory):
    raise ConfigFileNotFoundError(f"{path} holds no t5lite checkpoints (no {CHECKPOINTS_DIR}/ "
                                  "folder and not a step folder)")
  with integrity.quiet_orbax(logging.CRITICAL):
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        read_only=True, create=False), item_names=("state", "data"))
    step = manager.latest_step()
    manager.close()
  if step is None:
    raise ConfigFileNotFoundError(f"{directory} holds no committed checkpoint")
  return paths.join(directory, str(step), "state"), step


def _saved_params(checkpointer, state_dir: str, step: int, step_dir: str, noise: list) -> Tree:
  """The checkpoint's params metadata tree (shapes and dtypes)."""
  try:
    with integrity.quiet_orbax(), integrity.captured_noise(noise):
      saved = checkpointer.metadata(state_dir).item_metadata.tree.get("params")
  except Exception as e:  # a damaged _METADATA / _sharding: orbax raises many kinds
    raise CorruptCheckpointError(f"checkpoint step {step} in {step_dir}: its array metadata "
                                 f"cannot be read: {integrity.first_line(e)}") from e
  if saved is None:
    raise ConfigError(f"{state_dir} has no params")
  return saved


def saved_param_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
  """{jax keystr of each param path: its shape} of a checkpoint's params (nothing restored)."""
  with readable_step(path, CHECKPOINTS_DIR) as local:
    state_dir, step = _step_state_dir(local)
    saved = _saved_params(ocp.PyTreeCheckpointer(), state_dir, step, paths.dirname(state_dir),
                          [])
  return {jax.tree_util.keystr(p): tuple(m.shape)
          for p, m in jax.tree_util.tree_leaves_with_path(saved)}


def restore_params(path: str | os.PathLike, abstract_params: Tree, *,
                   subset: bool = False, ignore: tuple[str, ...] = (),
                   url: str | None = None) -> tuple[Tree, int]:
  """(params, step) of a t5lite checkpoint, params only (no optimizer state), placed as the
  shardings of `abstract_params` say, so any checkpoint loads onto any mesh.

  path: a MODEL_DIR, its checkpoints/ folder or one step folder. The step is verified against
  its checksums (process 0 reads the files; the processes agree) and the params must be
  finite: CorruptCheckpointError otherwise. Nothing is written, so a damaged step stays where
  it is. Raises ConfigError naming every parameter whose shape or presence differs (e.g.
  another vocabulary size). subset: abstract_params may leave out params the checkpoint has
  (t5lite.train.warm_start reads a pretrained model's backbone this way). ignore: top-level
  params the checkpoint may hold beside the model's, left unread (a distillation run's
  trained projection). On s3:// the step is read from a local copy (orbax reads no S3);
  messages name the URL (`url`: the one a `path` already copied here came from).
  """
  with readable_step(path, CHECKPOINTS_DIR) as local:
    copied = local != os.fspath(path)
    return _restore_params(local, abstract_params, subset, ignore,
                           url or (os.fspath(path) if copied else None))


def _restore_params(path: str, abstract_params: Tree, subset: bool, ignore: tuple[str, ...],
                    url: str | None) -> tuple[Tree, int]:
  state_dir, step = _step_state_dir(path)
  step_dir = paths.dirname(state_dir)
  noise: list[str] = []
  sealed, error = None, None
  if jax.process_index() == 0:
    try:
      sealed = integrity.verify(step_dir, step, name_folder=True)
    except CorruptCheckpointError as e:
      error = e
  if any(all_flags(error is not None)):
    raise error or CorruptCheckpointError(
        f"checkpoint step {step} in {step_dir} fails its checksums (process 0 says which file)")
  if sealed is False:
    print(f"t5lite: warning: checkpoint step {step} in {url or step_dir} has no checksums "
          "(saved by an older t5lite, or its run stopped right after saving it); reading it "
          "unverified", file=sys.stderr, flush=True)
  checkpointer = ocp.PyTreeCheckpointer()
  saved = _saved_params(checkpointer, state_dir, step, step_dir, noise)
  saved_shapes = {jax.tree_util.keystr(p): tuple(m.shape)
                  for p, m in jax.tree_util.tree_leaves_with_path(saved)}
  wanted_shapes = {jax.tree_util.keystr(p): tuple(x.shape)
                   for p, x in jax.tree_util.tree_leaves_with_path(abstract_params)}
  problems = [f"{k}: checkpoint {saved_shapes[k]}, model {v}" for k, v in wanted_shapes.items()
              if k in saved_shapes and saved_shapes[k] != v]
  problems += [f"{k}: missing from the checkpoint" for k in wanted_shapes if k not in saved_shapes]
  if not subset:  # subset: abstract_params asks for some of the checkpoint's params
    ignored = tuple(f"[{name!r}]" for name in ignore)
    problems += [f"{k}: in the checkpoint, not in the model" for k in saved_shapes
                 if k not in wanted_shapes and not k.startswith(ignored)]
  if problems:
    more = [f"... and {len(problems) - 10} more"] if len(problems) > 10 else []
    raise ConfigError(
        f"checkpoint {state_dir} (step {step}) does not fit this model config; differences:\n  "
        + "\n  ".join(problems[:10] + more)
        + "\n  (vocab_size, d_model, layer counts and scan_layers must match the checkpoint's "
        "model_config.json)")
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
  error = None
  try:
    with integrity.captured_noise(noise):
      restored = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
          item={"params": abstract_params}, restore_args={"params": restore_args},
          partial_restore=True))
  except Exception as e:  # each process reads its own shards: all stop if one cannot
    error = CorruptCheckpointError(f"checkpoint {state_dir} (step {step}) cannot be read: "
                                   f"{type(e).__name__}: {integrity.first_line(e)}")
    error.__cause__ = e
  if any(all_flags(error is not None)):
    raise error or CorruptCheckpointError(f"checkpoint {state_dir} (step {step}) cannot be read "
                                          "by another process (its output says why)")
  integrity.check_finite(restored["params"], step, step_dir)
  return restored["params"], step
