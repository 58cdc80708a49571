"""`t5lite bench checkpoint`: what checksums cost a checkpoint, against orbax alone.

The state is a real training state of a T5 v1.1 preset (params and the default optimizer's
state, as `t5lite train` saves it). Side by side, `--repeats` times:
  save     orbax writes the step (synchronously, until committed)   [the peer]
  seal     t5lite reads the committed files back and writes their CRC32C list
  read     orbax restores the step onto this process's devices       [the peer]
  verify   t5lite checks every file of the step against that list
Reported: the medians, and ratio_save = (save + seal) / save, ratio_restore = (verify +
read) / read: 1.05 means checksums add 5% to a save or a restore. Files are read back from
the page cache right after the save, as in a run (a cold restore reads them from disk twice:
verify, then orbax). The CRC32C implementation (google-crc32c: 'c' is the hardware one) and
the CPU are printed with the figures.

  t5lite bench checkpoint                         # the 'bench' preset (d_model 256, 4+4)
  t5lite bench checkpoint --model t5_1_1_small --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

from t5lite.bench import machine
from t5lite.bench.machine import cpu_model


def _cpu_model() -> str:
  return cpu_model() or platform.processor() or "unknown"


def measure(model: str, repeats: int, directory: str) -> dict:
  import google_crc32c
  import jax

  from t5lite.bench.train import model_config
  from t5lite.families import family_of
  from t5lite.runtime import checkpoints, integrity
  from t5lite.train.optimizers import OptimizerConfig, make_optimizer
  from t5lite.train.train_state import TrainState
  family = family_of(model_config(model))
  optimizer = make_optimizer(OptimizerConfig(), family.param_logical_axes())
  state = jax.jit(lambda rng: TrainState.create(family.init_params(rng), optimizer))(
      jax.random.key(0))
  abstract = jax.eval_shape(lambda: state)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  times: dict[str, list[float]] = {"save": [], "seal": [], "read": [], "verify": []}
  for step in range(1, repeats + 1):
    checkpointer = checkpoints.Checkpointer(directory, checkpoints.CheckpointConfig(
        async_save=False, keep=1))
    start = time.perf_counter()
    checkpointer._manager.save(step, args=checkpoints.ocp.args.Composite(  # orbax alone
        state=checkpoints.ocp.args.StandardSave(state),
        data=checkpoints.ocp.args.JsonSave({})), force=True)
    checkpointer._manager.wait_until_finished()
    times["save"].append(time.perf_counter() - start)
    step_dir = checkpointer.step_dir(step)
    start = time.perf_counter()
    integrity.seal(step_dir)
    times["seal"].append(time.perf_counter() - start)
    disk_bytes = sum(os.path.getsize(os.path.join(root, f))
                     for root, _, names in os.walk(step_dir) for f in names)
    start = time.perf_counter()
    integrity.verify(step_dir, step)
    times["verify"].append(time.perf_counter() - start)
    start = time.perf_counter()
    restored, _ = checkpointer._read(step, abstract)
    jax.block_until_ready(restored)
    times["read"].append(time.perf_counter() - start)
    checkpointer.close()
    del restored
  median = {k: statistics.median(v) for k, v in times.items()}
  return {
      "bench": "checkpoint", "model": model, "state_bytes": nbytes, "repeats": repeats,
      **{f"{k}_s": round(v, 4) for k, v in median.items()},
      "ratio_save": round((median["save"] + median["seal"]) / median["save"], 4),
      "ratio_restore": round((median["read"] + median["verify"]) / median["read"], 4),
      "step_disk_bytes": disk_bytes,
      "crc32c_gb_per_s": round(disk_bytes / median["verify"] / 1e9, 2),
      "crc32c_implementation": google_crc32c.implementation,
      "cpu": _cpu_model(), "devices": str(jax.devices()[0].device_kind),
  }


def main(argv: list[str]) -> int:
  from t5lite.bench.train import MODELS
  parser = argparse.ArgumentParser(prog="t5lite bench checkpoint", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="bench", choices=sorted(MODELS))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dir", default=None, help="where to write (default: a temp folder, "
                      "removed after)")
  args = parser.parse_args(argv)
  directory = args.dir or tempfile.mkdtemp(prefix="t5lite_bench_ckpt_")
  try:
    result = measure(args.model, args.repeats, directory)
  finally:
    if args.dir is None:
      shutil.rmtree(directory, ignore_errors=True)
  print(f"save {result['save_s']:.3f}s + seal {result['seal_s']:.3f}s  (x{result['ratio_save']})"
        f";  read {result['read_s']:.3f}s + verify {result['verify_s']:.3f}s  "
        f"(x{result['ratio_restore']});  state {result['state_bytes'] / 1e6:.0f} MB")
  print(json.dumps({**result, "machine": machine.describe()}))
  return 0
