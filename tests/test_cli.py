"""The t5lite command line: help, the plain-flag verbs, errors, the smoke run."""
import re

import pytest

from helpers.cli import run_t5lite
from t5lite import cli


def test_help_lists_every_verb(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for verb in ["launch", "export", "import", "train", "eval", "infer", "smoke", "tasks", "cache",
               "bench", "plot"]:
    assert verb in out


def test_the_top_level_help_names_every_export_and_import_format(capsys):
  with pytest.raises(SystemExit):
    cli.main(["--help"])
  out = " ".join(capsys.readouterr().out.split())
  for name in ("(hf", "(params)", "(serving)", "(peft)", "(student)", "(t5x)"):
    assert name in out, name


VERBS = ["train", "eval", "infer", "smoke", "compile", "tasks", "cache", "bench", "plot",
         "export", "import", "launch", "study"]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verbs_help_shows_an_example_command(verb, capsys):
  try:
    code = cli.main([verb, "--help"])
  except SystemExit as exit_info:
    code = exit_info.code
  assert code == 0
  out = capsys.readouterr().out
  assert re.search(rf"^\s*(\$ |echo .*\| )?t5lite {verb} \S", out, re.M), out[-1500:]
  if verb in ("train", "eval", "infer"):
    assert "macros" in out and ("MODEL_DIR" in out or "CHECKPOINT_PATH" in out)


def test_launch_takes_its_own_flags_and_the_launched_verbs_gin_flags(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["launch", "--help"])
  assert exit_info.value.code == 0
  assert "--dry-run" in capsys.readouterr().out
  assert cli.main(["launch", "--dry-run", "--", "--gin_file=gin/runs/demo.gin"]) == 0
  assert "--gin_file=gin/runs/demo.gin" in capsys.readouterr().out


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


@pytest.mark.e2e
@pytest.mark.slow
def test_smoke_run_lowers_the_loss_in_a_subprocess():
  """`t5lite smoke`, run as a user would (console script, compilation cache on)."""
  result = run_t5lite("smoke", "--gin_file=gin/models/tiny.gin", "--steps=12", "--length=32",
                      console=True, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "on the embedded text" in result.stdout and "step 12/12" in result.stdout
  match = re.search(r"first \d+ steps ([\d.]+), of the last \d+ ([\d.]+)", result.stdout)
  first, last = float(match.group(1)), float(match.group(2))
  assert last < first - 1.0
