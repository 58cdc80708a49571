"""The training loop: steps, and after each the periodic actions that are due.

    result = run(trainer, checkpointer, sigterm, log)    # t5lite.train.trainer.train calls it

  restore or init -> compile -> [step -> due actions: (log) (eval) (checkpoint) (SIGTERM?)]*

Each step is dispatched with the state, an on-device metrics window and the global batch
(step.windowed_train_step): the step adds its metrics into the window, and the host reads
nothing back until an action that looks at the metrics or the state is due (loop.host(): one
device-to-host read of the window and the step's metrics). So the host fetches and places the
next batch while the device runs the step, and dispatches step k + 1 before step k is done.

Non-finite steps are found at those reads: with StepConfig.nonfinite='stop' the window froze
the state at the first non-finite step k (no update applied since), so the state in memory is
the last good one: it is saved as checkpoint k - 1, marked as such (its data position is past
the batches drawn since, so a rerun, e.g. with a lower learning rate, resumes there and skips
them, as PaLM restarted before loss spikes), and the run stops with an error naming step k,
before any eval sees the state. With 'skip' the window counts every dropped update
(skipped_steps in the log rows); when more than StepConfig.max_skipped_fraction of the steps
run so far (counted from the tenth) were dropped, the run stops.

The step is compiled ahead of time, before the first step: its compile time is recorded once
(compile_s in the first metrics row) and stays out of tokens/s and MFU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

from t5lite.runtime import preemption
from t5lite.runtime import partitioning as part
from t5lite.runtime.metrics_writer import MetricsWriter, ProgressLine
from t5lite.runtime.processes import all_flags
from t5lite.train import data_state, schedules, step_program
from t5lite.train.actions import Action, Clock, Evaluate, default_actions
from t5lite.train.step import new_window

Tree = Any
NONFINITE_MARK = "t5lite_last_good_state"
"""Key of the data item of a checkpoint saved as the last good state before a non-finite
step (StepConfig.nonfinite='stop'); what a resumed run reports."""
MIN_STEPS_FOR_FRACTION = 10
"""StepConfig.max_skipped_fraction is checked once a run has taken this many steps: one early
skipped step out of three is not yet a pattern."""


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


def fetch(tree: Tree) -> Tree:
  """Device -> host: the loop's only read of the device, so that tests can count them."""
  return jax.device_get(tree)


class Loop:
  """Where the run is and its pieces: what the actions see and change."""

  def __init__(self, trainer, checkpointer, batches, writer: MetricsWriter, result,
               sigterm: preemption.SigtermFlag, log: Callable[[str], None]):
    self.trainer, self.checkpointer, self.batches = trainer, checkpointer, batches
    self.writer, self.result, self.sigterm, self.log = writer, result, sigterm, log
    self.step = result.step
    self.last = False
    self.stopping = False        # SIGTERM was agreed after the previous step: save and return
    self.stop_requested = False  # agreed after this step
    self.state = self.window = self.metrics = None
    self.feature_lengths: dict[str, int] = {}  # of the model features (batch columns)
    self.compile_s: float | None = None
    self.step_memory: dict[str, int] = {}  # XLA's estimate for the compiled step (first row)
    self.clock = Clock()
    self.progress = ProgressLine(trainer.config.train_steps, start_step=self.step)
    self._host = None  # (window, metrics) read at this step, or None
    # Steps and skipped steps of the windows closed so far (the open one is read by host()).
    self.closed_steps = self.closed_skipped = 0
    self.stop_error: Exception | None = None  # ends the run after this step's actions

  def advance(self) -> None:
    """Counts the step just dispatched; nothing of it has been read yet."""
    self.step += 1
    self.last = self.step == self.trainer.config.train_steps
    self._host = None

  def reset_window(self) -> None:
    """Opens a new metrics window (after a log) and restarts the throughput clock."""
    if self._host is not None:
      self.closed_steps += self._host[0]["steps"]
      self.closed_skipped += self._host[0]["nonfinite_steps"]
    self.window = jax.device_put(new_window(), self.trainer.replicated)
    self.clock.restart()

  def host(self) -> tuple[dict, dict]:
    """(window, the step's metrics) as Python numbers: one device read per step at most.
    With nonfinite='stop', a window holding a non-finite step ends the run here."""
    if self._host is None:
      window, metrics = fetch((self.window, self.metrics))
      window = {k: int(v) if k != "loss_sum" else float(v) for k, v in window.items()}
      metrics = {k: float(v) for k, v in metrics.items() if k != "nonfinite"}
      self._host = (window, metrics)
      step_config = self.trainer.config.step
      if window["first_nonfinite"] >= 0 and step_config.nonfinite == "stop":
        self._stop_nonfinite(window["first_nonfinite"])
      if step_config.nonfinite == "skip" and step_config.max_skipped_fraction is not None:
        self._check_skipped(window, step_config.max_skipped_fraction)
    return self._host

  def _stop_nonfinite(self, step: int) -> None:
    """Saves the state before non-finite step `step` (the window froze it there) as
    checkpoint step - 1, marked, then stops the run."""
    good = step - 1
    saved = good in self.checkpointer.all_steps()
    if not saved and good > 0:
      position = data_state.global_state(self.batches)  # past the batches drawn since
      position[NONFINITE_MARK] = {
          "first_nonfinite_step": step, "batches_drawn_until_step": self.step + (0 if self.last or self.stopping else 1),
          "note": "the last good state before a non-finite step; the data position is "
                  "past the batches drawn since, which a resumed run skips"}
      self.checkpointer.save(good, self.state, position)
      self.checkpointer.wait()
    where = (f"checkpoint {good} holds the state before it"
             + ("" if saved else " (saved now, marked as the last good state; a rerun resumes "
                "there and skips the batches drawn since)") if good > 0
             else "no update was ever applied")
    raise FloatingPointError(
        f"non-finite loss or gradients at step {step}; the run stops, no update was applied "
        f"from that step on: {where}. Lower the learning rate, check the data, "
        "or set StepConfig.nonfinite='skip' to drop such updates")

  def _check_skipped(self, window: dict, fraction: float) -> None:
    steps = self.closed_steps + window["steps"]
    skipped = self.closed_skipped + window["nonfinite_steps"]
    if steps >= MIN_STEPS_FOR_FRACTION and skipped > fraction * steps:
      last = self.checkpointer.latest_step()
      # Raised once this step's actions ran: its log row counts the skips it reports.
      self.stop_error = FloatingPointError(
          f"{skipped} of the {steps} steps run up to step {self.step} had a non-finite loss or "
          f"gradients and were skipped, more than StepConfig.max_skipped_fraction={fraction}; "
          f"the run stops (last checkpoint: {last if last is not None else 'none'}). Lower "
          "the learning rate or check the data; raise max_skipped_fraction (None: never "
          "stop) to go on regardless")


def run(trainer, checkpointer, sigterm: preemption.SigtermFlag,
        log: Callable[[str], None], actions: list[Action] | None = None, *,
        prepare: Callable[[], None] = lambda: None):
  """Trains from MODEL_DIR's newest checkpoint (or INITIAL_CHECKPOINT_PATH, or a fresh init)
  to TRAIN_STEPS; returns the TrainResult. `prepare` runs once the start state is known, so
  that what it writes to MODEL_DIR is written only by a run that goes on."""
  config = trainer.config
  batches = trainer.dataset(config.mixture_or_task_name, trainer.pipeline_config(),
                            config.data_workers)
  state, step = trainer.initial_state(checkpointer, batches, log)
  prepare()
  result = TrainResult(step=step, losses={})
  if step >= config.train_steps:
    log(f"t5lite: already at step {step} >= TRAIN_STEPS={config.train_steps}; nothing to do "
        "(raise TRAIN_STEPS to train on)")
    return result
  warning = schedules.early_end(config.optimizer.schedule, config.train_steps)
  if warning:
    log(warning)
  actions = default_actions(config, trainer.is_primary) if actions is None else actions
  writer = MetricsWriter(config.model_dir, is_primary=trainer.is_primary, resume_step=step,
                         wandb=config.wandb,
                         run_config={"model": trainer.model_config, "train": config})
  loop = Loop(trainer, checkpointer, batches, writer, result, sigterm, log)
  loop.state = state
  try:
    if config.run_eval_before_training and (config.eval_period or config.infer_eval_period):
      evaluate = next(a for a in actions if isinstance(a, Evaluate))
      evaluate.run(loop, loss=bool(config.eval_period), infer=bool(config.infer_eval_period))
    if any(all_flags(sigterm.requested)):  # SIGTERM during startup: nothing new to save
      log(f"t5lite: preempted (SIGTERM) before the first step, at step {step}: nothing new "
          "to save; rerun the same command to resume")
      result.preempted = True
    else:
      _train(loop, actions)
  except BaseException:
    with contextlib.suppress(Exception):  # the error on its way out is the one to see
      _close(actions)
    with contextlib.suppress(OSError):  # e.g. a full disk: the error on its way out says so
      writer.close(failed=True)
    raise
  try:
    _close(actions)
  finally:
    result.step = loop.step
    writer.summarize(_figures(result))
    writer.close(preempted=result.preempted)
  return result


def _figures(result: TrainResult) -> dict[str, Any]:
  """The run's figures at its end (W&B's run summary)."""
  figures: dict[str, Any] = {"final_step": result.step, "preempted": result.preempted}
  if result.losses:
    figures["final_loss"] = result.losses[max(result.losses)]
  if result.eval_step is not None:
    figures["final_eval_step"] = result.eval_step
    figures.update({f"final_{k}": v for k, v in result.eval_metrics.items()})
  return figures


def _close(actions: list[Action]) -> None:
  for action in actions:
    action.close()


def step_memory(compiled) -> dict[str, int]:
  """XLA's memory estimate of a compiled step per device, in bytes: arguments (the train
  state, a batch, a teacher), outputs, temporaries, and their peak sum minus the donated
  arguments it reuses (step_memory_bytes); {} when the backend gives none."""
  try:
    analysis = compiled.memory_analysis()
  except NotImplementedError:  # a backend without the analysis
    return {}
  if analysis is None:
    return {}
  out = {f"step_{name}_bytes": int(getattr(analysis, f"{name}_size_in_bytes", 0))
         for name in ("argument", "output", "temp", "alias")}
  out["step_memory_bytes"] = (out["step_argument_bytes"] + out["step_output_bytes"]
                              + out["step_temp_bytes"] - out["step_alias_bytes"])
  return out


def _train(loop: Loop, actions: list[Action]) -> None:
  trainer, config = loop.trainer, loop.trainer.config
  host_batch = next(loop.batches)
  loop.feature_lengths = {k: np.shape(v)[1] for k, v in host_batch.items() if np.ndim(v) > 1}
  loop.reset_window()
  batch = part.global_batch(host_batch, trainer.mesh)
  start = time.perf_counter()
  step_fn = step_program.compile_lowered(trainer.step_fn.lower(loop.state, loop.window, batch))
  loop.compile_s = time.perf_counter() - start
  loop.step_memory = step_memory(step_fn)
  for action in actions:
    action.begin(loop)
  loop.clock.restart()
  while loop.step < config.train_steps:
    loop.state, loop.window, loop.metrics = step_fn(loop.state, loop.window, batch)
    loop.advance()  # the device runs the step while the host goes on
    due = [a for a in actions if a.due(loop)]
    for action in due:
      action.before_next_batch(loop)
    if not (loop.last or loop.stopping):
      # Host data work (and placing the batch on the devices) overlaps the device step.
      batch = part.global_batch(next(loop.batches), trainer.mesh)
    if any(a.reads_state for a in due):
      loop.host()  # one read; stops here on a non-finite step ('stop')
    for action in due:
      start = time.perf_counter()
      action.run(loop)
      if action.pauses_clock:
        loop.clock.pause_for(time.perf_counter() - start)
    loop.checkpointer.seal_committed()  # a save that committed meanwhile: verifiable now
    if loop.stop_error is not None:
      raise loop.stop_error
    if loop.stopping and not loop.last:
      loop.log(f"t5lite: preempted (SIGTERM): saved checkpoint {loop.step}; rerun the same "
               "command to resume")
      loop.result.preempted = True
      return
    loop.stopping = loop.stop_requested
