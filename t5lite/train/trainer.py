"""A training run: its config, the fixed pieces (mesh, family, shardings, jitted steps), resume.

    result = train(model_config, TrainConfig(model_dir="/tmp/run", train_steps=1000, ...))

One code path from one CPU to a pod: the state is created (or restored) already sharded over
the mesh, every process feeds its own rows of each global batch, and the jitted step runs
under the mesh and the logical axis rules. The model's family (t5lite.families) supplies the
feature converter, the loss, the trainable-parameter mask and the FLOP count; the trainer
never asks which family it is. The loop and its periodic actions are t5lite.train.loop and
t5lite.train.actions:

  restore or init -> compile -> [step -> (log) (eval) (checkpoint) (SIGTERM?)] *

Resuming. If MODEL_DIR holds a checkpoint, the run continues from it: same params, optimizer
state, data position and step counter (which also seeds dropout), so the losses after a restart
are the losses the uninterrupted run would have had (bitwise on CPU). Raising TRAIN_STEPS and
rerunning into the same MODEL_DIR continues a finished run the same way: schedules depend on
the step and their own settings, never on TRAIN_STEPS. Otherwise INITIAL_CHECKPOINT_PATH (a
t5lite MODEL_DIR or step folder, or an HF T5 directory) gives the params, with a fresh
optimizer and, as in T5X, the step counter of that checkpoint (TRAIN_STEPS is the final step).

Preemption. SIGTERM sets a flag; after every preemption_check_period steps the
processes agree whether any of them has it, with one tiny collective (one process: just the
flag). Agreed after step k, every process runs step k + 1 (its batch is already fetched),
saves checkpoint k + 1 and returns (TrainResult.preempted; the CLI exits 42). Rerunning the
same command resumes. The flag is up from the CLI's start (runtime/preemption.py), so a SIGTERM
during startup (init or restore, compiling, an eval before training) counts too: agreed once
before the first step, every process returns at once without saving (nothing is newer than
the checkpoint it started from, if any) and the CLI exits 42 all the same. JAX's preemption
sync point (multihost_utils) is not used: it listens for SIGTERM with a notifier of its own in
C++, which would compete with the Python handler that a single-process run needs anyway, so
launch/distributed.py turns that service off; one all-gather of a flag works on every
backend, gloo included.

Several processes. First they check that all see MODEL_DIR as one folder
(model_dir.check_shared). Each feeds the rows its devices hold (partitioning.process_batch_slice);
only process 0 holds MODEL_DIR's lease (runtime/lease.py: one writer per MODEL_DIR), writes
MODEL_DIR files (metrics, config, vocabulary) and prints; every process
writes its shards of each checkpoint (orbax); the data iterator state is gathered into one.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from t5lite.data.pipeline import PipelineConfig, get_dataset
from t5lite.data.registry import tasks_of
from t5lite.errors import ConfigError
from t5lite.families import Family, family_of
from t5lite.runtime import preemption
from t5lite.models.config import ModelConfig
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import integrity
from t5lite.runtime import lease as lease_lib
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.runtime import partitioning as part
from t5lite.train import initial_params as initial_params_lib
from t5lite.train import loop as loop_lib
from t5lite.train import recipes
from t5lite.train import step_program
from t5lite.train.loop import TrainResult
from t5lite.train.step import with_fixed_params
from t5lite.train.train_config import TrainConfig
from t5lite.train.train_state import TrainState

Tree = Any
__all__ = ["TrainConfig", "TrainResult", "Trainer", "train"]


def task_vocabulary(name: str):
  """The targets vocabulary of a task, or of a mixture's first task."""
  task = tasks_of(name)[0]
  feature = task.output_features.get("targets") or next(iter(task.output_features.values()))
  return feature.vocabulary


def check_heads(model_config: ModelConfig, tasks) -> None:
  """A head task trains a model with that head and as many labels; a token task one without."""
  for task in tasks:
    if (task.head or "") != model_config.head:
      want = (f"ModelConfig.head = '{task.head}' and ModelConfig.num_labels = {task.num_labels}"
              if task.head else "ModelConfig.head = '' (the pretraining / LM head)")
      raise ConfigError(f"task {task.name!r} is a {task.head or 'token prediction'} task but the "
                        f"model has head={model_config.head!r}: set {want}")
    if task.head and task.num_labels != model_config.num_labels and task.head != "multiple_choice":
      raise ConfigError(f"task {task.name!r} has {task.num_labels} labels but the model has "
                        f"num_labels={model_config.num_labels}: set ModelConfig.num_labels = "
                        f"{task.num_labels}")


class Trainer:
  """The pieces of one run that stay fixed while it trains (see `train`)."""

  def __init__(self, model_config: ModelConfig, config: TrainConfig, mesh: Mesh | None = None,
               *, vocabulary=None, family: Family | None = None):
    """vocabulary, family: the task's vocabulary and family_of(model_config, the step's loss
    options) when the caller has them already (train() does); else derived here."""
    self.config = config
    self.mesh = mesh if mesh is not None else part.make_mesh(config.mesh)
    part.check_batch_size(config.batch_size, self.mesh)  # before a recipe reads from disk
    # The slice of each global batch this process computes: the rows its devices hold.
    self.batch_slice = part.process_batch_slice(self.mesh)
    self.rules = part.logical_axis_rules(fsdp=config.fsdp)
    self._vocabulary = vocabulary
    # The run's recipe (t5lite.train.recipes) reads what rides along the model and says which
    # family trains: the model's, or one wrapped around it (its config is the run's).
    self.recipe = recipes.recipe_of(config)
    if family is None:
      family = family_of(model_config, config.step.loss_options())
    self.family = self.recipe.prepare(family, mesh=self.mesh, rules=self.rules)
    self.model_config = self.family.config
    self.is_primary = jax.process_index() == 0
    # Params the loss reads beside the train state: an argument of every step, never
    # donated, differentiated or saved (None: the recipe has none).
    self.fixed_params = self.recipe.fixed_params
    fixed = (None if self.fixed_params is None
             else jax.tree.map(lambda x: x.sharding, self.fixed_params))
    # The same function builds what `t5lite compile` compiles for a TPU topology.
    self.program = step_program.build(
        self.family, config, self.mesh, self.rules, fixed,
        trainable_mask=functools.partial(self.recipe.trainable_mask, self.family))
    program = self.program
    self.converter, self.optimizer = program.converter, program.optimizer
    self.param_shardings, self.state_shardings = program.param_shardings, program.state_shardings
    self.abstract_state, self.abstract_params = program.abstract_state, program.abstract_params
    self.replicated = program.replicated
    self.step_fn = with_fixed_params(program.step_fn, self.fixed_params)
    self.eval_fn = with_fixed_params(program.eval_fn, self.fixed_params)

  def model_params(self, params: Tree) -> Tree:
    """The whole model's params of a train state's (the recipe's: adapters joined to their
    base, say)."""
    return self.recipe.model_params(self.family, params)

  def pipeline_config(self, split: str = "train", **changes) -> PipelineConfig:
    c = self.config
    return PipelineConfig(global_batch_size=c.batch_size,
                          task_feature_lengths=dict(c.task_feature_lengths), split=split,
                          seed=c.seed, use_cached=c.use_cached_tasks, cache_dir=c.cache_dir,
                          accept_data_changes=c.accept_data_changes, **changes)

  def dataset(self, name: str, pipeline_config: PipelineConfig, workers: int = 0):
    index, count = self.batch_slice
    return get_dataset(name, pipeline_config, self.converter, process_index=index,
                       process_count=count, num_workers=workers)

  # --- the state -----------------------------------------------------------------------------

  def initial_state(self, checkpointer: ckpt_lib.Checkpointer, batches,
                    log: Callable[[str], None]) -> tuple[TrainState, int]:
    """(state, step) to train from: MODEL_DIR's newest checkpoint (the data position restored
    into `batches`), else INITIAL_CHECKPOINT_PATH's params, else a fresh init."""
    config = self.config
    restored = checkpointer.restore_latest(self.abstract_state)
    if restored is not None:
      state, saved_data_state, step = restored
      mark = saved_data_state.pop(loop_lib.NONFINITE_MARK, None)
      batches.set_state(saved_data_state)
      log(f"t5lite: resuming from step {step} in {checkpointer.directory}")
      if mark:
        log(f"t5lite: step {step} is the last good state before the non-finite step "
            f"{mark['first_nonfinite_step']}; the data goes on after the batch of step "
            f"{mark['batches_drawn_until_step']} (the batches between are skipped)")
      return state, step
    if config.initial_checkpoint_path:
      self.check_initial_vocabulary(config.initial_checkpoint_path)
      params, step = self.initial_params(config.initial_checkpoint_path, log)
      if step >= config.train_steps:
        raise ConfigError(f"INITIAL_CHECKPOINT_PATH {config.initial_checkpoint_path} is at step "
                          f"{step} and TRAIN_STEPS={config.train_steps} is the final step (as "
                          f"in T5X): set TRAIN_STEPS to {step} + the number of finetuning steps")
      log(f"t5lite: initialized from {config.initial_checkpoint_path} (step {step}); "
          f"{config.train_steps - step} steps to go")
      return self.state_from_params(params, step), step
    return self.fresh_state(), 0

  @functools.cached_property
  def vocabulary(self):
    """The task's (targets) vocabulary: what MODEL_DIR and INITIAL_CHECKPOINT_PATH must have."""
    if self._vocabulary is not None:
      return self._vocabulary
    return task_vocabulary(self.config.mixture_or_task_name)

  def check_initial_vocabulary(self, path: str) -> None:
    """Finetuning a checkpoint on a task of another vocabulary would map its ids to other
    text: refused (a t5lite MODEL_DIR's vocabulary, an HF directory's spiece.model)."""
    initial_params_lib.check_vocabulary(path, self.vocabulary)

  def fresh_state(self) -> TrainState:
    """Random init, created directly in its shards (the recipe's init, which may read the
    fixed params)."""
    init, reads_fixed = self.recipe.fresh_init(self.family, self.vocabulary, self.config.seed)

    def create(rng, *fixed):
      return TrainState.create(init(rng, *fixed), self.optimizer)
    fixed = (self.fixed_params,) if reads_fixed else ()
    return jax.jit(create, out_shardings=self.state_shardings)(
        jax.random.key(self.config.seed), *fixed)

  def state_from_params(self, params: Tree, step: int) -> TrainState:
    """A fresh optimizer around given params (already placed), at `step`."""
    def create(p):
      return TrainState.create(p, self.optimizer).replace(step=jnp.asarray(step, jnp.int32))
    return jax.jit(create, in_shardings=(self.param_shardings,),
                   out_shardings=self.state_shardings)(params)

  def initial_params(self, path: str, log: Callable[[str], None] = print) -> tuple[Tree, int]:
    """(params, step) from INITIAL_CHECKPOINT_PATH: a t5lite checkpoint or an HF directory,
    warm-starting a model of another head or a larger vocabulary (t5lite.train.initial_params)."""
    return initial_params_lib.load(path, self.program, self.model_config, self.vocabulary,
                                   self.config.seed, log)


def train(model_config: ModelConfig, config: TrainConfig, *, mesh: Mesh | None = None,
          gin_config_text: str | None = None, log: Callable[[str], None] = print,
          ) -> TrainResult:
  """Trains until config.train_steps (or SIGTERM); see the module docstring.

  Every check that can refuse the run comes before anything is written to MODEL_DIR: the
  model config and vocabulary against MODEL_DIR's, its lease (one writer), the checkpoint
  and its data position, INITIAL_CHECKPOINT_PATH. Only then are model_config.json, the
  vocabulary and config.gin written (and a refused run leaves MODEL_DIR as it was).
  """
  vocabulary = task_vocabulary(config.mixture_or_task_name)
  if vocabulary.vocab_size > model_config.vocab_size:
    raise ConfigError(f"task {config.mixture_or_task_name!r} has a vocabulary of "
                      f"{vocabulary.vocab_size} ids, more than the model's vocab_size "
                      f"{model_config.vocab_size}: set ModelConfig.vocab_size >= "
                      f"{vocabulary.vocab_size} (T5 rounds up to a multiple of 128)")
  eos = getattr(vocabulary, "eos_id", None)
  family = family_of(model_config, config.step.loss_options())
  if eos is not None and eos != model_config.eos_id and family.decodes:
    # Training is unaffected; decoding would stop at the wrong token (or never).
    log(f"note: the vocabulary's EOS is id {eos} but ModelConfig.eos_id={model_config.eos_id}, "
        f"where decoding stops: set ModelConfig.eos_id={eos} to decode this task")
  check_heads(model_config, tasks_of(config.mixture_or_task_name))
  trainer = Trainer(model_config, config, mesh, vocabulary=vocabulary, family=family)
  model_config = trainer.model_config  # the recipe's (with its adapter, say)
  model_dir_lib.check_shared(config.model_dir)  # several processes: all see MODEL_DIR
  # Every process refuses an incompatible MODEL_DIR (so all stop; none waits for the others in
  # a collective), before anything is written there.
  model_dir_lib.check_compatible(config.model_dir, model_config)
  model_dir_lib.check_vocabulary(config.model_dir, vocabulary)
  trainer.recipe.check(config.model_dir, vocabulary)  # what rides along: as MODEL_DIR recorded
  if not trainer.is_primary:
    log = _silent  # one progress line per job, from process 0

  def prepare() -> None:  # once the run is sure to go on
    if trainer.is_primary:
      model_dir_lib.prepare(config.model_dir, model_config, vocabulary, gin_config_text,
                            task=(config.mixture_or_task_name, config.task_feature_lengths))
      trainer.recipe.record(config.model_dir)

  # The CLI entered the flag before startup; entering it again takes it over (or installs it).
  with part.activate(trainer.mesh, trainer.rules), preemption.SIGTERM as sigterm, \
      lease_lib.hold(config.model_dir, timeout_s=config.lease_timeout_s) as lease:
    if lease is not None and lease.taken_over:
      log(f"t5lite: took over the lease of MODEL_DIR from a stale run ({lease.taken_over})")
    checkpointer = ckpt_lib.Checkpointer(config.model_dir, config.checkpoint, lease=lease)
    with integrity.orbax_messages_to_log(config.model_dir,
                                         (OSError, ckpt_lib.CheckpointWriteError)):
      try:
        return loop_lib.run(trainer, checkpointer, sigterm, log, prepare=prepare)
      finally:
        checkpointer.close()


def _silent(_: str) -> None:
  pass
