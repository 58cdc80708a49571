"""Distillation (TrainConfig.distillation = @DistillationConfig()): a student learns from a
frozen teacher.

The teacher's config is read first (the loss needs its shapes: Distillation.wrap checks that
it fits the student), then its params are loaded once, sharded by the run's rules and cast to
DistillationConfig.teacher_dtype: the step's fixed_params (t5lite.train.recipes.teacher).
MODEL_DIR/distillation.json names the teacher: a resumed run with another is refused.
"""
from __future__ import annotations

from t5lite.families.distillation import Distillation, DistillationConfig
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.train.recipes import teacher as teacher_lib
from t5lite.train.recipes.base import Recipe
from t5lite.train.recipes.registry import register


@register
class DistillationRecipe(Recipe):
  """The student's family with the teacher's loss terms; see the module docstring."""

  name = "distillation"
  field = "distillation"
  options_type = DistillationConfig
  hints = {"peft": "distil into a plain student, then adapt it (or adapt, merge with `t5lite "
                   "export hf --merge`, then distil)"}

  def prepare(self, family, *, mesh, rules):
    self.teacher, teacher_config, host = teacher_lib.read(self.options)
    family = Distillation.wrap(family, self.options, teacher_config)
    self.fixed_params = teacher_lib.load(self.teacher, teacher_config, host, mesh, rules)
    self.teacher_record = teacher_lib.record(self.options, teacher_config, self.fixed_params)
    return family

  def check(self, model_dir, vocabulary) -> None:
    """The teacher MODEL_DIR's run learns from."""
    teacher_lib.check_record(model_dir, self.teacher_record)
    model_dir_lib.check_vocabulary(self.teacher.home, vocabulary, "the teacher")

  def record(self, model_dir) -> None:
    teacher_lib.write_record(model_dir, self.teacher_record)
