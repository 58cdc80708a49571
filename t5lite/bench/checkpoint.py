"""`t5lite bench checkpoint`: what checksums cost a checkpoint, against orbax alone; and a
bucket against the local disk.

The state is a real training state of a T5 v1.1 preset (params and the default optimizer's
state, as `t5lite train` saves it). Side by side, `--repeats` times:
  save     orbax writes the step (synchronously, until committed)   [the peer]
  seal     t5lite reads the committed files back and writes their CRC32C list
  read     orbax restores the step onto this process's devices       [the peer]
  verify   t5lite checks every file of the step against that list
  async    an async save: the part the training loop waits for (the arrays copied to host;
           once the write has committed, the seal) against the whole save (on s3://, until
           its upload, in a thread of its own, has ended); overlap = 1 - wait / whole is what
           steps can hide
Reported: the medians, and ratio_save = (save + seal) / save, ratio_restore = (verify +
read) / read: 1.05 means checksums add 5% to a save or a restore. Files are read back from
the page cache right after the save, as in a run (a cold restore reads them from disk twice:
verify, then orbax). The CRC32C implementation (google-crc32c: 'c' is the hardware one) and
the CPU are printed with the figures.

With `--dir gs://BUCKET/PATH` (or s3://) the same is measured on the bucket and on a local
temp folder, side by side, with each one's save and restore throughput (MB/s of the step's
files) and the ratios bucket / local. On s3:// orbax writes and reads a local mirror
(t5lite/runtime/checkpoint_mirror.py): there `save` includes the upload after the seal, and
`read` the download before the verify.

  t5lite bench checkpoint                         # the 'bench' preset (d_model 256, 4+4)
  t5lite bench checkpoint --model t5_1_1_small --repeats 5
  t5lite bench checkpoint --dir gs://BUCKET/bench  # bucket vs local disk
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time

from t5lite.bench import machine
from t5lite.bench.machine import cpu_model


def _cpu_model() -> str:
  return cpu_model() or platform.processor() or "unknown"


def training_state(model: str):
  import jax

  from t5lite.bench.train import model_config
  from t5lite.families import family_of
  from t5lite.train.optimizers import OptimizerConfig, make_optimizer
  from t5lite.train.train_state import TrainState
  family = family_of(model_config(model))
  optimizer = make_optimizer(OptimizerConfig(), family.param_logical_axes())
  return jax.jit(lambda rng: TrainState.create(family.init_params(rng), optimizer))(
      jax.random.key(0))


def measure(model: str, repeats: int, directory: str, state=None) -> dict:
  import google_crc32c
  import jax

  from t5lite.runtime import checkpoints, integrity
  from t5lite.util import paths
  state = state if state is not None else training_state(model)
  abstract = jax.eval_shape(lambda: state)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  times: dict[str, list[float]] = {"save": [], "seal": [], "read": [], "verify": [],
                                   "async_wait": [], "async_whole": []}
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
    disk_bytes = sum(paths.size(paths.join(step_dir, rel)) for rel in paths.files_under(step_dir))
    reader = checkpointer
    if checkpointer._mirror is not None:  # s3://: the save ends with the upload, a restore
      start = time.perf_counter()         # starts with the download
      checkpointer._publish()
      times["save"][-1] += time.perf_counter() - start
      reader = checkpoints.Checkpointer(directory, read_only=True)
    start = time.perf_counter()
    reader.fetch(step)
    download = time.perf_counter() - start
    start = time.perf_counter()
    integrity.verify(step_dir if reader is checkpointer else reader.step_dir(step), step)
    times["verify"].append(time.perf_counter() - start)
    start = time.perf_counter()
    restored, _ = reader._read(step, abstract)
    jax.block_until_ready(restored)
    times["read"].append(time.perf_counter() - start + download)
    if reader is not checkpointer:
      reader.close()
    checkpointer.close()
    del restored
    checkpointer = checkpoints.Checkpointer(directory, checkpoints.CheckpointConfig(keep=1))
    start = time.perf_counter()
    checkpointer.save(repeats + step, state, {})  # async: returns once the arrays are copied
    waited = time.perf_counter() - start
    checkpointer._manager.wait_until_finished()  # the background write, which steps hide
    after_commit = time.perf_counter()
    checkpointer.seal_committed()  # the seal, in the training thread (on s3://: the upload
    sealed = time.perf_counter()   # starts in a thread of its own, which steps hide too)
    checkpointer.wait()
    times["async_wait"].append(waited + sealed - after_commit)
    times["async_whole"].append(time.perf_counter() - start)
    checkpointer.close()
  median = {k: statistics.median(v) for k, v in times.items()}
  return {
      "bench": "checkpoint", "model": model, "state_bytes": nbytes, "repeats": repeats,
      **{f"{k}_s": round(v, 4) for k, v in median.items()},
      "ratio_save": round((median["save"] + median["seal"]) / median["save"], 4),
      "ratio_restore": round((median["read"] + median["verify"]) / median["read"], 4),
      "step_disk_bytes": disk_bytes,
      "crc32c_gb_per_s": round(disk_bytes / median["verify"] / 1e9, 2),
      "save_mb_per_s": round(disk_bytes / median["save"] / 1e6, 1),
      "restore_mb_per_s": round(disk_bytes / median["read"] / 1e6, 1),
      "async_overlap": round(1 - median["async_wait"] / median["async_whole"], 3),
      "crc32c_implementation": google_crc32c.implementation,
      "cpu": _cpu_model(), "devices": str(jax.devices()[0].device_kind),
  }


def main(argv: list[str]) -> int:
  from t5lite.bench.train import MODELS
  from t5lite.util import paths
  parser = argparse.ArgumentParser(prog="t5lite bench checkpoint", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="bench", choices=sorted(MODELS))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dir", default=None, help="where to write (default: a temp folder, "
                      "removed after); a gs:// or s3:// URL is measured beside a local temp folder")
  args = parser.parse_args(argv)
  where = {"bucket": args.dir} if args.dir and paths.is_url(args.dir) else {}
  local = args.dir if args.dir and not where else tempfile.mkdtemp(prefix="t5lite_bench_ckpt_")
  where["local"] = local
  results = {}
  try:
    state = training_state(args.model)
    for name, directory in where.items():
      results[name] = measure(args.model, args.repeats, directory, state)
  finally:
    if local != args.dir:
      shutil.rmtree(local, ignore_errors=True)
  for name, result in results.items():
    print(f"{name + ': ' if len(results) > 1 else ''}save {result['save_s']:.3f}s + seal "
          f"{result['seal_s']:.3f}s  (x{result['ratio_save']});  read {result['read_s']:.3f}s "
          f"+ verify {result['verify_s']:.3f}s  (x{result['ratio_restore']});  "
          f"{result['save_mb_per_s']:.0f} / {result['restore_mb_per_s']:.0f} MB/s;  async "
          f"overlap {100 * result['async_overlap']:.0f}%;  state "
          f"{result['state_bytes'] / 1e6:.0f} MB")
  report = dict(results["local"])
  if "bucket" in results:
    bucket, disk = results["bucket"], results["local"]
    report = {"bench": "checkpoint", "model": args.model, "bucket": bucket, "local": disk,
              "bucket_over_local_save": round(bucket["save_s"] / disk["save_s"], 2),
              "bucket_over_local_restore": round(bucket["read_s"] / disk["read_s"], 2)}
  print(json.dumps({**report, "machine": machine.describe()}))
  return 0
