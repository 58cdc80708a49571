"""The training loop: mesh, sharded state, batches, steps, logs, evals, checkpoints, resume.

    result = train(model_config, TrainConfig(model_dir="/tmp/run", train_steps=1000, ...))

One code path from one CPU to a pod: the state is created (or restored) already sharded over
the mesh, every process feeds its own rows of each global batch, and the jitted step runs
under the mesh and the logical axis rules. The loop itself only orders things:

  restore or init -> [next batch -> step -> (log) -> (eval) -> (checkpoint)] * -> final save

Resuming. If MODEL_DIR holds a checkpoint, the run continues from it: same params, optimizer
state, data position and step counter (which also seeds dropout), so the losses after a restart
are the losses the uninterrupted run would have had (bitwise on CPU). Raising TRAIN_STEPS and
rerunning into the same MODEL_DIR continues a finished run the same way: schedules depend on
the step and their own settings, never on TRAIN_STEPS. Otherwise INITIAL_CHECKPOINT_PATH (a
t5lite MODEL_DIR or step folder, or an HF T5 directory) gives the params, with a fresh
optimizer and, as in T5X, the step counter of that checkpoint (TRAIN_STEPS is the final step).

Preemption. SIGTERM sets a flag; after each step (every preemption_check_period steps) the
processes agree whether any of them has it, with one tiny collective (one process: just the
flag). Agreed after step k, every process runs step k + 1 (its batch is already fetched),
saves checkpoint k + 1 and returns (TrainResult.preempted; the CLI exits 42). Rerunning the
same command resumes. The flag is up from the CLI's start (launch/preemption.py), so a SIGTERM
during startup (init or restore, compiling, an eval before training) counts too: agreed once
before the first step, every process returns at once without saving (nothing is newer than
the checkpoint it started from, if any) and the CLI exits 42 all the same. JAX's preemption
sync point (multihost_utils) is not used: it listens for SIGTERM with a notifier of its own in
C++, which would compete with the Python handler that a single-process run needs anyway, so
launch/distributed.py turns that service off; one all-gather of a flag works on every
backend, gloo included.

Several processes. First they check that all see MODEL_DIR as one folder
(model_dir.check_shared). Each feeds the rows its devices hold (partitioning.process_batch_slice);
only process 0 writes MODEL_DIR files (metrics, config, vocabulary) and prints; every process
writes its shards of each checkpoint (orbax); the data iterator state is gathered into one.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from t5lite.data.describe import converter_for
from t5lite.data.pipeline import PipelineConfig, get_dataset
from t5lite.data.registry import tasks_of
from t5lite.eval.evaluator import DecodeConfig, TaskEvaluator
from t5lite.launch import preemption
from t5lite.models.config import ModelConfig
from t5lite.models.params import abstract_params, init_params, param_logical_axes
from t5lite.train import checkpoints as ckpt_lib
from t5lite.train import cost_model, data_state, evaluation, model_dir as model_dir_lib
from t5lite.train import partitioning as part
from t5lite.train.metrics_writer import MetricsWriter, ProgressLine
from t5lite.train.optimizers import OptimizerConfig, learning_rate_at, make_optimizer
from t5lite.train.processes import all_flags
from t5lite.train.step import StepConfig, eval_step, train_step
from t5lite.train.train_state import TrainState

Tree = Any


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
  """Seeds the init, the data order and dropout (RANDOM_SEED)."""
  initial_checkpoint_path: str | None = None
  """Params to start from when MODEL_DIR has no checkpoint (INITIAL_CHECKPOINT_PATH)."""
  use_cached_tasks: bool = False
  """Read tasks from `t5lite cache` output (USE_CACHED_TASKS)."""
  cache_dir: str | None = None
  """Where cached tasks are (default: $T5LITE_CACHE_DIR or ~/.cache/t5lite/tasks)."""
  dropout_rate: float | None = None
  """Overrides the model file's dropout rate when set (DROPOUT_RATE)."""
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

  def __post_init__(self):
    for name in ("train_steps", "batch_size", "log_period", "eval_steps",
                 "preemption_check_period"):
      if getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
    if not self.model_dir:
      raise ValueError("TrainConfig.model_dir (MODEL_DIR) is not set")
    model_dir_lib.check_not_url(self.model_dir)
    model_dir_lib.check_not_url(self.initial_checkpoint_path, "INITIAL_CHECKPOINT_PATH")


@dataclasses.dataclass
class TrainResult:
  step: int
  """The step the run ended at."""
  losses: dict[int, float]
  """Training loss of every logged step of this process's run (step -> loss)."""
  preempted: bool = False
  eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
  """The last evaluation's figures, keyed like metrics.jsonl (eval/<task>/<metric>)."""
  eval_step: int | None = None
  """The step of eval_metrics."""


def _agreed(requested: bool) -> bool:
  """Whether any process got SIGTERM (`requested`: this one did); the same answer on every
  process (a collective when there are several: all call it)."""
  return any(all_flags(requested))


def task_vocabulary(name: str):
  """The targets vocabulary of a task, or of a mixture's first task."""
  task = tasks_of(name)[0]
  feature = task.output_features.get("targets") or next(iter(task.output_features.values()))
  return feature.vocabulary


class Trainer:
  """The pieces of one run that stay fixed while it trains (see `train`)."""

  def __init__(self, model_config: ModelConfig, config: TrainConfig, mesh: Mesh | None = None):
    if config.dropout_rate is not None:
      model_config = model_config.replace(dropout_rate=config.dropout_rate)
    self.model_config, self.config = model_config, config
    self.mesh = mesh if mesh is not None else part.make_mesh(config.mesh)
    part.check_batch_size(config.batch_size, self.mesh)
    # The slice of each global batch this process computes: the rows its devices hold.
    self.batch_slice = part.process_batch_slice(self.mesh)
    self.rules = part.logical_axis_rules(fsdp=config.fsdp)
    self.step_config = config.step.replace(seed=config.seed)
    self.optimizer = make_optimizer(config.optimizer, param_logical_axes(model_config))
    self.is_primary = jax.process_index() == 0
    self.converter = converter_for(model_config.architecture, pack=config.pack,
                                   prefix_lm=model_config.prefix_lm)
    params = abstract_params(model_config)
    self.param_shardings = part.param_shardings(model_config, self.mesh, self.rules)
    abstract_state = jax.eval_shape(functools.partial(TrainState.create,
                                                      optimizer=self.optimizer), params)
    self.state_shardings = TrainState(
        step=NamedSharding(self.mesh, P()), params=self.param_shardings,
        opt_state=part.state_shardings(abstract_state.opt_state, self.param_shardings, params))
    self.abstract_state = part.abstract_sharded(abstract_state, self.state_shardings)
    self.abstract_params = part.abstract_sharded(params, self.param_shardings)
    batch_sharding = part.batch_sharding(self.mesh)
    self.step_fn = jax.jit(
        functools.partial(train_step, model_config=model_config, optimizer=self.optimizer,
                          step_config=self.step_config),
        in_shardings=(self.state_shardings, batch_sharding),
        out_shardings=(self.state_shardings, None), donate_argnums=0)
    self.eval_fn = jax.jit(
        functools.partial(eval_step, model_config=model_config, step_config=self.step_config),
        in_shardings=(self.param_shardings, batch_sharding))

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

  def fresh_state(self) -> TrainState:
    """Random init, created directly in its shards."""
    def create(rng):
      return TrainState.create(init_params(self.model_config, rng), self.optimizer)
    return jax.jit(create, out_shardings=self.state_shardings)(jax.random.key(self.config.seed))

  def state_from_params(self, params: Tree, step: int) -> TrainState:
    """A fresh optimizer around given params (already placed), at `step`."""
    def create(p):
      return TrainState.create(p, self.optimizer).replace(step=jnp.asarray(step, jnp.int32))
    return jax.jit(create, in_shardings=(self.param_shardings,),
                   out_shardings=self.state_shardings)(params)

  def initial_params(self, path: str) -> tuple[Tree, int]:
    """(params, step) from INITIAL_CHECKPOINT_PATH: a t5lite checkpoint or an HF directory."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, "config.json")) and not os.path.isdir(
        os.path.join(path, ckpt_lib.CHECKPOINTS_DIR)):
      return self._hf_params(path), 0
    return ckpt_lib.restore_params(path, self.abstract_params)

  def _hf_params(self, path: str) -> Tree:
    from t5lite.export.hf import load_hf  # torch-free unless the checkpoint is a .bin
    hf_config, params = load_hf(path)
    mine, theirs = self.model_config.to_dict(), hf_config.to_dict()
    shape_fields = ("vocab_size", "d_model", "d_ff", "num_heads", "d_kv", "num_encoder_layers",
                    "num_decoder_layers", "mlp_activation", "tie_output_embedding")
    differ = [f"{k}: checkpoint {theirs[k]!r}, model {mine[k]!r}" for k in shape_fields
              if mine[k] != theirs[k]]
    if differ:
      raise ValueError(f"HF checkpoint {path} does not fit this model config:\n  "
                       + "\n  ".join(differ))
    if self.model_config.scan_layers:
      from t5lite.models.params import scan_params
      params = scan_params(params, self.model_config)
    dtype = jnp.dtype(self.model_config.param_dtype)
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x).astype(dtype), s), params,
                        self.param_shardings)


def _nonfinite(config: TrainConfig, step: int, scalars: dict, checkpointer, log) -> None:
  """Step `step` had a NaN/inf loss or gradient: stop (raise) or report the skipped update."""
  if config.step.nonfinite == "stop":
    last = checkpointer.latest_step()
    raise FloatingPointError(
        f"non-finite loss or gradients at step {step} (loss {scalars['loss']}, grad norm "
        f"{scalars['grad_norm']}); the run stops, the update was not applied. Last "
        f"checkpoint: {last if last is not None else 'none'}. Lower the learning rate, check "
        "the data, or set StepConfig.nonfinite='skip' to drop such updates")
  log(f"t5lite: step {step}: non-finite loss or gradients; update skipped")


class _Throughput:
  """Tokens/s, MFU and the progress line over the steps since the last log."""

  def __init__(self, trainer: Trainer, progress: ProgressLine, step: int):
    self.trainer, self.progress = trainer, progress
    self.peak = cost_model.peak_flops(jax.devices()[0].device_kind)
    self.restart(step)

  def restart(self, step: int) -> None:
    """Counts from `step`, now (after an eval: its time is not training throughput)."""
    self.start, self.base_step = time.perf_counter(), step

  def log(self, step: int, scalars: dict, host_batch, writer: MetricsWriter,
          result: "TrainResult", log: Callable[[str], None]) -> None:
    config, model_config = self.trainer.config, self.trainer.model_config
    steps = step - self.base_step
    seconds = time.perf_counter() - self.start
    tokens, inputs_len, targets_len = _tokens_per_step(host_batch, config.batch_size)
    mfu = None
    if self.peak:
      flops = cost_model.flops_per_sequence(model_config, inputs_len, targets_len)
      mfu = cost_model.mfu(flops * config.batch_size * steps, seconds,
                           self.peak * jax.device_count())
    lr = learning_rate_at(config.optimizer, step - 1)
    record = {**scalars, "learning_rate": lr, "tokens_per_s": tokens * steps / seconds}
    if mfu is not None:
      record["mfu"] = mfu
    writer.write(step, record)
    result.losses[step] = scalars["loss"]
    if self.trainer.is_primary:
      log(self.progress.update(step, scalars["loss"], lr, tokens * steps, seconds, mfu))
    self.restart(step)


def _tokens_per_step(batch: Mapping[str, np.ndarray], global_rows: int) -> tuple[int, int, int]:
  """(tokens per step, inputs length, targets length) from a host batch's shapes."""
  inputs = batch["encoder_input_tokens"].shape[1] if "encoder_input_tokens" in batch else 0
  targets = batch["decoder_target_tokens"].shape[1] if "decoder_target_tokens" in batch else 0
  return global_rows * (inputs + targets), inputs, targets


def _log_eval(trainer: Trainer, state: TrainState, step: int, writer: MetricsWriter,
              result: TrainResult, log: Callable[[str], None], *, loss: bool = True,
              infer: bool = False, evaluators: dict | None = None) -> None:
  """Runs the due evaluations at `step` and records them (metrics.jsonl, TB, result)."""
  metrics = evaluation.evaluate(trainer, state.params) if loss else {}
  if infer:
    metrics.update(evaluation.infer_evaluate(trainer, state.params, step, evaluators))
  result.eval_metrics = metrics
  result.eval_step = step
  writer.write(step, result.eval_metrics)
  if trainer.is_primary and result.eval_metrics:
    log(f"step {step} eval: " + "  ".join(f"{k} {v:.4f}" for k, v in result.eval_metrics.items()))


def train(model_config: ModelConfig, config: TrainConfig, *, mesh: Mesh | None = None,
          gin_config_text: str | None = None, log: Callable[[str], None] = print,
          ) -> TrainResult:
  """Trains until config.train_steps (or SIGTERM); see the module docstring."""
  vocabulary = task_vocabulary(config.mixture_or_task_name)
  if vocabulary.vocab_size > model_config.vocab_size:
    raise ValueError(f"task {config.mixture_or_task_name!r} has a vocabulary of "
                     f"{vocabulary.vocab_size} ids, more than the model's vocab_size "
                     f"{model_config.vocab_size}: set ModelConfig.vocab_size >= "
                     f"{vocabulary.vocab_size} (T5 rounds up to a multiple of 128)")
  trainer = Trainer(model_config, config, mesh)
  model_config = trainer.model_config
  model_dir_lib.check_shared(config.model_dir)  # several processes: all see MODEL_DIR
  if trainer.is_primary:
    model_dir_lib.prepare(config.model_dir, model_config, vocabulary, gin_config_text)
  else:
    _check_model_dir(config.model_dir, model_config)
    log = _silent  # one progress line per job, from process 0
  # The CLI entered the flag before startup; entering it again takes it over (or installs it).
  with part.activate(trainer.mesh, trainer.rules), preemption.SIGTERM as sigterm:
    checkpointer = ckpt_lib.Checkpointer(config.model_dir, config.checkpoint)
    try:
      return _run(trainer, checkpointer, sigterm, log)
    finally:
      checkpointer.close()


def _silent(_: str) -> None:
  pass


def _check_model_dir(model_dir: str, model_config: ModelConfig) -> None:
  """What process 0's model_dir.prepare refuses, refused on every process (so that all stop,
  none waits for the others in a collective)."""
  if os.path.isfile(os.path.join(model_dir, model_dir_lib.MODEL_CONFIG_FILE)):
    model_dir_lib.check_compatible(model_dir_lib.load_model_config(model_dir), model_config,
                                   model_dir)


def _run(trainer: Trainer, checkpointer: ckpt_lib.Checkpointer,
         sigterm: preemption.SigtermFlag, log: Callable[[str], None]) -> TrainResult:
  config = trainer.config
  batches = trainer.dataset(config.mixture_or_task_name, trainer.pipeline_config(),
                            config.data_workers)
  restored = checkpointer.restore_latest(trainer.abstract_state)
  if restored is not None:
    state, saved_data_state, step = restored
    batches.set_state(saved_data_state)
    log(f"t5lite: resuming from step {step} in {checkpointer.directory}")
  elif config.initial_checkpoint_path:
    params, step = trainer.initial_params(config.initial_checkpoint_path)
    if step >= config.train_steps:
      raise ValueError(f"INITIAL_CHECKPOINT_PATH {config.initial_checkpoint_path} is at step "
                       f"{step} and TRAIN_STEPS={config.train_steps} is the final step (as in "
                       f"T5X): set TRAIN_STEPS to {step} + the number of finetuning steps")
    state = trainer.state_from_params(params, step)
    log(f"t5lite: initialized from {config.initial_checkpoint_path} (step {step}); "
        f"{config.train_steps - step} steps to go")
  else:
    state, step = trainer.fresh_state(), 0
  result = TrainResult(step=step, losses={})
  if step >= config.train_steps:
    log(f"t5lite: already at step {step} >= TRAIN_STEPS={config.train_steps}; nothing to do "
        "(raise TRAIN_STEPS to train on)")
    return result

  writer = MetricsWriter(config.model_dir, is_primary=trainer.is_primary)
  evaluators: dict[str, TaskEvaluator | None] = {}
  best = evaluation.BestCheckpoint(config, trainer.is_primary)
  if config.run_eval_before_training and (config.eval_period or config.infer_eval_period):
    _log_eval(trainer, state, step, writer, result, log, loss=bool(config.eval_period),
              infer=bool(config.infer_eval_period), evaluators=evaluators)
  if _agreed(sigterm.requested):  # SIGTERM during startup: nothing new to save
    writer.close()
    log(f"t5lite: preempted (SIGTERM) before the first step, at step {step}: nothing new to "
        "save; rerun the same command to resume")
    result.preempted = True
    return result
  meter = _Throughput(trainer, ProgressLine(config.train_steps, start_step=step), step)
  host_batch = next(batches)
  stop = False  # agreed by every process: save after this step and return
  try:
    while step < config.train_steps:
      state, metrics = trainer.step_fn(state, part.global_batch(host_batch, trainer.mesh))
      step += 1  # the step just dispatched; the device runs it while the host goes on
      last = step == config.train_steps
      loss_eval = bool(config.eval_period) and (step % config.eval_period == 0 or last)
      infer_eval = bool(config.infer_eval_period) and (
          step % config.infer_eval_period == 0 or last)
      save = (stop or last or step % config.checkpoint.period == 0
              or (infer_eval and best.metric is not None))
      # The checkpoint's data position is after this step's batch: read it before the next
      # batch is fetched. Fetching it now overlaps host data work with the device step.
      saved_data = data_state.global_state(batches) if save else None
      if not (last or stop):
        host_batch_next = next(batches)
      if config.step.nonfinite == "stop" or last or step % config.log_period == 0:
        scalars = evaluation.host_scalars(metrics)  # waits for the step
        if scalars.pop("nonfinite"):
          _nonfinite(config, step, scalars, checkpointer, log)
        if step % config.log_period == 0 or last:
          meter.log(step, scalars, host_batch, writer, result, log)
      if loss_eval or infer_eval:
        _log_eval(trainer, state, step, writer, result, log, loss=loss_eval, infer=infer_eval,
                  evaluators=evaluators)
        meter.restart(step)
      if save:
        if infer_eval:
          best.update(step, result)
        checkpointer.save(step, state, saved_data,
                          metrics=result.eval_metrics if result.eval_step == step else None)
      if stop and not last:
        log(f"t5lite: preempted (SIGTERM): saved checkpoint {step}; rerun the same command to "
            "resume")
        result.preempted = True
        break
      if not last:
        host_batch = host_batch_next
        # After the next batch is fetched (host work overlapping the step), before the next
        # step: every process gets the same answer, so all save at the same step.
        stop = step % config.preemption_check_period == 0 and _agreed(sigterm.requested)
  finally:
    writer.close()
  result.step = step
  return result
