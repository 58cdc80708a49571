"""Faults a training run meets in the wild, end to end (1): SIGKILLs at chosen and random points
(startup, mid-save, right after a commit, retention cleanup, a metrics write), and every kind
of file of a checkpoint step damaged three ways. The faulty runs are compared bitwise with the
tiny uninterrupted reference run of helpers/runs.py. docs/reliability.md says what each outcome
promises.
"""
import collections
import os
import random
import re
import shutil
import signal
import time

import pytest

from helpers import assert_trees_equal, checkpoint_params, tree_digest
from t5lite import cli
from t5lite.runtime import checkpoint_reader
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import integrity
from t5lite.runtime import lease as lease_lib
from t5lite.runtime.checkpoints import CheckpointConfig, CorruptCheckpointError
from helpers.runs import (
    KEEP, NEWEST, PERIOD, PREVIOUS, STEPS, TMP_MARK, assert_same_run_as, committed, console_noise,
    listing, logged_steps, one_error_line, spawn, tmp_folders, train_argv)

# One worker runs the modules that share the session-scoped reliability_reference run
# (helpers/fixtures.py): built once, not once per pytest-xdist worker (`--dist loadgroup`).
pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.xdist_group("reliability_reference")]


@pytest.fixture(scope="module")
def gin_file(reliability_gin_file):
  return reliability_gin_file


@pytest.fixture(scope="module")
def reference(reliability_reference):
  return reliability_reference


@pytest.fixture(scope="module")
def saved(reliability_saved):
  return reliability_saved


# --- 1. SIGKILLs at chosen and random points -------------------------------------------------

# Each kill but the first costs a whole startup (imports, restore, the compilation cache), so
# the kills are aimed at the moments that matter, one restart each, in this order:
#  'startup'  a random delay from the spawn, at the latest once step 1 is logged: imports,
#             restore, the lease, compiling (random, and cheap: before the first checkpoint);
#  'save'     the first save in flight (step PERIOD being written, nothing committed yet);
#  'seal'     a step just committed by orbax, its seal (checksum list) not written yet;
#  'save2'    the second save of a run in flight, one step committed meanwhile (retention
#             deletes the oldest as this one commits);
#  'step'     a random point in the steps (a metrics row is written every step).
# Two moments a poll cannot aim at are made by hand as a kill leaves them: the oldest step
# half deleted by retention's rmtree, and a metrics row torn by a kill mid-write.
# test_bucket_runs.py kills a run on a bucket at the same kinds of moment.
PLAN = ["startup", "save", "seal", "save2", "step"]
KILLS = len(PLAN)
MAX_STEPS_PER_ATTEMPT = 7  # a killed attempt trains this many steps at most


def _kill_when(process, log_path, ckpts, mode, rng, limit):
  """Waits for `mode`'s moment (or for the run to log step `limit`), SIGKILLs the process;
  returns, as the kill went out, the checkpoints folder's names, the saves in flight and
  whether the run had started training."""
  deadline = time.monotonic() + 180
  fire_at = time.monotonic() + rng.uniform(0.2, 6.0) if mode == "startup" else None
  saves_wanted, saves_seen = (2 if mode == "save2" else 1), set()
  at_start = set(committed(listing(ckpts)))
  while True:
    if process.poll() is not None:
      pytest.fail(f"the run ended by itself (exit {process.returncode}) before its "
                  f"{mode!r} kill:\n{log_path.read_text()[-4000:]}")
    assert time.monotonic() < deadline, f"no {mode!r} moment within 180 s"
    names = listing(ckpts)
    steps = logged_steps(log_path.read_text())
    if steps and max(steps) >= limit:
      break  # the moment did not come (a quick save, a fast machine): kill now
    if mode == "startup":
      if time.monotonic() >= fire_at:
        break
    elif steps:
      if mode in ("save", "save2"):
        saves_seen.update(n for n in names if TMP_MARK in n)
        if len(saves_seen) >= saves_wanted:
          time.sleep(rng.uniform(0, 0.02))
          break
      elif mode == "seal":  # a commit already sealed when seen: wait for the next one
        fresh = set(committed(names)) - at_start
        if fresh and not integrity.is_sealed(str(ckpts / str(max(fresh)))):
          break
      elif mode == "step":
        fire_at = fire_at or time.monotonic() + rng.uniform(0, 1.5)
        if time.monotonic() >= fire_at:
          break
    time.sleep(0.002)
  names, saving = listing(ckpts), tmp_folders(ckpts)
  process.send_signal(signal.SIGKILL)
  assert process.wait() == -signal.SIGKILL
  return names, saving, bool(steps)


def _half_delete_the_oldest_step(ckpts, rng) -> bool:
  """What a kill in the middle of orbax's retention cleanup (an rmtree of the oldest step)
  leaves: a millisecond window that a poll cannot aim at, so made by hand."""
  steps = committed(listing(ckpts))
  if len(steps) < 2:
    return False
  oldest = ckpts / str(steps[0])
  files = sorted(os.path.join(r, f) for r, _, names in os.walk(oldest) for f in names)
  for path in rng.sample(files, len(files) // 2):
    os.remove(path)
  return True


def _tear_a_metrics_row(model_dir, log_text) -> bool:
  """What a kill in the middle of a metrics.jsonl write leaves: the next step's row cut short
  (a microsecond window, so made by hand, unless the kill itself tore one)."""
  steps, metrics = logged_steps(log_text), model_dir / "metrics.jsonl"
  if not steps or not metrics.exists():
    return False
  text = metrics.read_text()
  if text and not text.endswith("\n"):
    return True
  with open(metrics, "a") as f:
    f.write(f'{{"step": {max(steps) + 1}, "lo')
  return True


def test_sigkills_at_chosen_and_random_points_then_the_run_equals_the_uninterrupted_one(
    gin_file, reference, tmp_path):
  """SIGKILLs of `t5lite train` on one MODEL_DIR (KEEP=2, a save every 2 steps, so saves,
  seals and retention deletions are always under way) at the moments of PLAN, each followed
  by a restart that resumes from the newest committed step; the last run finishes. Params and
  metrics.jsonl end as the uninterrupted run's, bitwise, each step logged once."""
  rng = random.Random(20240611)
  model_dir = tmp_path / "run"
  ckpts = model_dir / "checkpoints"
  landed = collections.Counter()
  logs = []
  for attempt, mode in enumerate(PLAN):
    latest = (committed(listing(ckpts)) or [0])[-1]
    if mode == "step":  # the last kill: two steps are committed by now
      landed["oldest step half deleted"] += _half_delete_the_oldest_step(ckpts, rng)
    log_path = tmp_path / f"attempt{attempt:02d}.log"
    logs.append(log_path)
    left_over = tmp_folders(ckpts)  # a killed save's folder, removed as the restart starts
    process = spawn(gin_file, model_dir, log_path)
    limit = min(latest + MAX_STEPS_PER_ATTEMPT, STEPS - 1)  # the last step is the final run's
    if mode == "startup":
      limit = PERIOD - 1
    names, saving, trained = _kill_when(process, log_path, ckpts, mode, rng, limit)
    landed[mode] += 1
    newest = committed(names)[-1] if committed(names) else None
    if saving and (trained or saving - left_over):  # (left-overs are gone once it trains)
      landed["a save in flight"] += 1
      if mode == "save" and not committed(names):
        landed["the first save in flight"] += 1
      if mode == "save2" and newest and newest > latest:
        landed["a second save in flight"] += 1
    if len(committed(names)) > KEEP:
      landed["retention cleanup pending"] += 1
    if newest and not integrity.is_sealed(str(ckpts / str(newest))):
      landed["newest step committed, not sealed"] += 1
    out = log_path.read_text()
    resumed = re.findall(r"t5lite: resuming from step (\d+)", out)
    if resumed:  # each restart resumes from the newest step committed when it started
      assert int(resumed[0]) == latest, out
    if logged_steps(out):
      assert logged_steps(out)[0] == latest + 1, out
    if mode == "step":
      landed["metrics row torn"] += _tear_a_metrics_row(model_dir, out)
  final_log = tmp_path / "final.log"
  logs.append(final_log)
  process = spawn(gin_file, model_dir, final_log)
  assert process.wait(timeout=300) == 0, final_log.read_text()
  summary = dict(landed)
  print("where the kills landed:", summary)
  assert sum(landed[m] for m in set(PLAN)) == KILLS == 5, summary
  assert landed["a save in flight"] >= 2, summary
  assert landed["the first save in flight"] == landed["a second save in flight"] == 1, summary
  assert landed["newest step committed, not sealed"] >= 1, summary
  assert landed["oldest step half deleted"] == landed["metrics row torn"] == 1, summary
  for log_path in logs:
    text = log_path.read_text()
    assert "Traceback" not in text and "t5lite: warning" not in text, text
  assert not (model_dir / integrity.LOG_FILE).exists()  # no damage was ever found
  # Nothing moved aside, no temporary folder left, the retention policy applied.
  assert sorted(listing(ckpts)) == [str(PREVIOUS), str(NEWEST)], summary
  assert not (model_dir / lease_lib.LEASE_FILE).exists()
  _, params, step = checkpoint_params(model_dir)
  _, expected, _ = checkpoint_params(reference)
  assert step == STEPS
  assert_trees_equal(params, expected)
  assert_same_run_as(model_dir, reference)


# --- 2. damage to every kind of file of a step ----------------------------------------------

# Every file of a step folder (orbax 0.12, OCDBT) is one of these; '*' stands for a hash name
# (the largest such file is damaged).
FILE_KINDS = [
    "_CHECKPOINT_METADATA", "commit_success.txt", "t5lite_checksums.json",
    "data/metadata", "data/commit_success.txt",
    "state/_METADATA", "state/_sharding", "state/manifest.ocdbt", "state/commit_success.txt",
    "state/array_metadatas/*", "state/d/*",
    "state/ocdbt.process_0/manifest.ocdbt", "state/ocdbt.process_0/d/*",
]
DAMAGES = ["flip", "truncate", "delete"]


def _kind(rel: str) -> str:
  folder = rel.rpartition("/")[0]
  return f"{folder}/*" if folder.endswith(("/d", "/array_metadatas")) else rel


def _file_of_kind(step_dir, kind) -> str:
  files = [os.path.relpath(os.path.join(r, f), step_dir)
           for r, _, names in os.walk(step_dir) for f in names]
  matching = [rel for rel in files if _kind(rel) == kind]
  assert matching, f"no {kind} in {step_dir}: {sorted(files)}"
  return max(matching, key=lambda rel: (os.path.getsize(os.path.join(step_dir, rel)), rel))


def damage(path, how) -> None:
  if how == "flip":  # one bit, mid-file
    with open(path, "r+b") as f:
      data = bytearray(f.read())
      data[len(data) // 2] ^= 0x10
      f.seek(0)
      f.write(data)
  elif how == "truncate":
    os.truncate(path, os.path.getsize(path) // 2)
  else:
    os.remove(path)


def test_the_damage_matrix_covers_every_file_of_a_step(reference):
  step_dir = reference / "checkpoints" / str(NEWEST)
  kinds = {_kind(os.path.relpath(os.path.join(r, f), step_dir))
           for r, _, names in os.walk(step_dir) for f in names}
  assert kinds == set(FILE_KINDS)


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_damage_is_detected_and_moved_aside_or_harmless(kind, how, reference, saved, tmp_path,
                                                        capfd):
  """A damaged file of the newest step: restore_params (eval, infer, export) refuses naming
  the step and moves nothing, and resuming falls back to the previous step, moving the damaged
  one to <step>.corrupt-1 with one warning line; or both read the undamaged values. Never
  other values."""
  trainer, states = saved
  copy = tmp_path / "run"
  shutil.copytree(reference, copy, ignore=shutil.ignore_patterns("tensorboard"))
  step_dir = copy / "checkpoints" / str(NEWEST)
  rel = _file_of_kind(step_dir, kind)
  damage(step_dir / rel, how)
  before = tree_digest(copy / "checkpoints")
  capfd.readouterr()

  try:  # the read-only path
    params, step = checkpoint_reader.restore_params(copy, trainer.abstract_params)
    refused = None
  except CorruptCheckpointError as e:
    refused = str(e)
  err = capfd.readouterr().err
  assert "Traceback" not in err
  assert tree_digest(copy / "checkpoints") == before  # a read never moves or writes
  if refused:
    assert f"checkpoint step {NEWEST}" in refused
  else:
    assert step == NEWEST
    assert_trees_equal(params, states[NEWEST][0].params)

  checkpointer = ckpt_lib.Checkpointer(copy, CheckpointConfig(period=PERIOD, keep=KEEP))
  state, data_state, step = checkpointer.restore_latest(trainer.abstract_state)
  checkpointer.close()
  err = capfd.readouterr().err
  warnings = [line for line in err.splitlines() if line.startswith("t5lite: warning:")]
  assert "Traceback" not in err
  # Only a deleted checksum list is harmless (the step reads as never sealed); every other
  # damage is detected.
  harmless = kind == integrity.CHECKSUMS_FILE and how == "delete"
  assert step == (NEWEST if harmless else PREVIOUS), (kind, how, refused)
  assert_trees_equal(state, states[step][0])  # whichever step: its exact values
  assert data_state == states[step][1]
  if step == NEWEST:  # harmless: the undamaged values, nothing moved
    assert refused is None
    assert sorted(listing(copy / "checkpoints")) == [str(PREVIOUS), str(NEWEST)]
    assert integrity.verify(str(step_dir), NEWEST)  # (re)sealed once read whole
    assert not any("moved to" in w for w in warnings), err
  else:  # detected: one line naming the step, moved aside, the previous step restored
    assert refused is not None  # both paths see the same damage
    assert len(warnings) == 1, err
    assert warnings[0].startswith(f"t5lite: warning: checkpoint step {NEWEST}")
    assert (f"moved to checkpoints/{NEWEST}.corrupt-1, falling back to step {PREVIOUS}"
            in warnings[0])
    assert sorted(listing(copy / "checkpoints")) == [str(PREVIOUS), f"{NEWEST}.corrupt-1"]
    assert f"checkpoint step {NEWEST}" in (copy / integrity.LOG_FILE).read_text()


def test_a_damaged_checkpoint_metadata_file_adds_nothing_to_the_console(reference, saved,
                                                                        tmp_path, capfd):
  """The damage matrix checks the one t5lite warning line; here, that nothing else reaches the
  console either (orbax's own error logs belong in t5lite.log)."""
  trainer, _ = saved
  copy = tmp_path / "run"
  shutil.copytree(reference, copy, ignore=shutil.ignore_patterns("tensorboard"))
  damage(copy / "checkpoints" / str(NEWEST) / "_CHECKPOINT_METADATA", "truncate")
  capfd.readouterr()
  with pytest.raises(CorruptCheckpointError):
    checkpoint_reader.restore_params(copy, trainer.abstract_params)
  checkpointer = ckpt_lib.Checkpointer(copy)
  assert checkpointer.restore_latest(trainer.abstract_state)[2] == PREVIOUS
  checkpointer.close()
  err = capfd.readouterr().err
  assert len([line for line in err.splitlines() if line.startswith("t5lite: warning")]) == 1
  assert not console_noise(err), err  # orbax's own error about the file stays off the console


def test_cli_resume_from_a_damaged_step_falls_back_and_repairs_bitwise(gin_file, reference,
                                                                        tmp_path, capfd):
  copy = tmp_path / "run"
  shutil.copytree(reference, copy)
  damage(copy / "checkpoints" / str(NEWEST) / "state" / "_sharding", "truncate")
  capfd.readouterr()
  assert cli.main(train_argv(gin_file, copy)) == 0
  out, err = capfd.readouterr()
  warnings = [line for line in err.splitlines() if line.startswith("t5lite: warning:")]
  assert len(warnings) == 1 and "state/_sharding" in warnings[0], err
  assert f"resuming from step {PREVIOUS}" in out
  assert sorted(listing(copy / "checkpoints")) == [str(PREVIOUS), str(NEWEST),
                                                   f"{NEWEST}.corrupt-1"]
  _, params, step = checkpoint_params(copy)
  _, expected, _ = checkpoint_params(reference)
  assert step == NEWEST
  assert_trees_equal(params, expected)
  assert_same_run_as(copy, reference)


def test_cli_export_of_a_damaged_step_exits_2_in_one_line(reference, tmp_path, capfd):
  copy = tmp_path / "run"
  shutil.copytree(reference, copy, ignore=shutil.ignore_patterns("tensorboard"))
  damage(copy / "checkpoints" / str(NEWEST) / "state" / "ocdbt.process_0" / "manifest.ocdbt",
         "delete")
  before = tree_digest(copy)
  capfd.readouterr()
  assert cli.main(["export", "hf", "--checkpoint", str(copy), "--out",
                   str(tmp_path / "hf")]) == 2
  line = one_error_line(capfd.readouterr().err, "t5lite export")
  assert (f"checkpoint step {NEWEST} in {copy}/checkpoints/{NEWEST}: "
          "state/ocdbt.process_0/manifest.ocdbt") in line
  assert line.endswith("is missing")
  assert tree_digest(copy) == before
  assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_cli_on_corrupt_stop_exits_2_and_changes_nothing(gin_file, reference, tmp_path, capfd):
  copy = tmp_path / "run"
  # (The reference's own t5lite.log, when orbax had something to say, is left behind.)
  shutil.copytree(reference, copy, ignore=shutil.ignore_patterns("tensorboard",
                                                                 integrity.LOG_FILE))
  damage(copy / "checkpoints" / str(NEWEST) / "data" / "metadata", "flip")
  before = tree_digest(copy)
  capfd.readouterr()
  assert cli.main(train_argv(gin_file, copy, "--gin.TRAIN_STEPS=40",
                             "--gin.CheckpointConfig.on_corrupt='stop'")) == 2
  line = one_error_line(capfd.readouterr().err, "t5lite train")
  assert f"checkpoint step {NEWEST}: data/metadata (the data iterator state)" in line
  assert "on_corrupt='stop'" in line
  # Details in t5lite.log are the one thing written; nothing else changed or moved.
  assert {k: v for k, v in tree_digest(copy).items() if k != integrity.LOG_FILE} == before
