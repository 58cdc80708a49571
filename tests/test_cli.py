"""The t5lite command line: help, honest 'not available yet' verbs, errors, the smoke run."""
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from t5lite import cli

VERBS = ["launch"]  # not available yet


def test_help_lists_every_verb(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for verb in VERBS + ["export", "import", "train", "eval", "infer", "smoke", "tasks", "cache", "bench", "plot"]:
    assert verb in out


@pytest.mark.parametrize("verb", VERBS)
def test_pending_verbs_say_so_and_fail(verb, capsys):
  argv = [verb, "--gin_file=gin/models/tiny.gin"] if verb in cli.GIN_VERBS else [verb]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert f"t5lite {verb}: not available yet" in err and "Nothing was run" in err


@pytest.mark.parametrize("verb,formats", [("export", ("hf", "params", "serving")),
                                          ("import", ("hf", "t5x"))])
def test_export_and_import_list_their_formats(verb, formats, capsys):
  assert cli.main([verb]) == 2
  err = capsys.readouterr().err
  assert all(f"  {name} " in err for name in formats)
  assert cli.main([verb, "--help"]) == 0
  out = capsys.readouterr().out
  assert all(f"  {name} " in out for name in formats)


def test_bench_verbs_reach_their_benchmarks(capsys):
  for what in ("data", "train", "decode"):
    with pytest.raises(SystemExit) as exit_info:
      cli.main(["bench", what, "--help"])
    assert exit_info.value.code == 0
    assert "--repeats" in capsys.readouterr().out


def test_plot_writes_a_png(tmp_path, capsys):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n')
  assert cli.main(["plot", str(tmp_path)]) == 0
  assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gin_errors_exit_2_with_the_file(capsys):
  assert cli.main(["train", "--gin_file=gin/models/tyni.gin"]) == 2
  assert "gin/models/tiny.gin" in capsys.readouterr().err
  assert cli.main(["export", "--gin.X=1"]) == 2
  assert "takes no gin flags" in capsys.readouterr().err


def test_smoke_run_lowers_the_loss_in_a_subprocess():
  """`t5lite smoke`, run as a user would (console script, compilation cache on)."""
  exe = os.path.join(os.path.dirname(sys.executable), "t5lite")
  result = subprocess.run(
      [exe, "smoke", "--gin_file=gin/models/tiny.gin", "--steps=12", "--length=32"],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "tokens of embedded text" in result.stdout
  match = re.search(r"first \d+ steps ([\d.]+), of the last \d+ ([\d.]+)", result.stdout)
  first, last = float(match.group(1)), float(match.group(2))
  assert last < first - 1.0
