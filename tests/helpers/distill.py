"""Distillation helpers shared by test_distillation and test_moe: a float64 log-softmax, a
teacher MODEL_DIR written from a config, a student family wrapped around a teacher."""
import numpy as np

from t5lite.families import family_of
from t5lite.families.distillation import Distillation
from t5lite.interop import params_only
from t5lite.train.recipes import teacher as teacher_lib


def log_softmax(x):
  x = x.astype(np.float64)
  return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def write_teacher(path, config, seed=0):
  params = family_of(config).init_params(seed)
  params_only.write_model_dir(str(path), config, params, step=0, vocabulary=None)
  return params


def wrap(student_config, options):
  return Distillation.wrap(family_of(student_config), options, teacher_lib.read(options)[1])
