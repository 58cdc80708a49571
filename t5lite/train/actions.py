"""The periodic actions of the training loop: each owns its "is it due?" and what it does.

    actions = default_actions(trainer.config)    # log, evaluate, checkpoint, preemption check
    # in the loop, after each step (t5lite.train.loop):
    due = [a for a in actions if a.due(loop)]
    for a in due: a.before_next_batch(loop)      # e.g. the checkpoint's data position
    ... fetch the next batch ...
    for a in due: a.run(loop)

Adding an action is a class here and a line in default_actions; the loop body stays as it is.
An action that looks at the state or the metrics (`reads_state`) makes the loop read the
on-device metrics window first, once per step (loop.host()), which also stops the run on a
non-finite step. Steps at which no such action is due read nothing from the device, so the
host dispatches step k + 1 while the device still runs step k.

The gin names users pass keep their meaning: TrainConfig.log_period, EVAL_PERIOD
(TrainConfig.eval_period), TrainConfig.infer_eval_period, CheckpointConfig.period (and
best_metric), TrainConfig.preemption_check_period.
"""
from __future__ import annotations

import abc
import contextlib
import time

import jax

from t5lite.errors import ConfigError
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.runtime.processes import all_flags
from t5lite.train import cost_model, data_state, evaluation
from t5lite.train.optimizers import learning_rate_at, optimizer_count
from t5lite.util import paths, staging


class Action(abc.ABC):
  """One thing the loop does now and then. Subclasses set `reads_state` and define due/run;
  `loop` is the run's t5lite.train.loop.Loop (where it is: step, last, state, ...)."""

  reads_state = True
  """run() looks at the state or the step's metrics: the loop checks the window first."""
  pauses_clock = False
  """Its time is not training time: throughput leaves it out (evaluations)."""

  @abc.abstractmethod
  def due(self, loop) -> bool:
    """Whether to act after the step the loop has just dispatched (loop.step)."""

  def before_next_batch(self, loop) -> None:
    """Runs when due, before the loop fetches the next batch."""

  @abc.abstractmethod
  def run(self, loop) -> None:
    """Acts; the loop has fetched the next batch (and read the window if reads_state)."""

  def begin(self, loop) -> None:
    """Runs once before the run's first step (loop.step: the step it starts from)."""

  def close(self) -> None:
    """Runs once when the run ends, also on an error: releases what begin/run took."""


def _every(period: int, loop) -> bool:
  """Due every `period` steps and at the last one; never when period is 0."""
  return bool(period) and (loop.step % period == 0 or loop.last)


class LogMetrics(Action):
  """metrics.jsonl / TensorBoard rows and the progress line every log_period steps.

  A row holds the logged step's own metrics (`loss` is that step's loss), the window's
  `loss_mean` over its finite steps, `skipped_steps` (non-finite updates dropped in the window),
  the learning rate, tokens/s and MFU over the window (compilation excluded: the loop compiles
  before the first step and records the time once, as `compile_s` in the first row, beside
  XLA's memory estimate of the step, `step_*_bytes`), and `tokens`, the tokens the run has
  trained on (its steps x batch rows x a row's tokens; a finetuning run counts from its
  initial checkpoint): `t5lite plot --x tokens` reads it."""

  def __init__(self, period: int):
    self.period = period
    self.peak = cost_model.peak_flops(jax.devices()[0].device_kind)

  def due(self, loop) -> bool:
    return _every(self.period, loop)

  def run(self, loop) -> None:
    window, scalars = loop.host()
    trainer, config = loop.trainer, loop.trainer.config
    steps, seconds = window["steps"], loop.clock.seconds()
    lengths = loop.feature_lengths
    tokens_per_step = trainer.family.tokens_per_example(lengths) * config.batch_size
    tokens = tokens_per_step * steps
    # The schedule reads the optimizer's count, which a finetuning run restarts at 0.
    count = optimizer_count(loop.state.opt_state)
    lr_step = int(jax.device_get(count)) - 1 if count is not None else loop.step - 1
    lr = learning_rate_at(config.optimizer, max(lr_step, 0))
    # `tokens`: this run's steps (the optimizer's count: a finetuning run counts from its
    # initial checkpoint) x a step's tokens.
    record = {**scalars, "learning_rate": lr, "tokens_per_s": tokens / seconds,
              "tokens": tokens_per_step * (lr_step + 1)}
    if window["finite_steps"]:
      record["loss_mean"] = window["loss_sum"] / window["finite_steps"]
    record["skipped_steps"] = window["nonfinite_steps"]
    mfu = None
    if self.peak:
      flops = trainer.family.flops_per_example(lengths) * config.batch_size * steps
      mfu = record["mfu"] = cost_model.mfu(flops, seconds, self.peak * jax.device_count())
    if loop.compile_s is not None:
      record["compile_s"], loop.compile_s = loop.compile_s, None
      record.update(loop.step_memory)
    loop.writer.write(loop.step, record)
    loop.result.losses[loop.step] = scalars["loss"]
    if window["nonfinite_steps"]:
      loop.log(f"t5lite: {window['nonfinite_steps']} update(s) with a non-finite loss or "
               f"gradients skipped in the last {steps} steps (the first at step "
               f"{window['first_nonfinite']})")
    loop.log(loop.progress.update(loop.step, scalars["loss"], lr, tokens, seconds, mfu))
    loop.reset_window()


class Evaluate(Action):
  """Eval loss and token accuracy every eval_period steps (EVAL_PERIOD), inference evals with
  the tasks' own metrics every infer_eval_period steps; both at the last step."""

  pauses_clock = True

  def __init__(self, loss_period: int, infer_period: int):
    self.loss_period, self.infer_period = loss_period, infer_period
    self.evaluators: dict = {}  # the inference evals' examples, read once per run

  def infer_due(self, loop) -> bool:
    return _every(self.infer_period, loop)

  def due(self, loop) -> bool:
    return _every(self.loss_period, loop) or self.infer_due(loop)

  def run(self, loop, *, loss: bool | None = None, infer: bool | None = None) -> None:
    loss = _every(self.loss_period, loop) if loss is None else loss
    infer = self.infer_due(loop) if infer is None else infer
    trainer, params = loop.trainer, loop.state.params
    metrics = evaluation.evaluate(trainer, params) if loss else {}
    if infer:  # decoding reads the whole model (a PEFT run's adapters joined to its base)
      metrics.update(evaluation.infer_evaluate(trainer, trainer.model_params(params), loop.step,
                                               self.evaluators))
    loop.result.eval_metrics, loop.result.eval_step = metrics, loop.step
    loop.writer.write(loop.step, metrics)
    if metrics:
      loop.log(f"step {loop.step} eval: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))


BEST_CHECKPOINT_FILE = "best_checkpoint.json"


class SaveCheckpoint(Action):
  """A checkpoint every CheckpointConfig.period steps, at the last step and on preemption;
  with CheckpointConfig.best_metric also at every inference eval, ranked by that metric
  (orbax keeps the best; MODEL_DIR/best_checkpoint.json names it)."""

  def __init__(self, period: int, best_metric: str | None, evaluate: Evaluate):
    self.period, self.best_metric, self.evaluate = period, best_metric, evaluate
    self.data_state = None

  def due(self, loop) -> bool:
    ranked = self.best_metric is not None and self.evaluate.infer_due(loop)
    return loop.stopping or loop.last or loop.step % self.period == 0 or ranked

  def before_next_batch(self, loop) -> None:
    # The data position after this step's batch: read before the next batch is fetched.
    self.data_state = data_state.global_state(loop.batches)

  def run(self, loop) -> None:
    result = loop.result
    metrics = result.eval_metrics if result.eval_step == loop.step else None
    loop.checkpointer.save(loop.step, loop.state, self.data_state, metrics=metrics)
    if self.best_metric is not None and metrics is not None:
      if self.best_metric not in metrics:
        raise ConfigError(f"CheckpointConfig.best_metric={self.best_metric!r} is not among the "
                          f"eval metrics {sorted(metrics)}")
      best = loop.checkpointer.best()
      if loop.trainer.is_primary and best is not None:
        model_dir_lib.write_json(
            paths.join(loop.trainer.config.model_dir, BEST_CHECKPOINT_FILE),
            {"step": best[0], "metric": self.best_metric, "value": best[1]})


class PreemptionCheck(Action):
  """Every preemption_check_period steps the processes agree whether any got SIGTERM (one
  all-gather of a flag; with one process just the flag). Agreed after step k, the loop runs
  step k + 1 (its batch is already fetched), saves it and returns."""

  reads_state = False

  def __init__(self, period: int):
    self.period = period

  def due(self, loop) -> bool:
    return not (loop.last or loop.stopping) and loop.step % self.period == 0

  def run(self, loop) -> None:
    loop.stop_requested = any(all_flags(loop.sigterm.requested))


PROFILE_DIR = "profile"


class Profile(Action):
  """A jax.profiler trace of `steps` steps, after the run's first `after` steps (the first
  steps pay one-time costs), into MODEL_DIR/profile, which XProf and TensorBoard's profile
  plugin read (`xprof server --logdir=MODEL_DIR/profile`; docs/tracking.md). The primary
  process traces its host's devices. The trace starts once the step before the first traced
  one and that step's other actions are done, and stops when the last traced step is, before
  its own actions (a log, an eval, a save): it holds those steps only. On a bucket MODEL_DIR
  the trace is written to a local folder and uploaded when it stops (the profiler writes
  local files). Its time (waiting for the device, writing the trace) is not training time."""

  reads_state = False
  pauses_clock = True

  def __init__(self, after: int, steps: int, model_dir: str, is_primary: bool):
    self.after, self.steps, self.is_primary = after, steps, is_primary
    self.folder = paths.join(model_dir, PROFILE_DIR)
    self.first = self.end = None  # the first traced step and the last, set by begin
    self._tracing: contextlib.ExitStack | None = None
    self._stopped_at: int | None = None

  def begin(self, loop) -> None:
    self.first = loop.step + self.after + 1
    self.end = self.first + self.steps - 1
    if self.after == 0:
      self._start(loop)

  def due(self, loop) -> bool:
    if self._tracing is None:
      return loop.step == self.first - 1 and not (loop.last or loop.stopping)
    return loop.step >= self.end or loop.last or loop.stopping

  def before_next_batch(self, loop) -> None:
    if self._tracing is not None:  # the last traced step: stop before its actions
      jax.block_until_ready(loop.state)  # the step's own time: training
      start = time.perf_counter()
      self.close()
      self._stopped_at = loop.step
      loop.clock.pause_for(time.perf_counter() - start)  # writing the trace: not training

  def run(self, loop) -> None:
    if self._stopped_at is not None:
      loop.log(f"t5lite: profiled steps {self.first}-{self._stopped_at} into {self.folder}")
      self._stopped_at = None
    elif loop.step == self.first - 1:
      self._start(loop)

  def _start(self, loop) -> None:
    if not self.is_primary:
      return
    jax.block_until_ready(loop.state)
    self._tracing = contextlib.ExitStack()
    local = self._tracing.enter_context(staging.upload(self.folder))
    jax.profiler.start_trace(local)
    self._tracing.callback(jax.profiler.stop_trace)

  def close(self) -> None:
    tracing, self._tracing = self._tracing, None
    if tracing is not None:
      tracing.close()  # stops the trace, then uploads it (a bucket MODEL_DIR)


def default_actions(config, is_primary: bool = True) -> list[Action]:
  """The actions of a run in the order they run at a step: log first (its throughput ends
  before evals), evaluations, the checkpoint (it ranks by the eval just made), then the
  preemption check (after the next batch is fetched, as late as possible); a profile when
  TrainConfig.profile_steps asks for one."""
  evaluate = Evaluate(config.eval_period, config.infer_eval_period)
  actions = [LogMetrics(config.log_period), evaluate,
             SaveCheckpoint(config.checkpoint.period, config.checkpoint.best_metric, evaluate),
             PreemptionCheck(config.preemption_check_period)]
  if config.profile_steps:
    actions.append(Profile(config.profile_after_steps, config.profile_steps, config.model_dir,
                           is_primary))
  return actions


class Clock:
  """Seconds of training since the last log, without the time of clock-pausing actions."""

  def __init__(self):
    self.restart()

  def restart(self) -> None:
    self.start, self.paused = time.perf_counter(), 0.0

  def pause_for(self, seconds: float) -> None:
    self.paused += seconds

  def seconds(self) -> float:
    return max(time.perf_counter() - self.start - self.paused, 1e-9)
