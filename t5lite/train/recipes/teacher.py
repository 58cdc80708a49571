"""A distillation run's teacher (t5lite.families.distillation): its config, its params placed
on the mesh, and the record MODEL_DIR keeps of it.

The trainer reads the teacher's config first (the recipe's loss needs its shapes), loads its
params once, sharded by the run's partitioning rules and cast to DistillationConfig's
teacher_dtype, and passes them to every step beside the train state. MODEL_DIR/
distillation.json names the teacher (path, config, a fingerprint of its params): a resumed run
whose teacher differs is refused, since the student would learn from another model.
"""
from __future__ import annotations

import functools
import json
from typing import Any

from t5lite.errors import ConfigError
from t5lite.families.distillation import DistillationConfig
from t5lite.models.config import ModelConfig
from t5lite.runtime import model_dir
from t5lite.interop import frozen_model
from t5lite.util import paths

Tree = Any
RECORD_FILE = "distillation.json"


Teacher = frozen_model.Located
locate = functools.partial(frozen_model.locate, role="teacher")
load = frozen_model.load
fingerprint = frozen_model.fingerprint


def read(options: DistillationConfig) -> tuple[Teacher, ModelConfig, Tree | None]:
  """(where, config, host params or None) of DistillationConfig's teacher, in its
  teacher_dtype when set (t5lite.interop.frozen_model.read)."""
  return frozen_model.read(options.teacher, options.teacher_dtype, "teacher")


def record(options: DistillationConfig, config: ModelConfig, params: Tree) -> dict:
  """What MODEL_DIR/distillation.json holds about the teacher."""
  return {"teacher": paths.absolute(options.teacher),
          "teacher_config": config.to_dict(), "teacher_fingerprint": fingerprint(params)}


def check_record(directory: str, teacher: dict) -> None:
  """Refuses a run whose teacher differs from the one MODEL_DIR/distillation.json names
  (a resumed run must learn from the teacher it started with)."""
  path = paths.join(directory, RECORD_FILE)
  if not paths.isfile(path):
    return
  saved = json.loads(paths.read_text(path))
  if isinstance(saved.get("teacher_config"), dict):
    # As a ModelConfig reads it today: a record written before a field moved into a
    # sub-config (ELECTRA's, SpanBERT's) names the same teacher in the old keys.
    saved["teacher_config"] = ModelConfig.from_dict(saved["teacher_config"]).to_dict()
  changed = [k for k in ("teacher_config", "teacher_fingerprint") if saved.get(k) != teacher[k]]
  if changed:
    raise ConfigError(f"MODEL_DIR {directory} was distilled from another teacher "
                      f"({saved.get('teacher')}; {' and '.join(changed)} differ): resume with "
                      "that teacher, or use a new MODEL_DIR")


def write_record(directory: str, teacher: dict) -> None:
  model_dir.write_json(paths.join(directory, RECORD_FILE), teacher)
