"""Checkpoints of a run: orbax CheckpointManager over MODEL_DIR/checkpoints.

Each checkpoint step holds two items, saved and restored together:
  state  the TrainState (step, params, optimizer state), as sharded arrays
  data   the data iterator's state (JSON: one grain state per global batch row)
so a restart resumes on the exact next batch with the exact params and optimizer state.

    ckpt = Checkpointer(model_dir, CheckpointConfig(period=1000, keep=3, keep_period=10000))
    ckpt.save(step, state, data_state)            # async; at most one save in flight
    state, data_state, step = ckpt.restore_latest(abstract_state)   # or None: nothing saved
    ckpt.close()                                  # waits for the last save to commit

Atomicity: orbax writes a step into a temporary folder and renames it when every file (and
every process) is done, so a step folder that exists is complete: a crash or SIGKILL mid-save
leaves only a temporary folder, which is never listed and is removed on the next start. On a
bucket (MODEL_DIR=gs://...; no folder rename there) orbax writes the step in place and commits
it with a `commit_success.txt` object written last; a step without one is not listed either.
On s3://, which orbax cannot write, it writes a local mirror that is uploaded after each save,
the commit marker last (t5lite/runtime/checkpoint_mirror.py; one process only).

Integrity (t5lite/runtime/integrity.py): once committed, each step is sealed with the CRC32C
of every file in it, and every restore (resume here; eval, infer, export and
INITIAL_CHECKPOINT_PATH through checkpoint_reader.restore_params) verifies them, then checks
that the arrays are finite. A damaged step is named with the file that fails. Resuming, with
`on_corrupt='fallback'` the damaged step is moved aside to checkpoints/<step>.corrupt-N and
the next older one is tried, so the run retrains the lost steps and saves them in its place;
with 'stop' the run stops and nothing is moved. With several processes, process 0 checks
the files, every process reads its own shards, and all of them agree on each step tried, so
they fall back or stop together (restore_latest). Restoring onto another mesh: pass abstract
arrays (jax.ShapeDtypeStruct) that carry the target shardings; orbax reads each shard where it
now belongs.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from t5lite.errors import ConfigError
from t5lite.runtime import checkpoint_mirror, integrity
from t5lite.runtime.checkpoint_config import CheckpointConfig, metric_of, preservation_policy
from t5lite.runtime.integrity import CorruptCheckpointError
from t5lite.runtime.processes import all_flags
from t5lite.util import paths, storage

CHECKPOINTS_DIR = "checkpoints"
Tree = Any
# Orbax splits the saving of a replicated array between its replicas (replica-parallel),
# cutting each shard with a slice program compiled per array shape, replica and offset: for
# 120 replicated arrays on 8 devices about a thousand compiles, 6.9 s of the first save on a
# 2-core EPYC (0.3 s with this). Slices under this size are written by one replica: splitting
# them gains no bandwidth.
MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL = 4 << 20


def _use_replica_parallel_for_large_slices_only() -> None:
  """Orbax's jax.Array handler, with MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL. Orbax takes the
  option only in a handler registered for the type (process-wide): a copy of the registered
  one (its array metadata store and every other setting as orbax made them) with this one
  option set; restoring is unchanged."""
  current = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(current, "_min_slice_bytes_for_replica_parallel", 0) is None:
    handler = copy.copy(current)
    handler._min_slice_bytes_for_replica_parallel = MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL
    with integrity.quiet_orbax():  # (its warning that a handler is replaced: as intended)
      ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


class CheckpointWriteError(ConfigError):
  """The filesystem refused a checkpoint save (full, read-only, over quota): the
  environment's doing, told in one line (exit 2); the committed checkpoints are intact."""


_OS_ERROR_WORDS = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                   "Permission denied", "os_error_code")
"""How TensorStore reports an OS error inside its own exception types (ValueError)."""
def _is_environment_error(error: BaseException) -> bool:
  """An error of the disk or the storage service, not of t5lite's code."""
  return (isinstance(error, OSError) or any(w in str(error) for w in _OS_ERROR_WORDS)
          or storage.is_service_error(error))


def checkpoint_dir(model_dir: str | os.PathLike) -> str:
  return paths.join(paths.absolute(model_dir), CHECKPOINTS_DIR)


class Checkpointer:
  """The run's checkpoints: save (and seal), list, restore (verified, with fallback), close."""

  def __init__(self, model_dir: str | os.PathLike, config: CheckpointConfig = CheckpointConfig(),
               *, read_only: bool = False, lease=None):
    _use_replica_parallel_for_large_slices_only()
    self.config = config
    self.read_only = read_only
    self.lease = lease  # t5lite.runtime.lease.Lease: no save once another run has taken it
    self.directory = checkpoint_dir(model_dir)
    self.model_dir = paths.dirname(self.directory)
    self.is_primary = jax.process_index() == 0
    self._unsealed: list[int] = []  # saved by this run, not sealed yet
    # orbax has no S3 form: on s3:// it writes and reads a local mirror of the bucket's
    # checkpoints (t5lite/runtime/checkpoint_mirror.py), one process's own.
    self._mirror = None
    if self.directory.startswith("s3://"):
      checkpoint_mirror.check_single_process(self.directory, jax.process_count())
      self._mirror = checkpoint_mirror.S3Mirror(self.directory)
      self._mirror.pull(write=not read_only)
    self._orbax_dir = self._mirror.local if self._mirror else self.directory
    # On a bucket a step is committed by an object written last into it (no folder rename
    # there); orbax does so on gs:// by itself.
    atomicity = (dict(atomicity_options=ocp.options.AtomicityOptions(
        mode=ocp.options.AtomicityMode.COMMIT_FILE)) if paths.is_url(self._orbax_dir) else {})
    if not read_only:
      self._remove_unfinished_saves(atomicity)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=preservation_policy(config),
        enable_async_checkpointing=config.async_save,
        cleanup_tmp_directories=False,  # done above, before orbax lists the folder
        read_only=read_only,
        # Not at start: a run refused before its first save leaves no folder behind (save
        # makes it).
        create=False,
        **atomicity,
        # With a best_fn orbax also writes each ranked checkpoint's metrics into its step
        # folder, so the ranking (and which step BestN keeps) survives a restart.
        **(dict(best_fn=metric_of(config.best_metric), best_mode=config.best_mode)
           if config.best_metric else {}),
    )
    with integrity.quiet_orbax(logging.CRITICAL):  # a damaged step's metadata: verify names it
      self._manager = ocp.CheckpointManager(self._orbax_dir, options=options,
                                            item_names=("state", "data"))
    self._in_flight: int | None = None  # the step being saved in the background
    self._seal_error: OSError | None = None  # from seal_committed, raised at the next wait

  def _remove_unfinished_saves(self, atomicity: dict) -> None:
    """Removes what a crash left of a save cut short (a temporary folder; on a bucket a step
    without its commit object), before orbax lists the folder. Not orbax's own
    cleanup_tmp_directories: it removes them in a thread while its constructor lists the
    folder, and on a bucket removing the only step makes the folder vanish between orbax's
    exists() and its listing, a FileNotFoundError that stopped the restart. Process 0
    removes; the others wait for it here, before they list."""
    if self.is_primary:
      for unfinished in ocp.utils.tmp_checkpoints(self._orbax_dir, **atomicity):
        paths.remove_tree(unfinished.get())
    all_flags(False)  # every process, after process 0 is done

  def step_dir(self, step: int) -> str:
    """The folder orbax reads step `step` from (on s3://, its local mirror: see fetch)."""
    return paths.join(self._orbax_dir, str(int(step)))

  def fetch(self, step: int) -> None:
    """On s3://, brings step `step`'s array data into its local mirror before it is read."""
    if self._mirror is not None:
      self._mirror.fetch(int(step))

  def all_steps(self) -> list[int]:
    """Committed steps, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, state: Tree, data_state: dict | None,
           metrics: dict[str, float] | None = None) -> None:
    """Starts saving `state` and `data_state` as checkpoint `step` (async unless configured
    otherwise). Waits first for a previous save still in flight, and seals it. `metrics`
    (holding best_metric, when one is configured) rank the checkpoint for keeping the best."""
    self.wait()
    lost = self.lease.check() if self.lease is not None else None  # process 0 holds it
    if any(all_flags(lost is not None)):
      raise ConfigError(lost or "process 0 lost MODEL_DIR's lease (its output says why); "
                        "this run stops without writing another checkpoint")
    if step in self._manager.all_steps():
      return  # already saved (e.g. the last periodic save was the final step)
    best = self.config.best_metric
    if metrics is not None and (best is None or best not in metrics):
      metrics = None  # orbax ranks every checkpoint that has metrics: only complete ones
    paths.makedirs(self._orbax_dir)
    self._in_flight = int(step)
    with self._write_errors():
      self._manager.save(int(step), args=ocp.args.Composite(
          state=ocp.args.StandardSave(state),
          data=ocp.args.JsonSave(data_state if data_state is not None else {})),
          metrics=metrics, force=True)
    self._unsealed.append(int(step))

  @contextlib.contextmanager
  def _write_errors(self, doing: str | None = None):
    """A save the filesystem refused (full, read-only, no permission, over quota) ends the
    run with one line naming the step (or `doing`) and the OS's words, and the committed
    checkpoints intact (orbax writes into a temporary folder); the details go to the log
    file. Other errors are bugs and keep their traceback."""
    try:
      yield
    except Exception as e:  # orbax and TensorStore wrap OS errors in their own kinds
      causes = [e]
      while causes[-1].__cause__ is not None and len(causes) < 10:
        causes.append(causes[-1].__cause__)
      if not any(_is_environment_error(c) for c in causes):
        raise
      step, self._in_flight = self._in_flight, None
      self._unsealed = [s for s in self._unsealed if s != step]  # never sealed by this run
      doing = doing or f"saving checkpoint step {step} in {self.directory}"
      log_path = integrity.log_details(self.model_dir,
                                       f"{doing} failed:\n{integrity.error_details(e)}")
      try:
        committed = ", ".join(map(str, sorted(s for s in self._manager.all_steps()
                                              if s != step))) or "none"
      except Exception as listing:  # the bucket that failed the save may fail this too
        if not _is_environment_error(listing):
          raise
        committed = "not listed: the storage failed again"
      words = next((w for c in causes for w in _OS_ERROR_WORDS[:-1] if w in str(c)), None)
      reason = integrity.first_line(e, 300)
      on_bucket = paths.is_url(self._orbax_dir) or any(storage.is_service_error(c)
                                                       for c in causes)
      raise CheckpointWriteError(
          f"{doing} failed: "
          + (f"{words} ({reason})" if words and not reason.startswith("[Errno") else reason)
          + "; the committed checkpoints "
          f"({committed}) are intact: "
          + ("check that the bucket is reachable and writable" if on_bucket
             else "free space or fix the folder" + (
                 f" {self._orbax_dir} (the local copy of the s3:// checkpoints)"
                 if self._mirror else ""))
          + ", then rerun the same command to resume"
          + (f" (details in {log_path})" if log_path else "")) from e

  def _seal_committed(self) -> None:
    """Seals what orbax has committed since (_seal_local). A seal that failed (a full disk)
    stops every process here, together: wait() is called by all of them alike."""
    error, self._seal_error = self._seal_error or self._seal_local(), None
    if error is None:
      self._publish()
    if jax.process_count() > 1 and any(all_flags(error is not None)) and error is None:
      raise ConfigError("process 0 could not seal a checkpoint (its output says why)")
    if error is not None:
      raise error

  def _seal_local(self) -> OSError | None:
    """Seals, on process 0, the steps this run saved that orbax has committed: on a disk the
    folders renamed into place; on a bucket those with orbax's commit marker, its last write
    (orbax may call a save that failed in its metadata writes over while its checkpointer's
    thread still commits the step, rewriting _CHECKPOINT_METADATA): one with files but no
    marker yet waits; one that retention removed is skipped."""
    steps, self._unsealed = self._unsealed, []
    on_bucket = paths.is_url(self._orbax_dir)
    try:
      for step in steps if self.is_primary else []:
        step_dir = self.step_dir(step)
        if paths.isfile(paths.join(step_dir, integrity.COMMIT_MARKER)) if on_bucket else (
            paths.isdir(step_dir)):
          if not integrity.is_sealed(step_dir):
            integrity.seal(step_dir)
        elif on_bucket and paths.isdir(step_dir):  # not gone with retention
          self._unsealed.append(step)
    except OSError as e:
      return e
    return None

  def seal_committed(self) -> None:
    """Seals what orbax has committed by now, without waiting for a save in flight and with
    no collective: the loop calls it after every step, so a step is sealed soon after its
    commit rather than at the next save (on s3://, and its upload starts). An error waits
    for the next wait(), but an upload's that has ended is raised here."""
    if self._mirror is not None and self.is_primary:
      with self._write_errors(self._copying):
        self._mirror.raise_failed_upload()
    if self._unsealed and not self._manager.is_saving_in_progress():
      self._seal_error = self._seal_error or self._seal_local()
      if self._seal_error is None:
        self._publish(background=True)

  @property
  def _copying(self) -> str:
    return f"copying checkpoints to {self.directory}"

  def _publish(self, background: bool = False) -> None:
    """On s3://, uploads the steps committed and sealed here, and mirrors retention's
    deletions, in the mirror's upload thread (with `background`, training goes on; else
    waited for). A refused upload ends the run in one line, like a refused save."""
    if self._mirror is None or not self.is_primary or self.read_only:
      return
    lost = self.lease.check() if self.lease is not None else None
    if lost:
      raise ConfigError(lost)
    with self._write_errors(self._copying):
      self._mirror.publish_in_background(self.all_steps())
      if not background:
        self._mirror.finish_publishing()

  def best(self) -> tuple[int, float] | None:
    """(step, value) of the kept checkpoint with the best CheckpointConfig.best_metric, from
    the metrics orbax ranks the checkpoints by; None when none is ranked. Waits for a save in
    flight (its metrics count)."""
    metric = self.config.best_metric
    if metric is None:
      return None
    self.wait()
    ranked = [(step, (self._manager.metrics(step) or {}).get(metric))
              for step in self.all_steps()]
    ranked = [(step, float(value)) for step, value in ranked if value is not None]
    if not ranked:
      return None
    pick = max if self.config.best_mode == "max" else min
    return pick(ranked, key=lambda item: item[1])

  def restore(self, step: int, abstract_state: Tree) -> tuple[Tree, dict]:
    """(state, data_state) of checkpoint `step`, with the shapes, dtypes and shardings of
    `abstract_state` (a tree of jax.ShapeDtypeStruct with .sharding, or of arrays);
    verified against its checksums, and finite."""
    self.fetch(step)
    if self.is_primary:
      integrity.verify(self.step_dir(step), step)
    state, data_state = self._read(step, abstract_state)
    integrity.check_finite(state, step, self.directory)
    return state, data_state

  def _read(self, step: int, abstract_state: Tree) -> tuple[Tree, dict]:
    """Reads this process's shards of checkpoint `step`, with no collective. Not through
    CheckpointManager.restore: it ends in a barrier that a process whose read raised never
    reaches, which would leave the other processes waiting there."""
    handler = ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler(),
                                             data=ocp.JsonCheckpointHandler())
    try:
      restored = handler.restore(epath.Path(self.step_dir(step)),
                                 args=ocp.args.Composite(
                                     state=ocp.args.StandardRestore(abstract_state),
                                     data=ocp.args.JsonRestore()))
    except Exception as e:  # orbax and tensorstore raise many kinds
      raise CorruptCheckpointError(f"checkpoint step {step} cannot be read: "
                                   f"{type(e).__name__}: {integrity.first_line(e)}") from e
    finally:
      handler.close()
    return restored["state"], dict(restored["data"] or {})

  def _try(self, step: int, abstract_state: Tree, noise: list[str]):
    """(read, sealed, error) of one step on this process: process 0 verifies the files
    first (and then reads nothing if they fail), every process reads its shards."""
    sealed = None
    with integrity.captured_noise(noise):
      try:
        self.fetch(step)
        if self.is_primary:
          sealed = integrity.verify(self.step_dir(step), step)
        self._check_structure(step, abstract_state)
        return self._read(step, abstract_state), sealed, None
      except CorruptCheckpointError as e:
        return None, sealed, e

  def _check_structure(self, step: int, abstract_state: Tree) -> None:
    """A state of another structure (e.g. another optimizer) is this run's mismatch, not
    damage: ConfigError, nothing moved. Compared as the multiset of array shapes (orbax's
    tree metadata names nodes its own way); unreadable metadata is damage."""
    try:
      with integrity.quiet_orbax(logging.CRITICAL):
        saved = ocp.PyTreeCheckpointer().metadata(
            paths.join(self.step_dir(step), "state")).item_metadata.tree
    except Exception as e:  # a damaged _METADATA: orbax raises many kinds
      raise CorruptCheckpointError(f"checkpoint step {step}: its array metadata cannot be "
                                   f"read: {integrity.first_line(e)}") from e
    theirs = sorted(tuple(m.shape) for m in jax.tree.leaves(saved))
    ours = sorted(tuple(x.shape) for x in jax.tree.leaves(abstract_state))
    if theirs != ours:
      raise ConfigError(
          f"checkpoint step {step} in {self.directory} holds a training state of another "
          f"structure ({len(theirs)} arrays) than this run's ({len(ours)}): another "
          "optimizer or OptimizerConfig? Resume with the settings the run was started with "
          "(MODEL_DIR/config.gin), or use a new MODEL_DIR")

  def restore_latest(self, abstract_state: Tree) -> tuple[Tree, dict, int] | None:
    """The newest intact checkpoint as (state, data_state, step), or None when there is
    none. A damaged one is moved aside and the next older tried (on_corrupt='fallback', one
    warning line names it, MODEL_DIR/t5lite.log has the details), or CorruptCheckpointError
    is raised and nothing moved ('stop'). No checkpoint is ever deleted.

    With several processes, each reads its own shards, so one may fail where the others
    read fine: they agree on every step tried (one all-gather of a flag), and fall back or
    stop together, so all restore the same step."""
    steps = self.all_steps()
    damaged = []
    for step in reversed(steps):
      noise: list[str] = []
      read, sealed, error = self._try(step, abstract_state, noise)
      failed = [i for i, bad in enumerate(all_flags(error is not None)) if bad]
      if not failed:
        state, data_state = read
        try:  # a collective over the restored arrays: the same answer on every process
          integrity.check_finite(state, step, self.directory)
          if self.is_primary and not sealed and not self.read_only:
            integrity.seal(self.step_dir(step))  # committed by orbax, read whole: trusted
            if self._mirror is not None:
              self._mirror.upload(step, integrity.CHECKSUMS_FILE)
          return state, data_state, step
        except CorruptCheckpointError as e:
          error = e
      elif error is None:
        error = CorruptCheckpointError(
            f"checkpoint step {step} in {self.directory} cannot be restored by process(es) "
            f"{failed} (their output says why)")
      damaged.append(self._give_up_or_fall_back(error, step, steps, noise))
    if steps:
      raise CorruptCheckpointError(
          f"every checkpoint in {self.directory} is damaged ({', '.join(damaged)}); the run "
          "stops rather than start over from step 0: rerun the same command to train from "
          "scratch, or put back a good copy of a step folder")
    return None

  def _give_up_or_fall_back(self, error: CorruptCheckpointError, step: int,
                            steps: list[int], noise: list[str]) -> str:
    """Raises for on_corrupt='stop'; otherwise moves `step` aside, warns in one line and
    returns where it went. The details (tracebacks, orbax's output) go to the log file."""
    where = ""
    if self.is_primary:
      log_path = integrity.log_details(self.model_dir, "\n".join(
          [f"checkpoint step {step} in {self.directory} is damaged:",
           integrity.error_details(error), *noise]))
      where = f" (details in {log_path})" if log_path else ""
    if self.config.on_corrupt == "stop":
      raise CorruptCheckpointError(
          f"{error}{where}. The run stops and changes nothing "
          "(CheckpointConfig.on_corrupt='stop'): move that step folder away to resume from "
          "the one before, or set on_corrupt='fallback'") from error
    moved = paths.join(self.directory, str(step))
    if self.is_primary and not self.read_only:
      moved = integrity.move_aside(moved)
      if self._mirror is not None:
        self._mirror.drop(step)
    if jax.process_count() > 1:
      all_flags(True)  # every process lists the checkpoints after process 0 has moved it
    if not self.read_only:
      with integrity.quiet_orbax(logging.CRITICAL):
        self._manager.reload()
    older = [s for s in steps if s < step]
    then = f"falling back to step {older[-1]}" if older else "no older checkpoint"
    kept = ("left in place (read only)" if self.read_only
            else f"moved to {moved[len(self.model_dir):].lstrip('/' + os.sep)}")
    print(f"t5lite: warning: {error}; {kept}, {then}{where}", file=sys.stderr, flush=True)
    return paths.basename(moved)

  def wait(self) -> None:
    """Blocks until the save in flight (if any) has committed, and seals it."""
    with self._write_errors():
      self._manager.wait_until_finished()
    self._in_flight = None
    self._seal_committed()

  def close(self) -> None:
    self.wait()
    self._manager.close()
    if self._mirror is not None:
      self._mirror.close()
