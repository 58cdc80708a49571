"""The shipped gin model files (test_gin parametrizes over them; test_landmark_configs checks
its families are among them)."""
from t5lite.cli import gin_config

MODEL_FILES = [f for f in gin_config.shipped_gin_files() if f.startswith("gin/models/")]
