"""Multi-host training with real local processes (gloo collectives on CPU, fake devices).

One reference run (1 process x 4 devices, 20 steps, a checkpoint every 5; trained in this
process, on 4 of its devices) serves every comparison; the other topologies train the same
tiny model on the same global batch of 8:
  2 processes x 2 devices  started by the SLURM recipe (fake srun / scontrol), SIGTERM to one
                           process: both save one step and exit 42, the recipe requeues; then
                           one process resumes that checkpoint and ends where the reference did
  4 processes x 1 device   started by `t5lite launch --kind=local`, resuming the reference's
                           step-5 checkpoint, and evaluating the validation split (whose rows
                           run out at a different batch on each process) to the same loss,
                           and decoding it (an inference eval) to the same predictions
  a checkpoint round trip  1 process -> restored and saved again by 2 processes -> 1 process:
                           bitwise the same
  bad setups               unreachable coordinator, a missing process, mismatched process
                           counts, a mesh or batch size that does not fit: each exits 2 with
                           its reason, without hanging
Losses agree to float rounding across topologies (the gradient all-reduce sums in another
order); data iterator states agree exactly: the data order does not depend on the topology.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
import yaml

import train_tasks  # noqa: F401 (registers the tasks of the in-process runs)
from helpers import cli as cli_helper
from helpers.paths import REPO
from helpers.runs import train_argv
from helpers import assert_trees_equal, logged_losses, metrics_records
from t5lite import cli
from t5lite.cli import gin_config
from t5lite.errors import ConfigError
from t5lite.launch import PREEMPTED_EXIT_CODE, cluster, commands, distributed, peers
from t5lite.launch import cli as launch_cli
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.runtime import partitioning as part
from t5lite.train import evaluation
from t5lite.train.trainer import Trainer, train

STEPS = 20
TASK = "train_test_sc_scored"  # train_test_sc with a metric (tests/train_tasks.py)
INFER_EVAL = "--gin.TrainConfig.infer_eval_period=10"  # the reference's and 4 x 1's, at 10
# One layer a stack, as helpers.runs' run: every process of every job compiles its programs
# (the step, evals, infer evals) from a cold cache, each unscanned layer anew.
RUN_GIN = f"""
include 'runs/pretrain.gin'
include 'models/tiny.gin'
ModelConfig.vocab_size = 384
ModelConfig.num_encoder_layers = 1
ModelConfig.num_decoder_layers = 1
MIXTURE_OR_TASK_MODULE = 'train_tasks'
MIXTURE_OR_TASK_NAME = '{TASK}'
TASK_FEATURE_LENGTHS = {{'inputs': 32, 'targets': 8}}
BATCH_SIZE = 8
TRAIN_STEPS = {STEPS}
EVAL_PERIOD = 10
TrainConfig.eval_steps = 40
TrainConfig.infer_eval_examples = 8
TrainConfig.log_period = 1
CheckpointConfig.period = 5
CheckpointConfig.keep = None
ScheduleConfig.warmup_steps = 10
ScheduleConfig.value = 0.1
"""
RTOL = 2e-5  # losses across topologies (float summation order)
FAKE_SRUN = """#!/bin/bash
# srun on one machine: SLURM_NTASKS copies of the command, as srun's tasks (its options skipped)
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NODELIST=127.0.0.1 \
    "$@" > "$FAKE_SLURM/task$i.log" 2>&1 &
  echo $! > "$FAKE_SLURM/task$i.pid"
  pids[$i]=$!
done
status=0
for ((i = 0; i < SLURM_NTASKS; i++)); do
  wait ${pids[$i]}; code=$?; echo $code > "$FAKE_SLURM/task$i.rc"
  (( code > status )) && status=$code
done
exit $status
"""
FAKE_SCONTROL = '#!/bin/bash\necho "$@" >> "$FAKE_SLURM/scontrol.log"\n'


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def environment(devices: int, **more) -> dict:
  """This process's environment (so the compilation cache is shared), with `devices` fake CPU
  devices and tests/ importable (MIXTURE_OR_TASK_MODULE = 'train_tasks')."""
  return cli_helper.environment(devices, tests_on_path=True, env=more)


def start(argv: list, devices: int, log, script=None, **env) -> subprocess.Popen:
  """`t5lite ARGV` (or `python SCRIPT ARGV`) with `devices` fake devices, output in log."""
  return cli_helper.run_t5lite(*argv, script=script, wait=False, devices=devices,
                           tests_on_path=True, log=log, env=env)


def job(argv: list, n: int, devices: int, logs, port=None, counts=None, script=None,
        **env) -> list:
  """n processes of one job on this machine; counts: each one's --num_processes."""
  port = port or free_port()
  return [start(argv + [f"--coordinator_address=127.0.0.1:{port}",
                        f"--num_processes={counts[i] if counts else n}", f"--process_id={i}"],
                devices, logs / f"process{i}.log", script=script, **env) for i in range(n)]


def finish(processes: list, logs, timeout: float = 240) -> list[tuple[int, str]]:
  deadline = time.time() + timeout
  codes = []
  for p in processes:
    try:
      codes.append(p.wait(timeout=max(1, deadline - time.time())))
    except subprocess.TimeoutExpired:
      for q in processes:
        q.kill()
      pytest.fail(f"a process was still running after {timeout}s")
  names = sorted(logs.glob("process*.log")) if hasattr(logs, "glob") else logs
  return [(code, open(name).read()) for code, name in zip(codes, names)]


def eval_losses(model_dir, metric="loss") -> dict[int, float]:
  """step -> eval loss (or another eval metric): the validation split runs out at a different
  batch on each process."""
  return {r["step"]: r[f"eval/{TASK}/{metric}"] for r in metrics_records(model_dir)
          if f"eval/{TASK}/{metric}" in r}


def predictions(model_dir, step) -> list[str]:
  with open(os.path.join(model_dir, "inference_eval", f"{TASK}-{step}.jsonl")) as f:
    return [json.loads(line)["prediction"] for line in f]


def data_state(model_dir, step) -> dict:
  with open(os.path.join(model_dir, "checkpoints", str(step), "data", "metadata")) as f:
    return json.load(f)


def assert_losses_match(run, reference, steps):
  np.testing.assert_allclose([run[s] for s in steps], [reference[s] for s in steps], rtol=RTOL)


def keep_checkpoint(source, target, step):
  """A copy of a MODEL_DIR holding only checkpoint `step` (and no metrics)."""
  shutil.copytree(source, target)
  for name in os.listdir(target / "checkpoints"):
    if name != str(step):
      shutil.rmtree(target / "checkpoints" / name)
  os.remove(target / "metrics.jsonl")
  shutil.rmtree(target / "inference_eval", ignore_errors=True)
  return target


def configs(gin_file, model_dir, **bindings):
  """(model config, train config) of the run gin file, parsed in this process."""
  extra = [f"MODEL_DIR='{model_dir}'"] + [f"{k}={v}" for k, v in bindings.items()]
  gin_config.parse([str(gin_file)], extra)
  return gin_config.model_config(), gin_config.train_config()


def four_device_mesh():
  return part.make_mesh(part.MeshConfig(data=4), jax.devices()[:4])


# --- the runs -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gin_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("gin") / "run.gin"
  path.write_text(RUN_GIN)
  return path


@pytest.fixture(scope="module")
def reference(gin_file, tmp_path_factory):
  """1 process x 4 devices, checkpoints 5, 10, 15, 20: the trajectory to reproduce. Trained
  here (as the 2-process checkpoint is resumed below): one process needs no process of its
  own, and its programs are then compiled in this one."""
  root = tmp_path_factory.mktemp("reference")
  binding, value = INFER_EVAL.removeprefix("--gin.").split("=")
  model_config, config = configs(gin_file, root / "run", **{binding: value})
  train(model_config, config, mesh=four_device_mesh(), log=lambda _: None)
  assert ckpt_lib.Checkpointer(root / "run", read_only=True).all_steps() == [5, 10, 15, 20]
  return root / "run"


@pytest.fixture(scope="module")
def preempted(gin_file, tmp_path_factory):
  """2 processes x 2 devices through recipes/slurm_gpu.sbatch; SIGTERM to process 1 only."""
  root = tmp_path_factory.mktemp("slurm")
  fake = root / "bin"
  fake.mkdir()
  for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
    (fake / name).write_text(text)
    (fake / name).chmod(0o755)
  model_dir = root / "run"
  env = environment(2, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM=str(root),
                    SLURM_JOB_ID="4242", SLURM_NTASKS="2", PYTHON=sys.executable,
                    T5LITE_COORDINATOR_PORT=str(free_port()))
  script = subprocess.Popen(
      ["bash", str(commands.RECIPES / "slurm_gpu.sbatch"), f"--gin_file={gin_file}",
       f"--gin.MODEL_DIR={model_dir}", "--gin.TRAIN_STEPS=1000"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 240
  while not (os.path.exists(model_dir / "metrics.jsonl")
             and max(logged_losses(model_dir), default=0) >= 2):
    if script.poll() is not None or time.time() > deadline:
      script.kill()
      logs = [(root / f"task{i}.log").read_text() for i in (0, 1)
              if (root / f"task{i}.log").exists()]
      pytest.fail(f"the SLURM job ended or stalled before step 2: {script.stdout.read()}{logs}")
    time.sleep(0.05)
  os.kill(int((root / "task1.pid").read_text()), signal.SIGTERM)
  out = script.communicate(timeout=180)[0]
  return types.SimpleNamespace(
      code=script.returncode, out=out, model_dir=model_dir,
      task_codes=[int((root / f"task{i}.rc").read_text()) for i in (0, 1)],
      task_logs=[(root / f"task{i}.log").read_text() for i in (0, 1)],
      scontrol=(root / "scontrol.log").read_text() if (root / "scontrol.log").exists() else "")


def saved_step(preempted) -> int:
  lines = [line for line in preempted.task_logs[0].splitlines()
           if "preempted (SIGTERM): saved checkpoint" in line]
  assert len(lines) == 1, preempted.task_logs[0]
  return int(lines[0].split("saved checkpoint ")[1].split(";")[0])


# --- 2 processes x 2 devices, SIGTERM, the SLURM recipe --------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_to_one_process_saves_one_step_everywhere_and_requeues(preempted):
  assert preempted.task_codes == [PREEMPTED_EXIT_CODE] * 2, preempted.task_logs
  assert preempted.code == PREEMPTED_EXIT_CODE, preempted.out
  assert preempted.scontrol.split() == ["requeue", "4242"]
  step = saved_step(preempted)
  # A step folder is committed only when every process has written its shards.
  assert ckpt_lib.Checkpointer(preempted.model_dir, read_only=True).latest_step() == step
  assert max(logged_losses(preempted.model_dir)) == step  # all stopped right after it
  assert "2 processes, 4 devices (2 per process) via SLURM srun step" in preempted.task_logs[0]
  assert "step 1/1000" not in preempted.task_logs[1]  # only process 0 prints progress


@pytest.mark.e2e
@pytest.mark.slow
def test_two_processes_give_the_one_process_losses(reference, preempted):
  step = saved_step(preempted)
  assert 3 <= step < STEPS
  assert_losses_match(logged_losses(preempted.model_dir), logged_losses(reference),
                      range(1, step + 1))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_in_one_process(reference, preempted, gin_file,
                                                         tmp_path):
  step = saved_step(preempted)
  model_dir = shutil.copytree(preempted.model_dir, tmp_path / "resumed")
  model_config, config = configs(gin_file, model_dir)
  result = train(model_config, config, mesh=four_device_mesh(), log=lambda _: None)
  assert sorted(result.losses) == list(range(step + 1, STEPS + 1))
  assert_losses_match(result.losses, logged_losses(reference), range(step + 1, STEPS + 1))
  np.testing.assert_allclose(result.eval_metrics[f"eval/{TASK}/loss"],
                             eval_losses(reference)[STEPS], rtol=RTOL)
  # The iterator went on from the 2-process state: at the end it is exactly the reference's.
  assert data_state(model_dir, STEPS) == data_state(reference, STEPS)


# --- 4 processes x 1 device, through `t5lite launch --kind=local` ----------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_four_processes_continue_a_one_process_checkpoint(reference, gin_file, tmp_path):
  model_dir = keep_checkpoint(reference, tmp_path / "run", step=5)
  launch = cli_helper.run_t5lite(
      "launch", "--kind=local", "--num_hosts=4", "--devices_per_host=1", f"--port={free_port()}",
      f"--python={sys.executable}", "--", "train", f"--gin_file={gin_file}",
      f"--gin.MODEL_DIR={model_dir}", "--gin.TRAIN_STEPS=10", INFER_EVAL,
      devices=1, tests_on_path=True, timeout=300)
  assert launch.returncode == 0, launch.stdout + launch.stderr
  assert "4 processes, 4 devices (1 per process)" in launch.stderr
  assert sorted(logged_losses(model_dir)) == list(range(6, 11))
  assert_losses_match(logged_losses(model_dir), logged_losses(reference), range(6, 11))
  # Four processes evaluate the whole validation split, as one did.
  np.testing.assert_allclose(eval_losses(model_dir)[10], eval_losses(reference)[10], rtol=RTOL)
  assert data_state(model_dir, 10) == data_state(reference, 10)
  # Decoded by 4 processes (the outputs sharded over all their devices), as by one.
  assert predictions(model_dir, 10) == predictions(reference, 10)
  assert len(predictions(model_dir, 10)) == 8
  assert (eval_losses(model_dir, "sequence_accuracy")[10]
          == eval_losses(reference, "sequence_accuracy")[10])


# --- checkpoints across process counts, bitwise ----------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_a_checkpoint_round_trip_through_two_processes_is_exact(reference, gin_file, tmp_path):
  target = tmp_path / "saved_by_two"
  processes = job([gin_file, reference, target], 2, 2, tmp_path,
                  script=REPO / "tests" / "multihost_checkpoint.py")
  for code, out in finish(processes, tmp_path):
    assert code == 0, out
  model_config, config = configs(gin_file, tmp_path / "unused")
  trainer = Trainer(model_config, config, mesh=four_device_mesh())
  states = []
  for model_dir in (reference, target):
    checkpointer = ckpt_lib.Checkpointer(model_dir, read_only=True)
    states.append(checkpointer.restore(STEPS, trainer.abstract_state))
    checkpointer.close()
  (ours, our_data), (theirs, their_data) = states
  assert int(theirs.step) == STEPS and their_data == our_data
  assert_trees_equal(ours, theirs)


def test_processes_fall_back_together_when_one_cannot_read_a_checkpoint(tmp_path, monkeypatch):
  """Each process reads its own shards: when another process cannot read step 2 (simulated
  in the all-gather of the flags), this one, which can, falls back to step 1 with it."""
  mesh = four_device_mesh()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  abstract = {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=sharding)}
  saver = ckpt_lib.Checkpointer(tmp_path, ckpt_lib.CheckpointConfig(async_save=False))
  for step in (1, 2):
    saver.save(step, {"w": jax.device_put(np.full(4, step, np.float32), sharding)},
               {"step": step})
  saver.close()
  gathered = []

  def all_gather(failed):  # this process read fine; process 1 fails on step 2 only
    gathered.append(failed)
    return [failed, len(gathered) == 1]
  monkeypatch.setattr(ckpt_lib, "all_flags", all_gather)
  checkpointer = ckpt_lib.Checkpointer(tmp_path, read_only=True)
  state, data, step = checkpointer.restore_latest(abstract)
  assert (step, data, gathered) == (1, {"step": 1}, [False, False])
  np.testing.assert_array_equal(state["w"], np.ones(4))
  checkpointer.close()
  gathered.clear()
  stop = ckpt_lib.Checkpointer(tmp_path, ckpt_lib.CheckpointConfig(on_corrupt="stop"),
                               read_only=True)
  with pytest.raises(ckpt_lib.CorruptCheckpointError,
                     match=r"step 2 .* cannot be restored by process\(es\) \[1\]"):
    stop.restore_latest(abstract)
  stop.close()


# --- evals with several processes ------------------------------------------------------------

def fake_processes(monkeypatch, others: list[bool]):
  """This process is process 0 of 2; the all-gather answers process 1's flags from `others`."""
  from jax.experimental import multihost_utils
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x, tiled=False: np.stack([np.asarray(x), [others.pop(0)]]))


def test_loss_evals_feed_blank_batches_or_skip_the_task_on_every_process(monkeypatch):
  batch = {"decoder_target_tokens": np.ones((2, 4), np.int32)}
  # Process 1 has 3 batches, this one 1: two blank batches follow, shaped like the first.
  fake_processes(monkeypatch, [True, True, True, False])
  out = list(evaluation.same_count_of_batches(iter([batch]), steps=10))
  assert len(out) == 3 and out[0] is batch
  assert all(b["decoder_target_tokens"].shape == (2, 4) and not b["decoder_target_tokens"].any()
             for b in out[1:])
  # This process has no batch at all: nothing to shape a blank by, so no process evaluates
  # (process 1 sees the same flags), instead of this one feeding None.
  fake_processes(monkeypatch, [True])
  assert list(evaluation.same_count_of_batches(iter([]), steps=10)) == []


# --- bad setups fail fast --------------------------------------------------------------------

@pytest.fixture(scope="module")
def bad_setups(gin_file, tmp_path_factory):
  """Every bad setup at once (they wait more than they compute): name -> [(code, output)]."""
  root = tmp_path_factory.mktemp("bad")
  argv = train_argv(gin_file, root / "run")
  setups = {  # name: (processes, devices each, extra flags, --num_processes of each)
      "unreachable": (1, 1, ["--initialization_timeout=3"], None),
      "missing_process": (1, 1, ["--initialization_timeout=3"], None),
      "counts": (2, 1, [], [2, 3]),
      "mesh": (2, 2, ["--gin.MeshConfig.data=3"], None),
      "batch": (2, 2, ["--gin.BATCH_SIZE=6"], None),
  }
  started, running = time.time(), {}
  for name, (n, devices, flags, counts) in setups.items():
    (root / name).mkdir()
    if name == "unreachable":  # process 1 of 2, and nobody at the coordinator's port
      running[name] = [start(argv + flags + [f"--coordinator_address=127.0.0.1:{free_port()}",
                                             "--num_processes=2", "--process_id=1"],
                             devices, root / name / "process0.log")]
    elif name == "missing_process":  # process 0 of 2; process 1 never comes
      running[name] = [start(argv + flags + [f"--coordinator_address=127.0.0.1:{free_port()}",
                                             "--num_processes=2", "--process_id=0"],
                             devices, root / name / "process0.log")]
    else:
      running[name] = job(argv + flags, n, devices, root / name, counts=counts)
  results = {name: finish(processes, root / name, timeout=120)
             for name, processes in running.items()}
  results["seconds"] = time.time() - started
  return results


@pytest.mark.e2e
@pytest.mark.slow
def test_an_unreachable_coordinator_is_named_within_the_timeout(bad_setups):
  [(code, out)] = bad_setups["unreachable"]
  assert code == 2, out
  assert "could not reach the coordinator at 127.0.0.1:" in out
  assert bad_setups["seconds"] < 100


@pytest.mark.e2e
@pytest.mark.slow
def test_a_missing_process_ends_the_wait(bad_setups):
  [(code, out)] = bad_setups["missing_process"]
  assert code == 2, out
  assert "the job did not form within 3s" in out and "not every one of the 2 processes" in out


@pytest.mark.e2e
@pytest.mark.slow
def test_mismatched_process_counts_stop_every_process(bad_setups):
  for code, out in bad_setups["counts"]:
    assert code == 2, out
    assert "give every process the same --num_processes" in out
  assert "process 1 was started with --num_processes=3, process 0 with 2" in \
      bad_setups["counts"][0][1]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_mesh_that_does_not_fit_the_devices_stops_every_process(bad_setups):
  for code, out in bad_setups["mesh"]:
    assert code == 2, out
    assert "mesh (3, 1, 1, 1) needs 3 devices, the 2 processes have 4" in out


@pytest.mark.e2e
@pytest.mark.slow
def test_a_batch_that_does_not_split_evenly_names_both_numbers(bad_setups):
  for code, out in bad_setups["batch"]:
    assert code == 2, out
    assert "global batch size 6 does not divide evenly over the 4 batch shards" in out
    assert "BATCH_SIZE=4 or 8" in out


def test_a_model_dir_that_is_not_shared_stops_every_process(tmp_path, monkeypatch):
  """Process 0 writes a token file in MODEL_DIR; a process that does not see it (simulated:
  process 1's flag in the all-gather) makes every process stop with the same error. Every
  multi-process run above passes this check for real."""
  from jax.experimental import multihost_utils
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: x)
  monkeypatch.setattr(multihost_utils, "sync_global_devices", lambda name: None)
  seen = []

  def all_gather(flags, tiled=False):
    seen.append(int(np.asarray(flags)[0]))
    return np.array([flags, [0]])
  monkeypatch.setattr(multihost_utils, "process_allgather", all_gather)
  model_dir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"MODEL_DIR .*/run is not shared: process\(es\) \[1\] "
                     r"do not see the file process 0 wrote there .* FUSE mount .*gs://BUCKET/run"):
    model_dir_lib.check_shared(model_dir, patience=0)
  assert seen == [1]  # this process (0) saw its own file
  assert os.listdir(model_dir) == []  # and removed it


def test_a_model_dir_url_of_another_scheme_than_a_bucket_is_refused_before_anything_runs(capsys):
  assert cli.main(["train", "--gin_file=gin/runs/demo.gin", "--gin.MODEL_DIR=http://host/run"]) == 2
  err = capsys.readouterr().err
  assert ("MODEL_DIR='http://host/run': t5lite reads and writes gs://BUCKET/PATH and "
          "s3://BUCKET/PATH URLs and local folders (or mounts), not this scheme") in err


# --- a lost process -------------------------------------------------------------------------

HEARTBEAT = 10  # seconds: --heartbeat_timeout of these jobs (the survivor waits it out)


def lose_a_process(processes, victim, logs, model_dir, committed_past):
  """Waits until the job has committed a checkpoint past step `committed_past` and logged a
  step after that checkpoint (it is training on), SIGKILLs process `victim`, and checks the
  survivor's one line and exit 43; returns the newest committed step."""
  deadline = time.time() + 240
  while True:
    newest = ckpt_lib.Checkpointer(model_dir, read_only=True).latest_step() or 0
    if (newest > committed_past and (model_dir / "metrics.jsonl").exists()
        and max(logged_losses(model_dir), default=0) > newest):
      break
    if time.time() > deadline or any(p.poll() is not None for p in processes):
      for p in processes:
        p.kill()
      pytest.fail(f"the job ended or stalled before a committed checkpoint past step "
                  f"{committed_past} and a step after it")
    time.sleep(0.1)
  processes[victim].kill()
  killed = time.time()
  survivor = processes[1 - victim]
  code = survivor.wait(timeout=HEARTBEAT + 60)
  seconds = time.time() - killed
  log = (logs / f"process{1 - victim}.log").read_text()
  assert code == peers.LOST_PROCESS_EXIT_CODE, log[-3000:]
  assert seconds < HEARTBEAT + 3 * peers.POLL_SECONDS + 5, seconds
  errors = [line for line in log.splitlines() if "error" in line.lower()]
  assert errors == [f"t5lite: error: process {victim} of 2 stopped (killed, crashed, out of "
                    f"memory, or its host lost): process {1 - victim} stops too (exit 43). "
                    "Rerun every process of the job: training resumes from the newest "
                    "checkpoint"], errors
  assert "Traceback" not in log and "Check failure" not in log and "SIGABRT" not in log
  processes[victim].wait()
  return ckpt_lib.Checkpointer(model_dir, read_only=True).latest_step()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_lost_process_ends_the_other_in_one_line_and_the_rerun_resumes(gin_file, tmp_path):
  """SIGKILL to one process of two mid-training: the other exits 43 with one t5lite line
  naming it, within the heartbeat timeout (and some seconds), never by JAX's abort; process 0
  included, whose host runs the coordination service. A rerun on the same port resumes.

  One chain of jobs covers both victims: process 1 is lost in the first job, process 0 in
  the rerun (once it has resumed and committed a checkpoint of its own), and a second rerun
  resumes from that one and finishes."""
  model_dir, port = tmp_path / "run", free_port()
  # No evals: the last step would otherwise compile and run one, which nothing here reads.
  argv = train_argv(gin_file, model_dir, "--gin.EVAL_PERIOD=0",
                    f"--heartbeat_timeout={HEARTBEAT}")
  (tmp_path / "first").mkdir()
  processes = job(argv + ["--gin.TRAIN_STEPS=1000"], 2, 2, tmp_path / "first", port=port)
  newest = lose_a_process(processes, 1, tmp_path / "first", model_dir, committed_past=0)
  (tmp_path / "rerun").mkdir()
  processes = job(argv + ["--gin.TRAIN_STEPS=1000"], 2, 2, tmp_path / "rerun", port=port)
  newer = lose_a_process(processes, 0, tmp_path / "rerun", model_dir,
                         committed_past=newest)
  assert f"resuming from step {newest}" in (tmp_path / "rerun" / "process0.log").read_text()
  # Past every step logged so far (the lost jobs logged steps after their newest checkpoint).
  last = max(logged_losses(model_dir)) + 2
  (tmp_path / "again").mkdir()
  rerun = job(argv + [f"--gin.TRAIN_STEPS={last}"], 2, 2, tmp_path / "again", port=port)
  for code, out in finish(rerun, tmp_path / "again"):
    assert code == 0, out[-3000:]
  assert f"resuming from step {newer}" in (tmp_path / "again" / "process0.log").read_text()
  assert max(logged_losses(model_dir)) == last


def test_a_coordinator_port_another_program_listens_on_is_refused_not_joined():
  """Process 0 starts the job's coordination service on the port: a listener already there
  (another job's service, say) would take this job's processes in."""
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = str(listener.getsockname()[1])
    with pytest.raises(ConfigError, match=f"the coordinator port {port} is in use on this host"):
      peers.start_service(f"127.0.0.1:{port}", 2, 10)
  with pytest.raises(distributed.DistributedSetupError, match="--heartbeat_timeout must be at "
                     "least 1 second, got 0.5"):
    distributed.initialize(cluster.Cluster("flags", "127.0.0.1:1", 2, 1), timeout=1,
                           log=lambda _: None, heartbeat_timeout=0.5)


# --- cluster detection (pure functions of the environment) ----------------------------------

@pytest.mark.parametrize("env,expected", [
    ({"TPU_WORKER_HOSTNAMES": "t1w0,t1w1,t1w2,t1w3", "TPU_WORKER_ID": "2"},
     ("tpu", "t1w0:8482", 4, 2)),
    ({"TPU_PROCESS_ADDRESSES": "10.0.0.5:8471,10.0.0.6:8471", "TPU_WORKER_ID": "1",
      "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
      "MEGASCALE_COORDINATOR_ADDRESS": "slice0-w0:8080"}, ("tpu", "slice0-w0:8482", 4, 3)),
    ({"JOBSET_NAME": "t5", "JOBSET_REPLICATED_JOB": "workers", "JOBSET_REPLICAS": "2",
      "JOBSET_JOB_INDEX": "1", "JOBSET_PODS_PER_JOB": "4", "JOB_COMPLETION_INDEX": "3",
      "KUBERNETES_SERVICE_HOST": "10.0.0.1"}, ("jobset", "t5-workers-0-0.t5:8476", 8, 7)),
    ({"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[007-008,012],cpu1",
      "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "0"},
     ("slurm", "gpu007:61586", 4, 3)),
    ({"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "node1,node2", "SLURM_NTASKS": "2",
      "SLURM_PROCID": "0", "T5LITE_COORDINATOR_PORT": "1234"}, ("slurm", "node1:1234", 2, 0)),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1",
      "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"},
     ("openmpi", "10.96.0.1:62624", 4, 1)),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, ("openmpi", None, 2, 0)),
    # mpirun inside a SLURM allocation: the ranks inherit the per-node daemons' SLURM task
    # variables (2 tasks), but there are 8 ranks.
    ({"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2",
      "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_RANK": "5",
      "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"},
     ("openmpi", "10.96.0.1:62624", 8, 5)),
])
def test_cluster_environments_are_detected(env, expected):
  found = cluster.detect(env)
  assert (found.kind, found.coordinator_address, found.num_processes,
          found.process_id) == expected


def test_no_cluster_means_one_process_and_says_so(capsys):
  # A Kubernetes pod without JobSet variables, or a SLURM batch script outside srun: nothing.
  for env in ({}, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"},
              {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}):
    assert cluster.detect(env) is None
    assert distributed.resolve(None, None, None, env, tpu_vm=False) is None
  assert cluster.detect({}, tpu_vm=True).kind == "tpu_vm"
  distributed.initialize(None)
  assert "t5lite: single process (no --coordinator_address" in capsys.readouterr().err


def test_flags_win_over_the_environment_and_incomplete_jobs_are_refused():
  mpi5 = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
  found = distributed.resolve("10.0.0.1:1234", None, None, mpi5, tpu_vm=False)
  assert (found.kind, found.coordinator_address, found.num_processes, found.process_id) == (
      "openmpi", "10.0.0.1:1234", 2, 1)
  with pytest.raises(distributed.DistributedSetupError, match="needs --coordinator_address"):
    distributed.resolve(None, None, None, mpi5, tpu_vm=False)
  with pytest.raises(distributed.DistributedSetupError, match="needs --process_id"):
    distributed.resolve("h:1", 2, None, {}, tpu_vm=False)
  with pytest.raises(distributed.DistributedSetupError, match="process id 2 is not in 0..1"):
    distributed.resolve("h:1", 2, 2, {}, tpu_vm=False)
  with pytest.raises(distributed.DistributedSetupError, match="is not HOST:PORT"):
    distributed.resolve("h", 2, 0, {}, tpu_vm=False)
  # --num_processes=1 is a single process, whatever the environment says.
  slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "0"}
  assert distributed.resolve(None, 1, None, slurm, tpu_vm=False) is None
  with pytest.raises(cluster.ClusterEnvError, match="JOBSET_PODS_PER_JOB"):
    cluster.detect({"JOBSET_NAME": "t5", "JOB_COMPLETION_INDEX": "0"})


def test_a_tpu_vm_is_told_apart_from_a_gce_vm_by_its_pci_device_ids(tmp_path):
  def machine(name, devices):  # a fake /sys/bus/pci/devices
    for i, (vendor, device) in enumerate(devices):
      folder = tmp_path / name / f"0000:00:0{i}.0"
      folder.mkdir(parents=True)
      (folder / "vendor").write_text(vendor + "\n")
      (folder / "device").write_text(device + "\n")
    return str(tmp_path / name)
  gvnic, tpu_v4 = ("0x1ae0", "0x0042"), ("0x1ae0", "0x005e")
  assert not cluster.tpu_chips_present(machine("gce_vm", [("0x8086", "0x1237"), gvnic]))
  assert cluster.tpu_chips_present(machine("tpu_vm", [gvnic, tpu_v4, tpu_v4]))
  assert not cluster.tpu_chips_present(str(tmp_path / "no_such_folder"))


def test_jax_runs_no_cluster_detection_of_its_own_once_the_job_is_known(monkeypatch):
  """Under srun or mpirun JAX's detection would pin each process to one GPU
  (local_device_ids=[SLURM_LOCALID]); only a Cloud TPU VM leaves the job to JAX."""
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
  monkeypatch.setattr(jax.config, "update", lambda *a: None)
  monkeypatch.setattr(distributed, "_check_agreement", lambda deadline, expected: None)
  monkeypatch.setattr(peers, "start_service", lambda *args: False)  # no service process here
  slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
  distributed.initialize(distributed.resolve(None, None, None, slurm, tpu_vm=False), timeout=5,
                         log=lambda _: None)
  distributed.initialize(cluster.Cluster("tpu_vm", None, None, None), timeout=5,
                         log=lambda _: None)
  assert calls == [(("gpu07:61586", 2, 0), {"initialization_timeout": 35,
                                            "heartbeat_timeout_seconds": 60,
                                            "cluster_detection_method": "deactivate"}),
                   ((None, None, None), {"initialization_timeout": 35,
                                         "heartbeat_timeout_seconds": 60})]


def test_process_counts_are_compared_even_without_jax_private_client(monkeypatch):
  """A JAX whose coordination client is not where t5lite reads it: an all-gather compares."""
  from jax._src import distributed as jax_distributed
  from jax.experimental import multihost_utils
  jax.devices()  # the backends read global_state when made: make them first (order-proof)
  monkeypatch.setattr(jax_distributed, "global_state", types.SimpleNamespace())
  counts = {"agree": [[2], [2]], "differ": [[2], [3]]}
  monkeypatch.setattr(multihost_utils, "process_allgather",
                      lambda x, tiled=False: np.array(counts[case]))
  case = "agree"
  distributed._check_agreement(time.monotonic() + 1, 2)
  case = "differ"
  with pytest.raises(distributed.DistributedSetupError,
                     match="process 1 was started with --num_processes=3, process 0 with 2"):
    distributed._check_agreement(time.monotonic() + 1, 2)


@pytest.mark.parametrize("others_arrive", [True, False])
def test_a_process_leaving_on_a_setup_error_waits_for_the_others(monkeypatch, others_arrive):
  """leave_job: a barrier, then an orderly shutdown only when every process reached it (the
  multi-process bad-setup runs above exit 2 through it; before it, about 1 in 30 of their
  processes was aborted by JAX when process 0 left first)."""
  calls = []

  class Client:
    def wait_at_barrier(self, name, milliseconds):
      calls.append(("barrier", name, milliseconds))
      if not others_arrive:
        raise RuntimeError("DEADLINE_EXCEEDED: barrier timed out")

  monkeypatch.setattr(distributed, "_coordination_client", lambda: (1, 2, Client()))
  monkeypatch.setattr(jax.distributed, "shutdown", lambda: calls.append(("shutdown",)))
  distributed.leave_job()
  barrier = ("barrier", "t5lite/exit_on_setup_error", distributed.EXIT_BARRIER_SECONDS * 1000)
  assert calls == ([barrier, ("shutdown",)] if others_arrive else [barrier])
  calls.clear()
  monkeypatch.setattr(distributed, "_coordination_client", lambda: None)
  distributed.leave_job()  # one process: nothing to wait for
  assert calls == []


def test_a_process_id_out_of_range_is_refused_before_any_waiting(capsys):
  assert cli.main(["train", "--gin_file=gin/runs/demo.gin", "--gin.MODEL_DIR=/tmp/unused",
                   "--coordinator_address=127.0.0.1:1", "--num_processes=2",
                   "--process_id=5"]) == 2
  assert "process id 5 is not in 0..1" in capsys.readouterr().err


# --- batch slices and sizes ------------------------------------------------------------------

def test_each_process_feeds_the_rows_its_devices_hold():
  assert part.slice_of_process({0: {0, 1}, 1: {2, 3}}, 4, 1) == (1, 2)
  assert part.slice_of_process({0: {0}, 1: {1}, 2: {2}, 3: {3}}, 4, 2) == (2, 4)
  # tensor=2 spanning both processes: both hold batch shards 0 and 1, and feed the same rows.
  assert part.slice_of_process({0: {0, 1}, 1: {0, 1}}, 2, 1) == (0, 1)
  with pytest.raises(ValueError, match="contiguous run"):
    part.slice_of_process({0: {0, 2}, 1: {1, 3}}, 4, 0)
  assert part.process_batch_slice(four_device_mesh()) == (0, 1)


def test_batch_size_must_divide_over_the_batch_shards():
  mesh = part.make_mesh(part.MeshConfig(data=2, fsdp=2), jax.devices()[:4])
  part.check_batch_size(8, mesh)
  with pytest.raises(ValueError, match=r"global batch size 10 does not divide evenly over the "
                     r"4 batch shards of mesh data=2 x fsdp=2 .* BATCH_SIZE=8 or 12"):
    part.check_batch_size(10, mesh)


# --- `t5lite launch` and the recipes -----------------------------------------------------------

def test_launch_dry_run_without_flags_is_a_worked_two_host_example(capsys):
  assert cli.main(["launch", "--dry-run"]) == 0
  out = capsys.readouterr().out
  lines = [line for line in out.splitlines() if line.startswith("ssh ")]
  assert len(lines) == 2
  for i, line in enumerate(lines):
    assert line.startswith(f"ssh host{i} ")
    assert "python3 -m t5lite.cli train --gin_file=gin/runs/pretrain.gin" in line
    assert (f"--coordinator_address=host0:8476 --num_processes=2 --process_id={i}" in line)
  assert "2 hosts x 8 devices = 16 devices" in out and "multiple of 16" in out


def test_launch_dry_run_for_each_kind(capsys):
  flags = ["--", "--gin_file=gin/runs/pretrain.gin", "--gin.TASK_FEATURE_LENGTHS={'inputs': 8}"]
  assert cli.main(["launch", "--kind=tpu_vm", "--name=pod", "--num_hosts=4",
                   "--devices_per_host=4", "--dry-run", *flags]) == 0
  out = capsys.readouterr().out
  assert "gcloud compute tpus tpu-vm ssh pod --zone=us-central2-b --worker=all" in out
  assert out.count("python3 -m t5lite.cli train --gin_file=gin/runs/pretrain.gin") == 5
  assert cli.main(["launch", "--kind=slurm", "--num_hosts=3", "--dry-run", *flags]) == 0
  out = capsys.readouterr().out
  assert "sbatch --job-name=t5lite --nodes=3 --ntasks-per-node=1 --gpus-per-node=8 " in out
  assert str(commands.RECIPES / "slurm_gpu.sbatch") in out
  assert cli.main(["launch", "--kind=local", "--num_hosts=2", "--devices_per_host=2",
                   "--port=5555", "--dry-run", *flags]) == 0
  out = capsys.readouterr().out
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=2" in out
  assert "--coordinator_address=127.0.0.1:5555 --num_processes=2 --process_id=1" in out
  with pytest.raises(ValueError, match="sets the multi-host flags itself"):
    launch_cli.main(["--dry-run", "--", "--process_id=0"])


def test_the_jobset_manifest_gives_every_pod_its_place(capsys):
  """The rendered manifest, its pods simulated: the downward-API variables as JobSet sets
  them, then cluster.detect on each pod's environment."""
  topology = commands.Topology(kind="jobset", name="t5", num_hosts=3, devices_per_host=4)
  manifest = yaml.safe_load(commands.jobset_manifest(topology, "train", ["--gin_file=a.gin"]))
  job_spec = manifest["spec"]["replicatedJobs"][0]
  spec = job_spec["template"]["spec"]
  assert spec["parallelism"] == spec["completions"] == 3
  rule = spec["podFailurePolicy"]["rules"][0]
  assert rule["onExitCodes"]["values"] == [PREEMPTED_EXIT_CODE] and rule["action"] == "FailJob"
  assert manifest["spec"]["failurePolicy"]["rules"][0]["onJobFailureReasons"] == [
      "PodFailurePolicy"]
  container = spec["template"]["spec"]["containers"][0]
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
  assert "python3 -m t5lite.cli train --gin_file=a.gin" in container["args"][0]
  labels = {"jobset.sigs.k8s.io/jobset-name": "t5",
            "jobset.sigs.k8s.io/replicatedjob-name": job_spec["name"],
            "jobset.sigs.k8s.io/replicatedjob-replicas": str(job_spec["replicas"]),
            "jobset.sigs.k8s.io/job-index": "0"}
  places = []
  for pod in range(3):
    env = {"JOB_COMPLETION_INDEX": str(pod)}
    for var in container["env"]:
      if "value" in var:
        env[var["name"]] = var["value"]
      else:
        label = var["valueFrom"]["fieldRef"]["fieldPath"].split("'")[1]
        env[var["name"]] = labels[label]
    found = cluster.detect(env)
    places.append((found.kind, found.coordinator_address, found.num_processes, found.process_id))
  assert places == [("jobset", "t5-workers-0-0.t5:8476", 3, i) for i in range(3)]


def test_the_tpu_vm_script_runs_one_command_on_every_worker(tmp_path):
  fake = tmp_path / "gcloud"
  # Call n (from 0) writes its arguments one a line into argv<n>.
  fake.write_text(f'#!/bin/bash\nn=$(( $(cat {tmp_path}/calls 2>/dev/null | wc -l) ))\n'
                  f'echo >> {tmp_path}/calls\nprintf "%s\\n" "$@" > {tmp_path}/argv$n\n')
  fake.chmod(0o755)
  env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
         "TPU_NAME": "my-v4-32", "ZONE": "us-central2-b"}
  flags = ["--gin_file=a b.gin", "--gin.MODEL_DIR=/gcs/bucket/run"]
  subprocess.run(["bash", str(commands.RECIPES / "tpu_vm_pod.sh"), *flags], env=env, check=True)
  argv = (tmp_path / "argv0").read_text().splitlines()
  assert argv[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-v4-32"]
  assert "--zone=us-central2-b" in argv and "--worker=all" in argv
  assert argv[-1] == ("--command=cd t5lite && python3 -m t5lite.cli train --gin_file=a\\ b.gin "
                      "--gin.MODEL_DIR=/gcs/bucket/run")
  # GCS_BUCKET: first the bucket is mounted on every worker, where MODEL_DIR then points.
  (tmp_path / "calls").unlink()
  subprocess.run(["bash", str(commands.RECIPES / "tpu_vm_pod.sh"), *flags],
                 env={**env, "GCS_BUCKET": "bucket"}, check=True)
  mount = (tmp_path / "argv0").read_text().splitlines()
  assert "--worker=all" in mount and mount[-1].startswith("--command=mountpoint -q /gcs/bucket ||")
  assert "gcsfuse --implicit-dirs --rename-dir-limit=100000 bucket /gcs/bucket" in mount[-1]
  assert (tmp_path / "argv1").read_text().splitlines() == argv
  missing = subprocess.run(["bash", str(commands.RECIPES / "tpu_vm_pod.sh")], capture_output=True,
                           text=True, env={**env, "TPU_NAME": ""})
  assert missing.returncode != 0 and "set TPU_NAME" in missing.stderr


def test_the_slurm_recipe_lets_every_task_finish_its_save():
  """srun --kill-on-bad-exit counts exit 42 as a bad exit: the first task to exit would get
  the others killed mid-save. srun's status is then the highest of the tasks' codes, which the
  fake srun of the preemption test reproduces."""
  script = (commands.RECIPES / "slurm_gpu.sbatch").read_text()
  [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
  assert "kill-on-bad-exit" not in srun and "t5lite.cli train" in srun


def test_launch_reports_a_missing_launcher_and_the_worst_exit_code(monkeypatch, capsys):
  monkeypatch.setenv("PATH", "/nonexistent")
  assert cli.main(["launch", "--kind=slurm", "--", "--gin_file=a.gin"]) == 2
  assert "sbatch is not on PATH" in capsys.readouterr().err
  assert launch_cli.worst([0, 0]) == 0
  assert launch_cli.worst([PREEMPTED_EXIT_CODE, 0]) == PREEMPTED_EXIT_CODE
  assert launch_cli.worst([PREEMPTED_EXIT_CODE, 1]) == 1
  assert launch_cli.worst([-signal.SIGKILL, 0]) == 137


def test_the_recipes_are_where_commands_looks():
  """That they ship in the wheel: test_packaging.py (builds one and lists it)."""
  assert {p.name for p in commands.RECIPES.iterdir()} >= {"jobset.yaml", "slurm_gpu.sbatch",
                                                          "tpu_vm_pod.sh"}
