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

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from t5lite.data.pipeline import PipelineConfig, get_dataset
from t5lite.data.registry import tasks_of
from t5lite.errors import ConfigError
from t5lite.eval.evaluator import DecodeConfig
from t5lite.families import family_of
from t5lite.families.distillation import Distillation, DistillationConfig
from t5lite.families import peft as peft_lib
from t5lite.families.peft import PeftConfig
from t5lite.runtime import preemption
from t5lite.models.config import ModelConfig
from t5lite.runtime import checkpoint_reader
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import integrity
from t5lite.runtime import lease as lease_lib
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.runtime import partitioning as part
from t5lite.interop.peft import record as peft_record
from t5lite.train import loop as loop_lib
from t5lite.train import peft_run
from t5lite.train import step_program
from t5lite.train import teacher as teacher_lib
from t5lite.train import warm_start
from t5lite.train.loop import TrainResult
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.step import StepConfig, with_fixed_params
from t5lite.train.train_state import TrainState

Tree = Any
__all__ = ["TrainConfig", "TrainResult", "Trainer", "train"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run. Gin binds it through T5X's macro names (gin/runs/pretrain.gin)."""

  model_dir: str
  """Where checkpoints, metrics, the model config and the vocabulary go (MODEL_DIR)."""
  train_steps: int
  """The final step (TRAIN_STEPS): a resumed or finetuning run stops there, as in T5X."""
  batch_size: int
  """Global batch size in rows, over all processes (BATCH_SIZE)."""
  mixture_or_task_name: str
  """A registered task or mixture (MIXTURE_OR_TASK_NAME)."""
  task_feature_lengths: Mapping[str, int]
  """e.g. {'inputs': 512, 'targets': 114} (TASK_FEATURE_LENGTHS)."""
  seed: int = 0
  """Seeds the init, the data order and dropout (RANDOM_SEED): the one seed of a run."""
  initial_checkpoint_path: str | None = None
  """Params to start from when MODEL_DIR has no checkpoint (INITIAL_CHECKPOINT_PATH)."""
  use_cached_tasks: bool = False
  """Read tasks from `t5lite cache` output (USE_CACHED_TASKS)."""
  cache_dir: str | None = None
  """Where cached tasks are (default: $T5LITE_CACHE_DIR or ~/.cache/t5lite/tasks)."""
  pack: bool = True
  """Pack several examples per row (T5X pretraining does)."""
  data_workers: int = 0
  """Worker processes computing batch rows (0: in the training process)."""
  log_period: int = 100
  """Write metrics and print the progress line every this many steps (and at the end)."""
  eval_period: int = 1000
  """Evaluate on eval_split every this many steps (EVAL_PERIOD); 0 = never."""
  run_eval_before_training: bool = False
  """Also evaluate once before the first step (T5X's name), e.g. to see what finetuning
  improves."""
  eval_steps: int = 20
  """Batches per evaluation (fewer when the split ends first)."""
  infer_eval_period: int = 0
  """Decode eval_split and compute each task's metrics (ROUGE, accuracy, ...) every this many
  steps (and at the end); 0 = never. Unpacked, in order, the same examples every time."""
  infer_eval_examples: int | None = 128
  """Examples per task for the inference eval (None: the whole split)."""
  decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
  """Decoding settings of the inference eval."""
  eval_split: str = "validation"
  """The split evaluated; tasks without it are skipped."""
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  step: StepConfig = dataclasses.field(default_factory=StepConfig)
  """Loss options (LOSS_NORMALIZING_FACTOR, z-loss, ...), microbatches, non-finite policy."""
  mesh: part.MeshConfig = dataclasses.field(default_factory=part.MeshConfig)
  fsdp: bool = False
  """Shard parameters' embed axis over the mesh's 'fsdp' axis (logical_axis_rules)."""
  checkpoint: ckpt_lib.CheckpointConfig = dataclasses.field(
      default_factory=ckpt_lib.CheckpointConfig)
  preemption_check_period: int = 1
  """With several processes, agree on SIGTERM every this many steps: one all-gather of a flag,
  which waits for the step to finish. Raise it when steps take milliseconds."""
  lease_timeout_s: float = 600.0
  """A run holds MODEL_DIR's lease (t5lite/runtime/lease.py) and renews it every tenth of
  this; a lease not renewed for this long (its holder on another host died) is taken over."""
  distillation: DistillationConfig | None = None
  """Train the model as a student of a frozen teacher (t5lite.families.distillation)."""
  peft: PeftConfig | None = None
  """Train adapters (LoRA) on a frozen base model, the base's params left out of the train
  state and checkpoints (t5lite.families.peft)."""

  def __post_init__(self):
    # Floats, bools and strings pass `< 1`: TRAIN_STEPS=10.5 trained to step 11.
    from t5lite.util.checks import check_feature_lengths, require_int
    for name in ("train_steps", "batch_size", "log_period", "eval_steps",
                 "preemption_check_period"):
      require_int(getattr(self, name), f"TrainConfig.{name}", minimum=1)
    for name in ("seed", "data_workers", "eval_period", "infer_eval_period"):
      require_int(getattr(self, name), f"TrainConfig.{name}", minimum=0 if name != "seed" else None)
    require_int(self.infer_eval_examples, "TrainConfig.infer_eval_examples", minimum=1,
                optional=True)
    # Before anything is allocated (a length of 10**12 once asked for 2.3 PB).
    check_feature_lengths(self.task_feature_lengths, "TASK_FEATURE_LENGTHS", self.batch_size)
    if not self.model_dir:
      raise ConfigError("TrainConfig.model_dir (MODEL_DIR) is not set")
    model_dir_lib.check_not_url(self.model_dir)
    model_dir_lib.check_not_url(self.initial_checkpoint_path, "INITIAL_CHECKPOINT_PATH")
    if self.peft is not None and self.distillation is not None:
      raise ConfigError("TrainConfig.peft and TrainConfig.distillation are both set: distil "
                        "into a plain student, then adapt it (or adapt, merge with `t5lite "
                        "export hf --merge`, then distil)")
    if self.peft is not None and self.initial_checkpoint_path:
      raise ConfigError("TrainConfig.peft names the base the adapters train on "
                        "(PeftConfig.base); INITIAL_CHECKPOINT_PATH is for full finetuning: "
                        "unset it")


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

  def __init__(self, model_config: ModelConfig, config: TrainConfig, mesh: Mesh | None = None):
    self.model_config, self.config = model_config, config
    self.mesh = mesh if mesh is not None else part.make_mesh(config.mesh)
    part.check_batch_size(config.batch_size, self.mesh)  # before a teacher or base is read
    # The slice of each global batch this process computes: the rows its devices hold.
    self.batch_slice = part.process_batch_slice(self.mesh)
    self.rules = part.logical_axis_rules(fsdp=config.fsdp)
    self.family = family_of(model_config, config.step.loss_options())
    distill, peft = config.distillation, config.peft
    if distill is not None:  # the recipe's loss needs the teacher's shapes first
      self.teacher, teacher_config, teacher_params = teacher_lib.read(distill)
      self.family = Distillation.wrap(self.family, distill, teacher_config)
    # A PEFT run's base (like a teacher, the step's fixed_params); its family trains the
    # adapter half of the adapted model.
    self.peft = None
    if peft is not None:
      self.peft = peft_run.prepare(model_config, peft, config.step.loss_options(), self.mesh,
                                   self.rules)
      self.model_config, self.family = self.peft.model_config, self.peft.family
    self.is_primary = jax.process_index() == 0
    # A distillation teacher: an argument of every step (the loss's fixed_params), never
    # donated, differentiated or saved.
    self.fixed_params = None if self.peft is None else self.peft.base
    if distill is not None:
      self.fixed_params = teacher_lib.load(self.teacher, teacher_config, teacher_params,
                                           self.mesh, self.rules)
      self.teacher_record = teacher_lib.record(distill, teacher_config, self.fixed_params)
    fixed = (None if self.fixed_params is None
             else jax.tree.map(lambda x: x.sharding, self.fixed_params))
    # The same function builds what `t5lite compile` compiles for a TPU topology.
    self.program = step_program.build(self.family, config, self.mesh, self.rules, fixed)
    program = self.program
    self.converter, self.optimizer = program.converter, program.optimizer
    self.param_shardings, self.state_shardings = program.param_shardings, program.state_shardings
    self.abstract_state, self.abstract_params = program.abstract_state, program.abstract_params
    self.replicated = program.replicated
    self.step_fn = with_fixed_params(program.step_fn, self.fixed_params)
    self.eval_fn = with_fixed_params(program.eval_fn, self.fixed_params)

  def model_params(self, params: Tree) -> Tree:
    """The whole model's params of a train state's: a PEFT run's adapters joined to the base."""
    return params if self.peft is None else self.family.whole(self.fixed_params, params)

  def pipeline_config(self, split: str = "train", **changes) -> PipelineConfig:
    c = self.config
    return PipelineConfig(global_batch_size=c.batch_size,
                          task_feature_lengths=dict(c.task_feature_lengths), split=split,
                          seed=c.seed, use_cached=c.use_cached_tasks, cache_dir=c.cache_dir,
                          **changes)

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
    return task_vocabulary(self.config.mixture_or_task_name)

  def check_initial_vocabulary(self, path: str) -> None:
    """Finetuning a checkpoint on a task of another vocabulary would map its ids to other
    text: refused (a t5lite MODEL_DIR's vocabulary, an HF directory's spiece.model)."""
    path = os.path.expanduser(path)
    try:
      source = model_dir_lib.model_dir_of(path)
    except FileNotFoundError:
      source = path  # an HF directory
    model_dir_lib.check_vocabulary(source, self.vocabulary, "INITIAL_CHECKPOINT_PATH")

  def fresh_state(self) -> TrainState:
    """Random init, created directly in its shards (a PEFT run's soft prompt from its base's
    embeddings, AdapterConfig.prompt_init)."""
    ids = () if self.peft is None else peft_lib.prompt_init_ids(
        self.model_config.adapter, self.vocabulary, self.model_config.vocab_size,
        self.config.seed)

    def create(rng, *fixed):
      params = self.family.init_params(rng)
      if ids:
        params = self.family.with_initial_prompt(params, fixed[0], ids)
      return TrainState.create(params, self.optimizer)
    fixed = (self.fixed_params,) if ids else ()
    return jax.jit(create, out_shardings=self.state_shardings)(
        jax.random.key(self.config.seed), *fixed)

  def state_from_params(self, params: Tree, step: int) -> TrainState:
    """A fresh optimizer around given params (already placed), at `step`."""
    def create(p):
      return TrainState.create(p, self.optimizer).replace(step=jnp.asarray(step, jnp.int32))
    return jax.jit(create, in_shardings=(self.param_shardings,),
                   out_shardings=self.state_shardings)(params)

  def initial_params(self, path: str, log: Callable[[str], None] = print) -> tuple[Tree, int]:
    """(params, step) from INITIAL_CHECKPOINT_PATH: a t5lite checkpoint or an HF directory.

    A checkpoint of another head (a pretrained BERT for a classifier) or a smaller vocabulary
    (tokens added for finetuning) warm-starts the model (t5lite.train.warm_start): the
    backbone carries over, the new params keep their fresh initialization."""
    path = os.path.expanduser(path)
    hf = os.path.isfile(os.path.join(path, "config.json")) and not os.path.isdir(
        os.path.join(path, ckpt_lib.CHECKPOINTS_DIR))
    wanted = warm_start.shapes_of(self.abstract_params)
    if hf:
      hf_params, old_vocab = self._hf_params(path)
      saved, step = warm_start.shapes_of(hf_params), 0
    else:
      saved = checkpoint_reader.saved_param_shapes(path)
    if saved == wanted:
      if hf:
        return self._place(hf_params), 0
      return checkpoint_reader.restore_params(path, self.abstract_params)
    if not hf:
      old_vocab = model_dir_lib.load_model_config(model_dir_lib.model_dir_of(path)).vocab_size
    # Rows are added only for ids the task's vocabulary has beyond the checkpoint's (added
    # tokens): a model merely configured with another vocab_size is refused, as before.
    grows = self.vocabulary is not None and self.vocabulary.vocab_size > old_vocab
    plan = warm_start.plan_warm_start(
        wanted, saved, old_vocab=old_vocab,
        new_vocab=self.model_config.vocab_size if grows else old_vocab, source=path)
    log(f"t5lite: warm start from {path}: {plan.summary()}")
    if hf:
      loaded = {k: v for k, v in warm_start.flat(hf_params).items()
                if k in plan.carried or k in plan.grown}
    else:
      replicated = NamedSharding(self.mesh, P())
      abstract = {k: (v if k in plan.carried else jax.ShapeDtypeStruct(saved[k], v.dtype,
                                                                         sharding=replicated))
                  for k, v in warm_start.flat(self.abstract_params).items()
                  if k in plan.carried or k in plan.grown}
      tree = warm_start.subset_tree(self.abstract_params, abstract)
      restored, step = checkpoint_reader.restore_params(path, tree, subset=True)
      loaded = warm_start.flat(restored)
    fresh = jax.jit(self.family.init_params, out_shardings=self.param_shardings)(
        jax.random.key(self.config.seed))
    return warm_start.merge(fresh, loaded, plan), step

  def _hf_params(self, path: str) -> tuple[Tree, int]:
    """(params as numpy, the checkpoint's vocab_size) of an HF directory."""
    from t5lite.interop.hf.checkpoints import load_hf  # torch-free unless the checkpoint is a .bin
    hf_config, params = load_hf(path)
    mine, theirs = self.model_config.to_dict(), hf_config.to_dict()
    grows = self.vocabulary is not None and self.vocabulary.vocab_size > theirs["vocab_size"]
    shape_fields = ("vocab_size",) * (not grows) + ("d_model", "d_ff", "num_heads", "d_kv", "num_encoder_layers",
                    "num_decoder_layers", "mlp_activation", "tie_output_embedding")
    differ = [f"{k}: checkpoint {theirs[k]!r}, model {mine[k]!r}" for k in shape_fields
              if mine[k] != theirs[k]]
    if differ:
      raise ConfigError(f"HF checkpoint {path} does not fit this model config:\n  "
                        + "\n  ".join(differ))
    if self.model_config.scan_layers:
      from t5lite.models.params import scan_params
      params = scan_params(params, self.model_config)
    return params, hf_config.vocab_size

  def _place(self, params: Tree) -> Tree:
    dtype = jnp.dtype(self.model_config.param_dtype)
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x).astype(dtype), s), params,
                        self.param_shardings)


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
  if eos is not None and eos != model_config.eos_id and family_of(model_config).decodes:
    # Training is unaffected; decoding would stop at the wrong token (or never).
    log(f"note: the vocabulary's EOS is id {eos} but ModelConfig.eos_id={model_config.eos_id}, "
        f"where decoding stops: set ModelConfig.eos_id={eos} to decode this task")
  check_heads(model_config, tasks_of(config.mixture_or_task_name))
  trainer = Trainer(model_config, config, mesh)
  model_config = trainer.model_config  # a PEFT run's has its adapter
  model_dir_lib.check_shared(config.model_dir)  # several processes: all see MODEL_DIR
  # Every process refuses an incompatible MODEL_DIR (so all stop; none waits for the others in
  # a collective), before anything is written there.
  model_dir_lib.check_compatible(config.model_dir, model_config)
  model_dir_lib.check_vocabulary(config.model_dir, vocabulary)
  if config.distillation is not None:  # the teacher MODEL_DIR's run learns from
    teacher_lib.check_record(config.model_dir, trainer.teacher_record)
    model_dir_lib.check_vocabulary(trainer.teacher.home, vocabulary, "the teacher")
  if trainer.peft is not None:  # the base the adapters were trained on, and no other
    peft_record.check_same(config.model_dir, trainer.peft.record)
    model_dir_lib.check_vocabulary(trainer.peft.where.home, vocabulary, "the PEFT base")
  if not trainer.is_primary:
    log = _silent  # one progress line per job, from process 0

  def prepare() -> None:  # once the run is sure to go on
    if trainer.is_primary:
      model_dir_lib.prepare(config.model_dir, model_config, vocabulary, gin_config_text)
      if config.distillation is not None:
        teacher_lib.write_record(config.model_dir, trainer.teacher_record)
      if trainer.peft is not None:
        peft_record.write(config.model_dir, trainer.peft.record)

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
