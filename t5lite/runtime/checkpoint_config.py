"""When a run saves checkpoints and which it keeps (CheckpointConfig), as orbax's preservation
policy. t5lite.runtime.checkpoints writes them; gin files set `CheckpointConfig.*`."""
from __future__ import annotations

import dataclasses

from orbax.checkpoint.checkpoint_managers import preservation_policy as pp_lib

from t5lite.errors import ConfigError

ON_CORRUPT = ("fallback", "stop")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """When to save and what to keep."""

  period: int = 1000
  """Save every this many steps (and always at the last step and on preemption)."""
  keep: int | None = 3
  """Keep the newest this many checkpoints; None keeps all."""
  keep_period: int | None = None
  """Also keep forever every checkpoint whose step is a multiple of this (None: none)."""
  async_save: bool = True
  """Write in a background thread while training goes on (the arrays are copied first)."""
  on_corrupt: str = "fallback"
  """A committed checkpoint that cannot be read: 'fallback' to the previous one, or 'stop'."""
  best_metric: str | None = None
  """Also keep the checkpoint with the best value of this metric, e.g.
  'eval/glue_cola_v002/matthews_corrcoef' (saved at every inference eval when set)."""
  best_mode: str = "max"
  """'max' or 'min': which value of best_metric is best."""

  def __post_init__(self):
    if self.period < 1:
      raise ConfigError(f"CheckpointConfig.period must be >= 1, got {self.period}")
    if self.keep is not None and self.keep < 1:
      raise ConfigError(f"CheckpointConfig.keep must be >= 1 or None, got {self.keep}")
    if self.best_mode not in ("max", "min"):
      raise ConfigError(f"CheckpointConfig.best_mode must be 'max' or 'min', got "
                        f"{self.best_mode!r}")
    if self.on_corrupt not in ON_CORRUPT:
      raise ConfigError(f"CheckpointConfig.on_corrupt={self.on_corrupt!r} is not one of "
                        f"{ON_CORRUPT}")


def metric_of(name: str):
  """The metric `name` out of a checkpoint's metrics dict (orbax's best_fn)."""
  return lambda metrics: metrics[name]


def preservation_policy(config: CheckpointConfig):
  """orbax's policy for which checkpoints to keep: the newest `keep`, every `keep_period`-th,
  and the best by `best_metric`."""
  policies = [pp_lib.LatestN(n=config.keep)]
  if config.keep_period:
    policies.append(pp_lib.EveryNSteps(interval_steps=config.keep_period))
  if config.best_metric:
    # Keeps the highest value after sorting: descending order (reverse) makes it the lowest.
    policies.append(pp_lib.BestN(get_metric_fn=metric_of(config.best_metric), n=1,
                                 reverse=config.best_mode == "min",
                                 keep_checkpoints_without_metrics=False))
  return pp_lib.AnyPreservationPolicy(policies) if len(policies) > 1 else policies[0]
