"""The train step a run compiles: its optimizer, the train state's shardings and abstract
shapes, the jitted step and eval functions, and the abstract arguments of one step.

    program = step_program.build(family, config, mesh, rules)
    state, window, batch = program.abstract_args()          # ShapeDtypeStructs, born sharded
    compiled = step_program.compile_lowered(program.step_fn.lower(state, window, batch))

One function for both callers, so that what is compiled ahead of time is what trains: the
Trainer (t5lite.train.trainer) builds it over the run's devices and feeds real arrays;
`t5lite compile` (t5lite.train.aot.compiler) builds it over a TPU topology's devices and lowers
it with the abstract arguments, never materializing a parameter.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Mapping

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from t5lite.data.converters.sequence import FeatureConverter
from t5lite.errors import ConfigError
from t5lite.families import Family
from t5lite.runtime import partitioning as part
from t5lite.train.optimizers import make_optimizer, trainable_only
from t5lite.train.step import eval_step, new_window, windowed_train_step
from t5lite.train.train_state import TrainState

Tree = Any
# Every feature a converter emits is an int32 (B, L) array (packing.py writes int32 rows).
BATCH_DTYPE = np.int32


@dataclasses.dataclass(frozen=True)
class StepProgram:
  """The fixed pieces of a run's train step over one mesh (see the module docstring)."""

  mesh: Mesh
  rules: part.LogicalRules
  family: Family
  converter: FeatureConverter
  optimizer: optax.GradientTransformation
  param_shardings: Tree
  state_shardings: TrainState
  abstract_state: TrainState
  """jax.ShapeDtypeStructs of the train state, each carrying its sharding."""
  abstract_params: Tree
  replicated: NamedSharding
  batch_sharding: NamedSharding
  step_fn: Any
  """jit(windowed_train_step): (state, window, batch[, fixed_params]) -> (state, window,
  metrics); state and window donated."""
  eval_fn: Any
  """jit(eval_step): (params, batch[, fixed_params]) -> sums."""
  batch_size: int
  task_feature_lengths: Mapping[str, int]

  def model_feature_lengths(self) -> dict[str, int]:
    """The length of each batch feature the run's converter makes, e.g. {'encoder_input_tokens':
    512, ..., 'decoder_target_tokens': 114, ...}."""
    return self.converter.model_feature_lengths(self.task_feature_lengths)

  def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch the step takes: (BATCH_SIZE, length) int32 per converter feature,
    split over part.BATCH_AXES like part.global_batch places it."""
    return {key: jax.ShapeDtypeStruct((self.batch_size, length), BATCH_DTYPE,
                                      sharding=self.batch_sharding)
            for key, length in self.model_feature_lengths().items()}

  def abstract_window(self) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.replicated)
            for k, v in new_window().items()}

  def abstract_args(self) -> tuple[TrainState, dict, dict]:
    """(state, window, batch) as ShapeDtypeStructs with their shardings: step_fn.lower(*them)
    is the program `t5lite train` runs."""
    return self.abstract_state, self.abstract_window(), self.abstract_batch()

  def flops_per_step(self) -> float:
    """t5lite's analytic training FLOPs of one step (Family.flops_per_example x batch)."""
    return self.family.flops_per_example(self.model_feature_lengths()) * self.batch_size


def build(family: Family, config, mesh: Mesh, rules: part.LogicalRules,
          fixed_shardings: Tree | None = None, trainable_mask=None) -> StepProgram:
  """The StepProgram of a TrainConfig (`config`) for a family over a mesh. The caller checks
  BATCH_SIZE against the mesh first (part.check_batch_size: the Trainer, `t5lite compile`).

  fixed_shardings: where a step's fixed params (a distillation teacher, a PEFT base) lie, or
  None when the family has none; the jitted functions then take them as a last argument.
  trainable_mask: params -> tree of bools, the run's recipe's (default: the family's).
  """
  converter = family.converter(pack=config.pack)
  params = family.abstract_params()
  optimizer = trainable_only(make_optimizer(config.optimizer, family.param_logical_axes()),
                             (trainable_mask or family.trainable_mask)(params))
  param_shardings = part.param_shardings(family, mesh, rules)
  abstract_state = jax.eval_shape(functools.partial(TrainState.create, optimizer=optimizer),
                                  params)
  state_shardings = TrainState(
      step=NamedSharding(mesh, P()), params=param_shardings,
      opt_state=part.state_shardings(abstract_state.opt_state, optimizer.state_axes(params),
                                     mesh, rules))
  replicated = NamedSharding(mesh, P())
  batch_sharding = part.batch_sharding(mesh)
  fixed = () if fixed_shardings is None else (fixed_shardings,)
  options = dict(config.compiler_options) if config.compiler_options else None
  step_fn = jax.jit(
      functools.partial(windowed_train_step, family=family, optimizer=optimizer,
                        step_config=config.step, seed=config.seed),
      in_shardings=(state_shardings, replicated, batch_sharding, *fixed),
      out_shardings=(state_shardings, replicated, replicated),
      donate_argnums=(0, 1), compiler_options=options)
  eval_fn = jax.jit(functools.partial(eval_step, family=family),
                    in_shardings=(param_shardings, batch_sharding, *fixed),
                    compiler_options=options)
  return StepProgram(
      mesh=mesh, rules=rules, family=family, converter=converter, optimizer=optimizer,
      param_shardings=param_shardings, state_shardings=state_shardings,
      abstract_state=part.abstract_sharded(abstract_state, state_shardings),
      abstract_params=part.abstract_sharded(params, param_shardings), replicated=replicated,
      batch_sharding=batch_sharding, step_fn=step_fn, eval_fn=eval_fn,
      batch_size=config.batch_size, task_feature_lengths=dict(config.task_feature_lengths))


def compile_lowered(lowered, platform: str | None = None):
  """lowered.compile(); an option of TrainConfig.compiler_options that the backend's XLA does
  not know (another backend's, or a typo) refused in one line, naming it."""
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    unknown = re.search(r"No such compile option: '([^']+)'", str(e))
    if unknown is None:
      raise
    raise ConfigError(
        f"TrainConfig.compiler_options: XLA for {platform or jax.default_backend()} has no "
        f"option {unknown.group(1)!r}; remove it, or name one of that backend's (TPU "
        "options start with xla_tpu_ or xla_jf_, CPU ones with xla_cpu_)") from None
