"""Weights & Biases beside metrics.jsonl and TensorBoard: on when TrainConfig.wandb is set.

    # gin: TrainConfig.wandb = @WandbConfig()   (gin/runs/wandb.gin)
    #      WandbConfig.project = 'my-project'    (or WANDB_PROJECT in the environment)
    t5lite train --gin_file=... --gin_file=gin/runs/wandb.gin --gin.WandbConfig.project="'t5'"

Every metrics row goes to the W&B run as it goes to metrics.jsonl, at W&B's step = the
training step; the model and train configs are the run's config; the run's last figures (its
step, last loss and last evaluation) its summary. Only the primary process logs.

A resumed run continues the same W&B run (its id is kept in MODEL_DIR/wandb_run.json), and
W&B is a mirror of metrics.jsonl: each start first sends the W&B run the rows of
metrics.jsonl it may lack, then the new ones. W&B keeps what its service sent before a
process was killed and no more (offline, nothing of that session; online, what was uploaded),
and it drops a row at a step below the last one it holds; so a start sends the rows from the
step the resumed W&B run reports (`run.starting_step`; 0 offline) on, and each step's row
reaches the W&B run once. The rows are those of metrics.jsonl: a resumed run drops the
interrupted run's rows after its checkpoint there and logs those steps again, bitwise the
same. W&B's own environment variables
(WANDB_API_KEY, WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_DIR) apply to what the config
leaves unset; mode='offline' writes the run to local files only (`wandb sync` uploads them).
wandb is an optional extra: `pip install 't5lite[wandb]'`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import secrets
from typing import Any, Mapping, Sequence

from t5lite.errors import ConfigError
from t5lite.util import atomic, paths

STATE_FILE = "wandb_run.json"
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
    check_installed()  # when gin builds the run's config: before anything is written


MISSING = ("TrainConfig.wandb is set but wandb is not installed: pip install 't5lite[wandb]' "
           "(or leave out gin/runs/wandb.gin)")


def check_installed() -> None:
  try:
    spec = importlib.util.find_spec("wandb")
  except (ValueError, AttributeError):  # sys.modules holds None for it: imports refused
    spec = None
  if spec is None:
    raise ConfigError(MISSING)


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


def _run_id(model_dir: str) -> str:
  """MODEL_DIR's W&B run id: the one kept in wandb_run.json, or a new one, kept from now on."""
  path = paths.join(model_dir, STATE_FILE)
  if paths.isfile(path):
    return json.loads(paths.read_text(path))["id"]
  run_id = secrets.token_hex(4)  # W&B ids: up to 64 of [a-z0-9_-]
  atomic.write_file(path, json.dumps({"id": run_id}) + "\n")
  return run_id


class WandbRun:
  """One training run's W&B run, started on the primary process (t5lite.runtime.metrics_writer
  calls it)."""

  def __init__(self, config: WandbConfig, model_dir: str, run_config: Mapping[str, Any],
               history: Sequence[Mapping[str, Any]] = ()):
    """history: the rows metrics.jsonl holds already (a resumed run's), oldest first."""
    try:
      import wandb
    except ImportError:
      raise ConfigError(MISSING) from None
    self.run_id = _run_id(model_dir)
    folder = config.dir or (None if paths.is_url(model_dir) else model_dir)
    if folder is not None:
      os.makedirs(folder, exist_ok=True)
    self._run = wandb.init(
        project=config.project, entity=config.entity,
        name=config.name or paths.basename(model_dir.rstrip("/")), group=config.group,
        tags=list(config.tags) or None, mode=config.mode, dir=folder, id=self.run_id,
        resume="allow", config=plain(dict(run_config)))
    start = int(getattr(self._run, "starting_step", 0) or 0)
    for row in history:
      if row.get("step", -1) >= start:
        self.log(row["step"], {k: v for k, v in row.items() if k != "step"})

  def log(self, step: int, values: Mapping[str, float | None]) -> None:
    self._run.log({k: v for k, v in values.items() if v is not None}, step=step)

  def summarize(self, figures: Mapping[str, Any]) -> None:
    self._run.summary.update(dict(figures))

  def finish(self, failed: bool = False) -> None:
    self._run.finish(exit_code=1 if failed else 0)
