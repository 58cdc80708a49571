"""Learning-rate schedules: optax schedules (step -> learning rate) with their own horizons.

Every schedule is a function of the step and of its OWN settings (warmup_steps, decay_steps),
never of the run's total number of train steps. Raising the total steps to continue a finished
run therefore leaves the learning rate of every past step unchanged, and a restored run
continues on the same curve.

    sched = make_schedule(ScheduleConfig())       # T5 v1.1: 1 / sqrt(max(step, 10000))
    sched(0) == sched(10_000) == 0.01;  sched(40_000) == 0.005

Steps count from 0, the first update (T5X passes the optimizer's step count, 0-based).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax

from t5lite.errors import ConfigError
from t5lite.util.checks import require_int

SCHEDULES = ("rsqrt", "linear", "cosine", "constant")


def _as_float(step) -> jnp.ndarray:
  return jnp.asarray(step, jnp.float32)


def _warmup_factor(step: jnp.ndarray, warmup_steps: int) -> jnp.ndarray:
  """0 -> 1 linearly over warmup_steps (T5X's `linear_warmup`, min(1, step / warmup)); else 1."""
  if warmup_steps <= 0:
    return jnp.ones_like(step)
  return jnp.minimum(1.0, step / warmup_steps)


def _check_decay(decay_steps: int) -> None:
  if decay_steps < 1:
    raise ConfigError(f"decay_steps must be >= 1 (the length of the decay after warmup), "
                      f"got {decay_steps}")


def rsqrt(base: float = 1.0, warmup_steps: int = 10000) -> optax.Schedule:
  """T5's inverse square root: base / sqrt(max(step, warmup_steps)).

  T5X's "constant * rsqrt_decay" (t5x.utils.create_learning_rate_scheduler): the warmup is a
  constant plateau at base / sqrt(warmup_steps), not a ramp. step 0..warmup -> 0.01 for the
  defaults, then 0.01 * sqrt(warmup / step).
  """
  if warmup_steps < 1:
    raise ConfigError(f"rsqrt needs warmup_steps >= 1 (the plateau), got {warmup_steps}")

  def schedule(step):
    return base / jnp.sqrt(jnp.maximum(_as_float(step), float(warmup_steps)))
  return schedule


def linear(peak: float, warmup_steps: int, decay_steps: int, end: float = 0.0) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then peak -> end over the next decay_steps, then end.

  decay_steps counts from the end of the warmup, so the schedule reaches `end` at step
  warmup_steps + decay_steps.
  """
  _check_decay(decay_steps)

  def schedule(step):
    step = _as_float(step)
    progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    decayed = peak + (end - peak) * progress
    return jnp.where(step < warmup_steps, peak * _warmup_factor(step, warmup_steps), decayed)
  return schedule


def cosine(peak: float, warmup_steps: int, decay_steps: int, end: float = 0.0) -> optax.Schedule:
  """0 -> peak linearly over warmup_steps, then half a cosine from peak to end over decay_steps.

  As for linear, the schedule stays at `end` from step warmup_steps + decay_steps on.
  """
  _check_decay(decay_steps)

  def schedule(step):
    step = _as_float(step)
    progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
    decayed = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(step < warmup_steps, peak * _warmup_factor(step, warmup_steps), decayed)
  return schedule


def constant(value: float, warmup_steps: int = 0) -> optax.Schedule:
  """`value`, reached linearly from 0 over warmup_steps (none by default)."""

  def schedule(step):
    step = _as_float(step)
    return value * _warmup_factor(step, warmup_steps)
  return schedule


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """A learning-rate schedule. Defaults are T5 v1.1 pretraining: 1 / sqrt(max(step, 10000))."""

  name: str = "rsqrt"
  """'rsqrt' (T5), 'linear', 'cosine' or 'constant'."""
  value: float = 1.0
  """rsqrt: the constant `base` (the peak is base / sqrt(warmup_steps)); linear, cosine: the peak
  learning rate reached after warmup; constant: the learning rate."""
  warmup_steps: int = 10000
  """rsqrt: length of the constant plateau; others: steps of linear warmup from 0 (0 = none)."""
  decay_steps: int = 0
  """linear, cosine: steps of decay after the warmup; ignored by rsqrt and constant."""
  end_value: float = 0.0
  """linear, cosine: the learning rate from step warmup_steps + decay_steps on."""

  def __post_init__(self):
    if self.name not in SCHEDULES:
      raise ConfigError(f"ScheduleConfig.name={self.name!r} is not one of {SCHEDULES}")
    for field in ("value", "end_value"):  # e.g. --gin.ScheduleConfig.value="'fast'"
      number = getattr(self, field)
      if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ConfigError(f"ScheduleConfig.{field} must be a number, got {number!r}")
    require_int(self.warmup_steps, "ScheduleConfig.warmup_steps", minimum=0)
    require_int(self.decay_steps, "ScheduleConfig.decay_steps", minimum=0)

  def replace(self, **changes) -> "ScheduleConfig":
    return dataclasses.replace(self, **changes)


def early_end(config: ScheduleConfig, train_steps: int) -> str | None:
  """One warning line when a decaying schedule reaches its end value before train_steps (the
  steps after it train at end_value: 0 by default), else None."""
  if config.name not in ("linear", "cosine") or not config.decay_steps:
    return None
  end = config.warmup_steps + config.decay_steps
  if end >= train_steps:
    return None
  return (f"t5lite: warning: the {config.name} learning-rate schedule reaches its end value "
          f"{config.end_value:g} at step {end}, before TRAIN_STEPS={train_steps}: the last "
          f"{train_steps - end} steps train at {config.end_value:g} (to decay until "
          f"TRAIN_STEPS, set ScheduleConfig.decay_steps={train_steps - config.warmup_steps})")


def make_schedule(config: ScheduleConfig) -> optax.Schedule:
  """The optax schedule (step -> learning rate, jittable) that a ScheduleConfig describes."""
  if config.name == "rsqrt":
    return rsqrt(config.value, config.warmup_steps)
  if config.name == "linear":
    return linear(config.value, config.warmup_steps, config.decay_steps, config.end_value)
  if config.name == "cosine":
    return cosine(config.value, config.warmup_steps, config.decay_steps, config.end_value)
  return constant(config.value, config.warmup_steps)
