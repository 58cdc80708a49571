"""`t5lite <verb>`: the command line. Gin is parsed here and nowhere deeper.

train / eval / infer take T5X-style --gin_file=F and --gin.NAME=VALUE flags, and the
multi-host flags (--coordinator_address, --num_processes, --process_id); without them a pod's
layout is detected from its environment (t5lite/launch/cluster.py). `compile` takes the same
gin flags as train, without the multi-host ones (one process compiles for a whole pod:
t5lite/train/aot/compiler.py), and `smoke` takes a model's. The other verbs take plain flags.
train, eval, infer, compile, smoke, tasks and cache also take --module NAME_OR_PATH: a user's
module, imported before gin parses, that registers its own tasks, families, objectives or
recipes.

Exit codes: 0 done; 1 the run failed (a bug shows its traceback); 2 a bad setup (flags, gin,
names, paths, sizes, mesh, a job that did not form: t5lite.errors) or environment (an OSError:
permission, a full or read-only disk, a file where a folder should be), told in one line;
42 (PREEMPTED_EXIT_CODE) `train` stopped on SIGTERM after saving: rerun it to resume.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import sys

from t5lite.cli import gin_config, smoke
from t5lite.cli.parser import GIN_VERBS, PLAIN_VERBS, build as build_parser
from t5lite.errors import ConfigError
from t5lite.launch import PREEMPTED_EXIT_CODE, distributed, peers
from t5lite.runtime import platforms, preemption

# Setup mistakes: one line on stderr and exit 2. Anything else is a bug: traceback, exit 1.
# The environment's OSErrors count too (a missing path, a file where a folder should be, a
# folder where a file should be, no permission, a read-only or full disk); other OSErrors
# (a broken pipe, a connection or a timeout in t5lite's own code) keep their traceback.
PATH_ERRORS = (ConfigError, FileNotFoundError, FileExistsError, NotADirectoryError,
               IsADirectoryError, PermissionError)
USER_ERRORS = (*PATH_ERRORS, OSError)  # a plain OSError only with ENVIRONMENT_ERRNOS
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES,
                                errno.EPERM, errno.ENAMETOOLONG, errno.ELOOP, errno.EIO})


def _data_verb(args) -> int:
  """`t5lite cache` and `t5lite tasks list|show|stats`."""
  import json
  import t5lite_tasks  # noqa: F401 (registers the shipped tasks)
  from t5lite.data import cache, cache_parallel, describe, registry
  if args.verb == "cache":
    task = registry.TaskRegistry.get(args.name)
    for split in args.split or task.splits or ["train"]:
      if args.worker_index is None:
        infos = cache_parallel.cache_in_parallel(task, split, args.cache_dir,
                                                 num_workers=args.num_workers,
                                                 processes=args.processes)
      else:
        infos = [cache.cache_task(task, split, args.cache_dir, worker_index=args.worker_index,
                                  num_workers=args.num_workers)]
      for info in infos:
        print(json.dumps(info))
    return 0
  if args.tasks_verb == "list":
    print(describe.list_tasks())
  elif args.tasks_verb == "show":
    print(describe.show_task(args.name, args.split, args.lengths, args.n))
  else:
    from t5lite import families
    from t5lite.models.config import ModelConfig
    default = ModelConfig()
    family = families.get(args.family or default.family_name)(default)
    print(json.dumps(describe.task_stats(args.name, args.split, args.lengths, family.converter,
                                         args.max_examples), indent=2))
  return 0


def _smoke(args) -> int:
  losses = smoke.run(gin_config.model_config(), steps=args.steps, batch_size=args.batch_size,
                     length=args.length, seed=args.seed)
  k = min(3, len(losses))
  first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
  print(f"smoke: mean loss of the first {k} steps {first:.4f}, of the last {k} {last:.4f}")
  if not last < first:
    print("smoke: FAILED, the loss did not fall", file=sys.stderr)
    return 1
  return 0


def _import_task_modules() -> None:
  """The shipped tasks, and T5X's MIXTURE_OR_TASK_MODULE (a module name or a list)."""
  import t5lite_tasks  # noqa: F401 (registers the shipped tasks)
  module = gin_config.macro("MIXTURE_OR_TASK_MODULE")
  import_modules([module] if isinstance(module, str) else list(module or ()),
                 "MIXTURE_OR_TASK_MODULE")


def import_modules(modules, flag: str = "--module") -> None:
  """Imports a user's modules (--module, MIXTURE_OR_TASK_MODULE), each a dotted name
  importable from sys.path (PYTHONPATH), as seqio's and T5X's MIXTURE_OR_TASK_MODULE, or a
  path to a .py file, whose folder then joins sys.path (so that it is importable by name:
  data workers re-import it) and which is imported by its file name. The shipped tasks come
  first, so that a user's mixture may name them. A module that fails to import shows its
  traceback; a name that is not there is a setup mistake (exit 2)."""
  import importlib

  if not modules:
    return
  import t5lite_tasks  # noqa: F401 (registers the shipped tasks)
  importlib.invalidate_caches()  # a module written since a folder was last listed
  for spec in modules:
    name = spec
    if spec.endswith(".py") or os.sep in spec or (os.altsep and os.altsep in spec):
      path = os.path.abspath(os.path.expanduser(spec))
      if not os.path.isfile(path) or not path.endswith(".py"):
        raise ConfigError(f"{flag} {spec}: no such .py file")
      folder, name = os.path.split(path[:-len(".py")])
      loaded = sys.modules.get(name)
      if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
        raise ConfigError(f"{flag} {spec}: a module called {name!r} is imported already "
                          f"({getattr(loaded, '__file__', None) or 'built in'}): rename the file")
      if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
      importlib.import_module(name)
    except ModuleNotFoundError as e:
      if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
        raise  # the module itself imports something missing: its traceback
      raise ConfigError(f"{flag} {spec}: no module named {e.name!r} (a module name must be "
                        "importable: put its folder on PYTHONPATH, or give the path of its "
                        ".py file)") from e


def _eval(args) -> int:
  from t5lite.eval import run
  _import_task_modules()
  config = gin_config.run_config("EVAL_CONFIG", run.EvalConfig, "gin/runs/eval.gin")
  if args.adapter:
    config = dataclasses.replace(config, adapter=args.adapter)
  run.evaluate_checkpoint(config)
  return 0


def _infer(args) -> int:
  import jax

  from t5lite.eval import run
  config = gin_config.run_config("INFER_CONFIG", run.InferConfig, "gin/runs/infer.gin")
  flags = {k: v for k, v in (("adapter", args.adapter), ("adapters", args.adapters)) if v}
  config = dataclasses.replace(config, **flags) if flags else config
  count = run.infer(config)
  if jax.process_index() == 0:
    print(f"t5lite infer: {count} inputs decoded"
          + ("" if config.output_path == "-" else f" into {config.output_path}"),
          file=sys.stderr)
  return 0


def _train(args) -> int:
  import gin
  import jax

  from t5lite.train import trainer
  _import_task_modules()
  model_config = gin_config.model_config()
  train_config = gin_config.train_config()
  try:
    result = trainer.train(model_config, train_config, gin_config_text=gin.config_str())
  except FloatingPointError as e:  # the run diverged: not a setup mistake, not a bug either
    print(f"t5lite train: {e}", file=sys.stderr)
    return 1
  if jax.process_index() == 0:
    print(f"t5lite train: {'preempted' if result.preempted else 'done'} at step {result.step}; "
          f"model dir {train_config.model_dir}")
  return PREEMPTED_EXIT_CODE if result.preempted else 0


def _compile(args) -> int:
  from t5lite.train.aot import compiler as aot_compile
  if args.topology is None:  # a pod preset (gin/runs/pods/) names the topology it was sized for
    args.topology = gin_config.macro("POD_TOPOLOGY")
  # A run's MODEL_DIR and task are not needed to compile its step: placeholders when unset.
  return aot_compile.main(args, gin_config.model_config(), gin_config.train_config(
      fill={"model_dir": "unused-by-t5lite-compile",
            "mixture_or_task_name": "unused-by-t5lite-compile"}))


def _initialize(args) -> None:
  """The multi-host runtime, from flags or the cluster; before anything touches a device."""
  distributed.initialize(distributed.resolve(
      args.coordinator_address, args.num_processes, args.process_id, os.environ),
      args.initialization_timeout, heartbeat_timeout=args.heartbeat_timeout)


def _plain_verb(verb: str, argv: list[str]) -> int:
  import importlib
  return importlib.import_module(PLAIN_VERBS[verb][1]).main(argv)


def main(argv: list[str] | None = None, tune_cpu_host: bool = False) -> int:
  """Runs one verb; returns its exit code. tune_cpu_host: the caller owns the process, so
  train / eval / infer / smoke / bench may set it up for CPU work (t5lite.runtime.cpu_host):
  the `t5lite` command does; tests calling main() in-process do not."""
  argv = sys.argv[1:] if argv is None else list(argv)
  crashed = False
  try:
    if argv[:1] == ["launch"]:  # gin flags after its `--` belong to the verb it launches
      return _plain_verb("launch", argv[1:])
    gin_files, bindings, rest = gin_config.split_gin_flags(argv)
    if rest and rest[0] in PLAIN_VERBS:  # their modules parse their own flags, --help included
      if gin_files or bindings:
        raise gin_config.GinConfigError(f"t5lite {rest[0]} takes no gin flags")
      return _plain_verb(rest[0], rest[1:])
    args = build_parser().parse_args(rest)
    takes_gin = args.verb in GIN_VERBS or args.verb in ("smoke", "compile")
    if (gin_files or bindings) and not takes_gin:
      raise gin_config.GinConfigError(f"t5lite {args.verb} takes no gin flags")
    # Before gin parses: a user's module may define configurables the gin flags bind. Imports
    # only (nothing may touch a device before the job forms: launch/distributed.py).
    import_modules(getattr(args, "module", None))
    if takes_gin:
      gin_config.parse(gin_files, bindings)
    if args.verb == "train":
      # SIGTERM is a flag from here on, startup included: the trainer acts on it (exit 42).
      with preemption.SIGTERM:
        _initialize(args)
        _tune(tune_cpu_host)
        return _train(args)
    if args.verb in GIN_VERBS:
      _initialize(args)
    if args.verb in (*GIN_VERBS, "smoke", "bench"):
      _tune(tune_cpu_host)
    if args.verb == "smoke":
      return _smoke(args)
    if args.verb == "compile":
      return _compile(args)
    if args.verb == "eval":
      return _eval(args)
    if args.verb == "infer":
      return _infer(args)
    if args.verb in ("tasks", "cache"):
      return _data_verb(args)
    if args.verb == "plot":
      from t5lite.cli import plot
      return plot.main(args.args)
    if args.verb == "bench":
      import importlib  # each benchmark loads only what it measures
      return importlib.import_module(f"t5lite.bench.{args.what}").main(args.args)
    raise AssertionError(f"unhandled verb {args.verb}")
  except Exception as e:
    peers.wait_for_verdict(e)  # a lost process of the job explains any error: exit 43
    if not isinstance(e, USER_ERRORS) or (not isinstance(e, PATH_ERRORS)
                                          and e.errno not in ENVIRONMENT_ERRNOS):
      crashed = True  # the other processes of a job will say this one stopped (exit 43)
      raise  # a bug keeps its traceback
    print(f"{_prog(argv)}: error: {_one_line(e)}", file=sys.stderr)  # a setup mistake
    return 2
  finally:
    if not crashed:
      peers.leave()  # leaving on purpose, not lost (a no-op outside a multi-process job)


def _tune(wanted: bool) -> None:
  """CPU dispatch and heap settings (t5lite.runtime.cpu_host), after the job formed and
  before JAX makes its backends; T5LITE_CPU_TUNING=0 turns them off."""
  if wanted:
    from t5lite.runtime import cpu_host
    cpu_host.tune()


def _one_line(error: Exception) -> str:
  """A ConfigError's message; an OSError's path(s) and errno text, e.g. '/data/x: Permission
  denied' (its str() reads '[Errno 13] Permission denied: ...')."""
  if isinstance(error, OSError) and not isinstance(error, ConfigError) and error.strerror:
    paths = [os.fsdecode(p) for p in (error.filename, error.filename2) if p is not None]
    return f"{' -> '.join(paths) or 'an OS call'}: {error.strerror}"
  text = str(error) or type(error).__name__
  return text if isinstance(error, ConfigError) else " ".join(text.split())


def _prog(argv: list[str]) -> str:
  """'t5lite VERB' for the first verb named in argv (error lines name it), else 't5lite'."""
  verbs = {*GIN_VERBS, *PLAIN_VERBS, "smoke", "tasks", "cache", "bench", "plot", "compile"}
  return " ".join(["t5lite"] + [a for a in argv if a in verbs][:1])


def console_main() -> None:
  """The `t5lite` command (and `python -m t5lite.cli`): main(), then exit with its code. A
  failed run (exit 2: a full disk, say) exits at once, streams flushed, without waiting for
  background threads: a checkpoint write the disk refused can leave one of orbax's writer
  threads blocked, which would keep the process from ever ending. In a multi-process job the
  processes leave the coordination service together first (distributed.leave_job)."""
  platforms.apply()  # a CPU host with libtpu installed: no TPU initialization errors
  code = main(tune_cpu_host=True)
  if code == 2:
    distributed.leave_job()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)
