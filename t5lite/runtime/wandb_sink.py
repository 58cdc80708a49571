"""Weights & Biases beside metrics.jsonl and TensorBoard: on when TrainConfig.wandb is set.

    # gin: TrainConfig.wandb = @WandbConfig()   (gin/runs/wandb.gin)
    #      WandbConfig.project = 'my-project'    (or WANDB_PROJECT in the environment)
    t5lite train --gin_file=... --gin_file=gin/runs/wandb.gin --gin.WandbConfig.project="'t5'"

Every metrics row goes to the W&B run as it goes to metrics.jsonl, at W&B's step = the
training step; the model and train configs are the run's config; the run's last figures (its
step, last loss and last evaluation) its summary. Only the primary process logs.

A resumed run continues the same W&B run (its id is kept in MODEL_DIR/wandb_run.json), and
W&B mirrors metrics.jsonl: each start first sends the W&B run the rows of metrics.jsonl it
lacks, then the new ones. What it lacks: W&B keeps what its service had written or uploaded
before a process ended (for a killed process, maybe not all it was sent), and it ignores rows
at steps below the last one it holds. So a start sends the rows from the later of the step
the resumed W&B run reports (`run.starting_step`, online) and the step after the last one a
finished session sent (kept in wandb_run.json, for offline sessions) on; each step's row
reaches the W&B run once (offline: once the sessions are synced in order, W&B ignoring a
killed session's rows sent again). A resumed run logs the steps after its checkpoint
again (metrics.jsonl and TensorBoard replace the interrupted run's rows); those rows are the
same, the resume being bitwise, so W&B's copies stand. Only a rerun that changed something
(say the learning rate, after a non-finite stop) differs: W&B cannot replace rows, and the
run says so in one line when it starts. W&B's own environment variables
(WANDB_API_KEY, WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, WANDB_DIR) apply to what the config
leaves unset; mode='offline' writes the run to local files only (`wandb sync` uploads them).
wandb's local files go to WandbConfig.dir, else WANDB_DIR, else MODEL_DIR (a local one; for a
bucket MODEL_DIR, wandb's default: ./wandb).
wandb is an optional extra: `pip install 't5lite[wandb]'`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import secrets
from typing import Any, Callable, Mapping, Sequence

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


def _read_state(model_dir: str) -> dict:
  """wandb_run.json: {"id", "sent"}: the run id, and the last step a finished session sent
  (None: none yet). A MODEL_DIR without one gets a new id, kept from now on."""
  path = paths.join(model_dir, STATE_FILE)
  if paths.isfile(path):
    state = json.loads(paths.read_text(path))
    return {"id": state["id"], "sent": state.get("sent")}
  state = {"id": secrets.token_hex(4), "sent": None}  # W&B ids: up to 64 of [a-z0-9_-]
  atomic.write_file(path, json.dumps(state) + "\n")
  return state


class WandbRun:
  """One training run's W&B run, started on the primary process (t5lite.runtime.metrics_writer
  calls it)."""

  def __init__(self, config: WandbConfig, model_dir: str, run_config: Mapping[str, Any],
               history: Sequence[Mapping[str, Any]] = (), resume_step: int | None = None,
               log: Callable[[str], Any] = print):
    """history: the rows metrics.jsonl holds already (a resumed run's), oldest first;
    resume_step: the checkpoint step the run starts from."""
    try:
      import wandb
    except ImportError:
      raise ConfigError(MISSING) from None
    self._path = paths.join(model_dir, STATE_FILE)
    self._state = _read_state(model_dir)
    self.run_id = self._state["id"]
    folder = config.dir or os.environ.get("WANDB_DIR") or (
        None if paths.is_url(model_dir) else model_dir)
    if folder is not None:
      os.makedirs(folder, exist_ok=True)
    try:
      self._run = wandb.init(
          project=config.project, entity=config.entity,
          name=config.name or paths.basename(model_dir.rstrip("/")), group=config.group,
          tags=list(config.tags) or None, mode=config.mode, dir=folder, id=self.run_id,
          resume="allow", config=plain(dict(run_config)))
    except (wandb.errors.UsageError, wandb.errors.CommError, wandb.errors.AuthenticationError
            ) as e:  # no API key, no network, a project one may not write to
      raise ConfigError(f"W&B refused the run: {str(e).strip().splitlines()[0]} (run `wandb "
                        "login`, set WANDB_API_KEY, or WandbConfig.mode='offline')") from None
    sent = self._state["sent"]
    self._first = max(int(getattr(self._run, "starting_step", 0) or 0),
                      -1 if sent is None else sent + 1)
    self._last: int | None = None
    if resume_step is not None and self._first > resume_step + 1:
      log(f"t5lite: W&B run {self.run_id} already holds steps up to {self._first - 1}; the "
          f"run resumes at step {resume_step + 1}, so its rows of steps before "
          f"{self._first} are not sent again (W&B keeps the earlier ones)")
    for row in history:
      self.log(row["step"], {k: (float("nan") if v is None else v)  # null: a NaN written
                             for k, v in row.items() if k != "step"})

  def log(self, step: int, values: Mapping[str, float]) -> None:
    """The row at W&B's step `step`, unless the W&B run holds that step already."""
    if step < self._first:
      return
    self._run.log(dict(values), step=step)
    self._last = step

  def summarize(self, figures: Mapping[str, Any]) -> None:
    self._run.summary.update(dict(figures))

  def finish(self, failed: bool = False, preempted: bool = False) -> None:
    """Ends the session; a preempted run is marked so in W&B (it resumes)."""
    if preempted:
      self._run.mark_preempting()
    self._run.finish(exit_code=1 if failed else 0)
    if self._last is not None:  # sent and flushed: a later session starts after it
      self._state["sent"] = max(self._last, self._state["sent"] or -1)
      atomic.write_file(self._path, json.dumps(self._state) + "\n")
