"""Setup mistakes exit 2 with one error line; bugs exit 1 with their traceback."""
import subprocess
import sys

import pytest

from helpers.paths import REPO
from t5lite import cli
from t5lite.data import describe
from t5lite.errors import ConfigError, ConfigFileNotFoundError, ConfigKeyError
from t5lite.cli.gin_config import GinConfigError


def _error_line(capsys, *, lines: int = 1) -> str:
  """The error message on stderr: no traceback, `lines` lines (gin's own messages take more)."""
  err = capsys.readouterr().err
  assert "Traceback" not in err
  assert err.count("\n") == lines, err
  return err.strip()


def test_config_errors_stay_value_key_and_file_errors():
  assert issubclass(GinConfigError, ConfigError) and issubclass(ConfigError, ValueError)
  assert issubclass(ConfigKeyError, KeyError) and issubclass(ConfigFileNotFoundError, OSError)
  assert str(ConfigKeyError("unknown task 'x'")) == "unknown task 'x'"  # KeyError would quote it


def test_an_unknown_task_exits_2_naming_the_near_ones(capsys):
  assert cli.main(["tasks", "show", "stdlib_sumary"]) == 2
  line = _error_line(capsys)
  assert line.startswith("t5lite tasks: error: unknown task or mixture 'stdlib_sumary'")
  assert "stdlib_docstring_summary" in line.split("closest:")[1]


def test_a_bad_gin_binding_exits_2_with_a_suggestion(capsys):
  assert cli.main(["train", "--gin_file=gin/runs/demo.gin", "--gin.ModelConfig.d_modle=8"]) == 2
  message = _error_line(capsys, lines=4)  # gin quotes the binding and suggests the field
  assert message.startswith("t5lite train: error: bad gin binding --gin.ModelConfig.d_modle=8")
  assert "Did you mean: d_model" in message.splitlines()[-1]  # the closest field first


def test_a_missing_model_dir_exits_2(tmp_path, capsys):
  assert cli.main(["export", "params", "--checkpoint", str(tmp_path / "none"),
                   "--out", str(tmp_path / "out")]) == 2
  assert "is not in a t5lite MODEL_DIR" in _error_line(capsys)


def test_plot_of_a_folder_without_metrics_exits_2(tmp_path, capsys):
  assert cli.main(["plot", str(tmp_path)]) == 2
  assert _error_line(capsys).startswith("t5lite plot: error: no metrics.jsonl in")


@pytest.mark.parametrize("bug", [ValueError, RuntimeError, KeyError])
def test_a_bug_is_not_taken_for_a_setup_mistake(bug, monkeypatch, capsys):
  """A plain ValueError from deep inside is a bug: main() lets it out, traceback and all."""
  def list_tasks():
    raise bug("an internal invariant broke")
  monkeypatch.setattr(describe, "list_tasks", list_tasks)
  with pytest.raises(bug, match="an internal invariant broke"):
    cli.main(["tasks", "list"])
  assert "error:" not in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.slow
def test_a_bug_in_training_exits_1_with_its_traceback(tmp_path):
  """As a user runs it: the trainer raising a plain ValueError ends in a traceback and exit 1."""
  code = ("import sys\n"
          "from t5lite import cli\n"
          "from t5lite.train import trainer\n"
          "def train(*args, **kwargs):\n"
          "  raise ValueError('a bug, not a setup mistake')\n"
          "trainer.train = train\n"
          f"sys.exit(cli.main(['train', '--gin_file=gin/runs/demo.gin', "
          f"'--gin.MODEL_DIR={tmp_path}']))\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 1, result.stderr[-2000:]
  assert "Traceback" in result.stderr and "in _train" in result.stderr
  assert result.stderr.rstrip().endswith("ValueError: a bug, not a setup mistake")
