"""Weights & Biases beside metrics.jsonl and TensorBoard: on when TrainConfig.wandb is set.

    # gin: TrainConfig.wandb = @WandbConfig()   (gin/runs/wandb.gin)
    #      WandbConfig.project = 'my-project'    (or WANDB_PROJECT in the environment)
    t5lite train --gin_file=... --gin_file=gin/runs/wandb.gin --gin.WandbConfig.project="'t5'"

Every metrics row goes to the W&B run as it goes to metrics.jsonl, plotted against the
training step (the rows' own `step` key: a resumed run logs the steps after its checkpoint
again, which W&B's internal step counter would drop); the model and train configs are the
run's config; the run's last figures (its step, last loss and last evaluation) its summary.
Only the primary process logs. The run's id is kept in MODEL_DIR/wandb_run_id.txt, so a
resumed run (the same MODEL_DIR) continues the same W&B run. W&B's own environment variables
(WANDB_API_KEY, WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_DIR) apply to what the config
leaves unset; mode='offline' writes the run to local files only (`wandb sync` uploads them).
wandb is an optional extra: `pip install 't5lite[wandb]'`.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Any, Mapping

from t5lite.errors import ConfigError
from t5lite.util import atomic, paths

RUN_ID_FILE = "wandb_run_id.txt"
MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
  """Where a run logs in W&B. None fields: W&B's environment variables or its defaults."""

  project: str | None = None
  entity: str | None = None
  """The W&B user or team."""
  name: str | None = None
  """The run's display name (default: MODEL_DIR's last folder name)."""
  group: str | None = None
  tags: tuple[str, ...] = ()
  mode: str | None = None
  """'online', 'offline' (local files, uploaded later by `wandb sync`) or 'disabled'."""
  dir: str | None = None
  """Where wandb keeps its local files (default: MODEL_DIR; a temporary folder when MODEL_DIR
  is a bucket, as wandb writes local files only)."""

  def __post_init__(self):
    if self.mode is not None and self.mode not in MODES:
      raise ConfigError(f"WandbConfig.mode={self.mode!r} is not one of {', '.join(MODES)}")


def plain(value: Any) -> Any:
  """`value` as JSON-like data for W&B's config: dataclasses as dicts, tuples as lists,
  anything else that JSON cannot hold as its repr."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  if isinstance(value, Mapping):
    return {str(k): plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [plain(v) for v in value]
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return repr(value)


def run_id(model_dir: str) -> str:
  """MODEL_DIR's W&B run id: the one kept there, or a new one, kept from now on."""
  path = paths.join(model_dir, RUN_ID_FILE)
  if paths.isfile(path):
    return paths.read_text(path).strip()
  new = secrets.token_hex(4)  # W&B ids: up to 64 of [a-z0-9_-]
  atomic.write_file(path, new + "\n")
  return new


class WandbRun:
  """One training run's W&B run, started on the primary process (t5lite.runtime.metrics_writer
  calls it)."""

  def __init__(self, config: WandbConfig, model_dir: str, run_config: Mapping[str, Any]):
    try:
      import wandb
    except ImportError:
      raise ConfigError("TrainConfig.wandb is set but wandb is not installed: pip install "
                        "'t5lite[wandb]' (or unset TrainConfig.wandb)") from None
    folder = config.dir or (None if paths.is_url(model_dir) else model_dir)
    if folder is not None:
      os.makedirs(folder, exist_ok=True)
    self._run = wandb.init(
        project=config.project, entity=config.entity,
        name=config.name or paths.basename(model_dir.rstrip("/")), group=config.group,
        tags=list(config.tags) or None, mode=config.mode, dir=folder, id=run_id(model_dir),
        resume="allow", config=plain(dict(run_config)))
    self._run.define_metric("step")
    self._run.define_metric("*", step_metric="step")

  def log(self, step: int, values: Mapping[str, float]) -> None:
    self._run.log({"step": step, **values})

  def summarize(self, figures: Mapping[str, Any]) -> None:
    self._run.summary.update(dict(figures))

  def finish(self, failed: bool = False) -> None:
    self._run.finish(exit_code=1 if failed else 0)
