"""The train benchmarks' shared timing: one side per framework (T5liteSide: the jitted step
`t5lite train` runs; HFSide: a torch step), interleaved runs with contention measured
(`measure`), and the report's table. t5lite.bench.train (T5) and t5lite.bench.family_train
(BERT, GPT-2) both time through it."""
from __future__ import annotations

import functools
import gc
import os
import statistics
import time
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from t5lite.bench import machine
from t5lite.util import progress

GOALS = {"pretrain": 1.2, "finetune": 2.0}


class T5liteSide:
  """The trainer's step (windowed_train_step: the update plus the on-device metrics window),
  compiled ahead of time, donating its state."""

  def __init__(self, config, params, optimizer_config, batches):
    import jax
    from t5lite.families import family_of
    from t5lite.train.optimizers import make_optimizer
    from t5lite.train.step import StepConfig, new_window, windowed_train_step
    from t5lite.train.train_state import TrainState
    self.jax = jax
    step_config = StepConfig(z_loss=0.0)  # HF's loss has no z-loss
    family = family_of(config, step_config.loss_options())
    optimizer = make_optimizer(optimizer_config, family.param_logical_axes())
    self.batches = [jax.device_put({k: np.asarray(v, np.int32) for k, v in b.items()})
                    for b in batches]
    self.state = jax.jit(TrainState.create, static_argnums=1)(params, optimizer)
    self.window = jax.device_put(new_window())
    fn = functools.partial(windowed_train_step, family=family, optimizer=optimizer,
                           step_config=step_config)
    start = time.perf_counter()
    self.compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(
        self.state, self.window, self.batches[0]).compile()
    self.compile_s = time.perf_counter() - start

  def run(self, batches=None) -> list:
    losses = []
    for batch in batches or self.batches:
      self.state, self.window, metrics = self.compiled(self.state, self.window, batch)
      losses.append(metrics["loss"])
    self.jax.block_until_ready((self.state, losses))
    return [float(x) for x in losses]

  def compiled_temp_bytes(self) -> int | None:
    analysis = self.compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)

  def peak_device_bytes(self) -> int | None:
    stats = self.jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


class HFSide:
  """HFTrainer stepping through its batch list."""

  def __init__(self, trainer, batches):
    self.trainer = trainer
    self.batches = [trainer.to_device(b) for b in batches]

  def run(self, batches=None) -> list:
    losses = [self.trainer.step(batch) for batch in batches or self.batches]
    self.trainer.synchronize()
    return [float(x) for x in losses]


def _median(values: Sequence[float]) -> float:
  return float(statistics.median(values))


class Timing(NamedTuple):
  """What `measure` saw: per side, the warm-up, the timed runs and the step memory."""
  first_step_s: dict[str, float]
  warmup_losses: dict[str, list[float]]
  wall: dict[str, list[float]]
  cpu: dict[str, list[float]]
  others_cpu: list[float]
  load_after: tuple[float, float, float]
  step_memory: dict[str, int]


def measure(sides: dict, repeats: int, quiet_wait_s: float, log: Callable[[str], Any]) -> Timing:
  """Warm-up (2 untimed steps per side, losses kept), then `repeats` interleaved timed runs of
  each side's whole batch list (t5lite, HF, t5lite, HF, ...; the other processes' CPU share
  measured over each), then one step per side under the RSS sampler."""
  first_step_s, warmup_losses = {}, {}
  for name, side in sides.items():  # warm-up: 2 steps on the first batches, losses kept
    start = time.perf_counter()
    warmup_losses[name] = side.run(side.batches[:1]) + side.run(side.batches[1:2] or
                                                                side.batches[:1])
    first_step_s[name] = time.perf_counter() - start

  wall: dict[str, list[float]] = {name: [] for name in sides}
  cpu: dict[str, list[float]] = {name: [] for name in sides}
  others_cpu: list[float] = []
  deadline = time.monotonic() + quiet_wait_s
  with progress.Progress("bench: timed repeats", repeats, "repeat") as bar:
    for _ in range(repeats):
      if quiet_wait_s > 0:  # before every pair: contention spoils a pair, not the median
        machine.wait_for_quiet(max(0.0, deadline - time.monotonic()), log=log)
      for name, side in sides.items():  # interleaved: t5lite, HF, t5lite, HF, ...
        gc.collect()  # neither side pays for the other's garbage
        others = machine.OthersCpu().start()
        w, c = time.perf_counter(), time.process_time()
        side.run()
        wall[name].append(time.perf_counter() - w)
        cpu[name].append(time.process_time() - c)
        fraction = others.stop()
        if fraction is not None:
          others_cpu.append(fraction)
      bar.update()
  load_after = os.getloadavg()
  step_memory = {name: machine.peak_rss_above(functools.partial(side.run, side.batches[:1]))
                 for name, side in sides.items()}
  return Timing(first_step_s, warmup_losses, wall, cpu, others_cpu, load_after, step_memory)


def _table(report: dict, wall: dict, tokens: int) -> str:
  """The human-readable part of the report."""
  lines = [f"{'side':8} {'tokens/s (median)':>18} {'min':>8} {'max':>8} {'step s':>8} "
           f"{'compile/warm-up s':>18} {'step RSS MB':>12}"]
  for name in wall:
    rates = [tokens / w for w in wall[name]]
    first = (report["t5lite_compile_s"] if name == "t5lite" else
             report["first_two_steps_s"][name])
    lines.append(f"{name:8} {statistics.median(rates):18.0f} {min(rates):8.0f} {max(rates):8.0f} "
                 f"{report[name + '_step_s']:8.3f} {first:18.2f} "
                 f"{report['step_peak_rss_mb'][name] or 0:12.0f}")
  ratio, goal = report["ratio_vs_hf"], GOALS[report["mode"]]
  if ratio is not None:
    lines.append(f"ratio t5lite / HF: {ratio:.2f}x (goal {goal}x: "
                 f"{'met' if ratio >= goal else 'NOT met'}); step-0 loss t5lite "
                 f"{report['step0_loss']['t5lite']:.5f} vs HF {report['step0_loss']['hf']:.5f}")
  lines.append(f"{report['repeats']} interleaved runs of {tokens} {report['tokens_counted']} "
               f"tokens; padding efficiency {report['padding_efficiency']}; cpu/wall "
               f"{report['cpu_per_wall']}; load {report['load_avg_1m']}, other processes used "
               f"{report['others_cpu_fraction']} (median, max) of the CPUs while timing")
  if "matmul_shape" in report:  # T5's bench (not yet BERT's and GPT-2's)
    m, k, n = report["matmul_shape"]
    lines.append("FLOP rate: " + ", ".join(
        f"{name} {rate / 1e9:.0f} GFLOP/s ({100 * report['fraction_of_matmul_peak'][name]:.0f}%)"
        for name, rate in report["flops_per_s"].items())
        + f" of this machine's {report['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s on the step's "
        f"largest matmul ({m}x{k} @ {k}x{n}, {report['config']['dtype']})")
  if report["mfu_t5lite"] is not None:
    lines.append(f"t5lite MFU {100 * report['mfu_t5lite']:.1f}% on {report['device_kind']}")
  return "\n".join(lines)
