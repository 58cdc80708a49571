"""The params a run starts from when MODEL_DIR has no checkpoint: INITIAL_CHECKPOINT_PATH, a
t5lite MODEL_DIR (or step folder) or an HF directory, restored into the run's shardings.

A checkpoint of another head (a pretrained BERT for a classifier) or a smaller vocabulary
(tokens added for finetuning) warm-starts the model (t5lite.train.warm_start): the backbone
carries over, the new params keep their fresh initialization. The same for every recipe (a
recipe that reads its own start, like PEFT's base, refuses INITIAL_CHECKPOINT_PATH).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from t5lite.errors import ConfigError
from t5lite.models.config import ModelConfig
from t5lite.runtime import checkpoint_reader
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime.checkpoint_mirror import readable_step
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.train import warm_start
from t5lite.util import paths

Tree = Any


def check_vocabulary(path: str, vocabulary) -> None:
  """Finetuning a checkpoint on a task of another vocabulary would map its ids to other
  text: refused (a t5lite MODEL_DIR's vocabulary, an HF directory's spiece.model)."""
  path = paths.absolute(path)
  try:
    source = model_dir_lib.model_dir_of(path)
  except FileNotFoundError:
    source = path  # an HF directory
  model_dir_lib.check_vocabulary(source, vocabulary, "INITIAL_CHECKPOINT_PATH")


def load(path: str, program, model_config: ModelConfig, vocabulary, seed: int,
         log: Callable[[str], None] = print) -> tuple[Tree, int]:
  """(params, step) from a t5lite checkpoint or an HF directory, placed in the shardings of
  `program` (a t5lite.train.step_program.StepProgram); see the module docstring."""
  path = paths.absolute(path)
  hf = paths.isfile(paths.join(path, "config.json")) and not paths.isdir(
      paths.join(path, ckpt_lib.CHECKPOINTS_DIR))
  if hf:
    return _load(path, path, True, program, model_config, vocabulary, seed, log)
  # On s3:// the step is downloaded once here, for its shapes and its params alike.
  with readable_step(path, ckpt_lib.CHECKPOINTS_DIR) as local:
    return _load(path, local, False, program, model_config, vocabulary, seed, log)


def _load(path: str, source: str, hf: bool, program, model_config: ModelConfig, vocabulary,
          seed: int, log: Callable[[str], None]) -> tuple[Tree, int]:
  """load() from `source` (`path` itself, or its local copy on s3://)."""
  url = path if source != path else None  # what messages name
  wanted = warm_start.shapes_of(program.abstract_params)
  if hf:
    hf_tree, old_vocab = hf_params(path, model_config, vocabulary)
    saved, step = warm_start.shapes_of(hf_tree), 0
  else:
    saved = checkpoint_reader.saved_param_shapes(source)
  if saved == wanted:
    if hf:
      return place(hf_tree, model_config, program.param_shardings), 0
    return checkpoint_reader.restore_params(source, program.abstract_params, url=url)
  if not hf:
    old_vocab = model_dir_lib.load_model_config(model_dir_lib.model_dir_of(path)).vocab_size
  # Rows are added only for ids the task's vocabulary has beyond the checkpoint's (added
  # tokens): a model merely configured with another vocab_size is refused, as before.
  grows = vocabulary is not None and vocabulary.vocab_size > old_vocab
  plan = warm_start.plan_warm_start(
      wanted, saved, old_vocab=old_vocab,
      new_vocab=model_config.vocab_size if grows else old_vocab, source=path)
  log(f"t5lite: warm start from {path}: {plan.summary()}")
  if hf:
    loaded = {k: v for k, v in warm_start.flat(hf_tree).items()
              if k in plan.carried or k in plan.grown}
  else:
    replicated = NamedSharding(program.mesh, P())
    abstract = {k: (v if k in plan.carried else jax.ShapeDtypeStruct(saved[k], v.dtype,
                                                                       sharding=replicated))
                for k, v in warm_start.flat(program.abstract_params).items()
                if k in plan.carried or k in plan.grown}
    tree = warm_start.subset_tree(program.abstract_params, abstract)
    restored, step = checkpoint_reader.restore_params(source, tree, subset=True, url=url)
    loaded = warm_start.flat(restored)
  fresh = jax.jit(program.family.init_params, out_shardings=program.param_shardings)(
      jax.random.key(seed))
  return warm_start.merge(fresh, loaded, plan), step


def hf_params(path: str, model_config: ModelConfig, vocabulary) -> tuple[Tree, int]:
  """(params as numpy, the checkpoint's vocab_size) of an HF directory."""
  from t5lite.interop.hf.checkpoints import load_hf  # torch-free unless the checkpoint is a .bin
  hf_config, params = load_hf(path)
  mine, theirs = model_config.to_dict(), hf_config.to_dict()
  grows = vocabulary is not None and vocabulary.vocab_size > theirs["vocab_size"]
  # A stack the architecture lacks has no params: its depth is whatever the config says.
  depths = (("num_encoder_layers",) * model_config.has_encoder
            + ("num_decoder_layers",) * model_config.has_decoder)
  shape_fields = (("vocab_size",) * (not grows) + ("d_model", "d_ff", "num_heads", "d_kv")
                  + depths + ("mlp_activation", "tie_output_embedding"))
  differ = [f"{k}: checkpoint {theirs[k]!r}, model {mine[k]!r}" for k in shape_fields
            if mine[k] != theirs[k]]
  if differ:
    raise ConfigError(f"HF checkpoint {path} does not fit this model config:\n  "
                      + "\n  ".join(differ))
  if model_config.scan_layers:
    from t5lite.models.params import scan_params
    params = scan_params(params, model_config)
  return params, hf_config.vocab_size


def place(params: Tree, model_config: ModelConfig, shardings: Tree) -> Tree:
  """Host params cast to the model's param_dtype and put in their shardings."""
  dtype = jnp.dtype(model_config.param_dtype)
  return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x).astype(dtype), s), params,
                      shardings)
