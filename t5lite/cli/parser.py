"""`t5lite`'s argument parser: each verb, its help and its own flags (argparse).

GIN_VERBS take gin flags and the multi-host flags; PLAIN_VERBS parse their own flags in their
modules, so this parser only routes to them; the rest (smoke, compile, tasks, bench, plot,
cache) are defined here. Running the verbs is t5lite.cli (main).
"""
from __future__ import annotations

import argparse

from t5lite.cli import help_text
from t5lite.errors import ConfigError
from t5lite.launch import distributed

GIN_VERBS = {
    "train": "train or finetune a model (resumes from MODEL_DIR's newest checkpoint)",
    "eval": "evaluate a checkpoint on tasks or mixtures with their metrics",
    "infer": "decode text inputs (file or stdin) with a checkpoint, JSONL out",
}
# Plain-flag verbs, each handled by main(argv) of its own module (which loads only what it needs).
PLAIN_VERBS = {
    "export": (help_text.EXPORT, "t5lite.cli.export"),
    "import": (help_text.IMPORT, "t5lite.cli.imports"),
    "launch": ("print the per-host commands of a pod training job (TPU VM, SLURM, Kubernetes)",
               "t5lite.launch.cli"),
    "study": ("a paper's comparison end to end (pretrain at equal FLOPs, finetune, evaluate) "
              "over seeds, with its table (`t5lite study list`)", "t5lite.study"),
}


def _add_module_flag(parser) -> None:
  parser.add_argument("--module", action="append", default=[], metavar="NAME_OR_PATH",
                      help=help_text.MODULE_HELP)


def build() -> argparse.ArgumentParser:
  """The parser of every verb but PLAIN_VERBS' own flags (their modules parse those)."""
  parser = argparse.ArgumentParser(
      prog="t5lite", description="JAX/Flax pretraining stack for text-to-text Transformers.",
      formatter_class=argparse.RawDescriptionHelpFormatter)
  verbs = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
  for verb, text in GIN_VERBS.items():
    sub = verbs.add_parser(verb, help=text, description=text,
                           epilog=help_text.epilog(verb, help_text.GIN_HELP, *(
                               [help_text.EXIT_HELP] if verb == "train" else [])),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    distributed.add_flags(sub)
    _add_module_flag(sub)
    if verb in ("eval", "infer"):
      _add_adapter_flags(sub, verb)
  smoke = verbs.add_parser(
      "smoke", help="forward/backward steps of a gin-configured model on embedded text",
      description="Build the model from gin, take a few AdamW steps on standard-library "
      "docstrings, fail unless the loss falls.",
      epilog=help_text.epilog("smoke", help_text.GIN_HELP),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  smoke.add_argument("--steps", type=int, default=30)
  smoke.add_argument("--batch_size", type=int, default=8)
  smoke.add_argument("--length", type=int, default=64, help="tokens per input and per target")
  smoke.add_argument("--seed", type=int, default=0)
  _add_module_flag(smoke)
  compile_ = verbs.add_parser(
      "compile", help=help_text.COMPILE_HELP,
      description=help_text.COMPILE_HELP + ": same --gin_file / --gin.X "
      "flags as train (MODEL_DIR and MIXTURE_OR_TASK_NAME may be left out); prints a table and "
      "one JSON line (fits, bytes_per_device, flops_per_device, estimated_mfu, ...)",
      epilog=help_text.epilog("compile", help_text.GIN_HELP),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  _add_compile_flags(compile_)
  _add_module_flag(compile_)
  _add_data_verbs(verbs)
  for verb, (text, _) in PLAIN_VERBS.items():
    sub = verbs.add_parser(verb, help=text, description=text, add_help=False)
    sub.add_argument("args", nargs=argparse.REMAINDER, help="flags of the verb (--help)")
  return parser


def _add_compile_flags(parser) -> None:
  """`t5lite compile`'s own flags (t5lite.train.aot.compiler, imported only when it runs)."""
  parser.add_argument("--topology", default=None, metavar="NAME",
                      help="a TPU topology in chips: v4:AxBxC, v5e:AxB, v5p:AxBxC, v6e:AxB, "
                      "e.g. v5e:16x16 (default: the gin macro POD_TOPOLOGY, which the "
                      "presets gin/runs/pods/*.gin set)")
  parser.add_argument("--num_slices", "--num-slices", type=int, default=1,
                      help="slices of the topology (multislice: the mesh's data axis spans them)")
  parser.add_argument("--program", choices=("train", "decode"), default="train",
                      help="train: the train step; decode: the generate program (encoder, "
                      "prefill, decode loop) of TrainConfig.decode's settings")
  parser.add_argument("--fit_only", "--fit-only", dest="fit_only", action="store_true",
                      help="report memory and fit only: skip the loop-free compiles that cost a "
                      "program with scanned layers or microbatches (about 3x faster then; no "
                      "estimated MFU)")
  parser.add_argument("--emit-hlo", "--emit_hlo", dest="emit_hlo", default=None, metavar="DIR",
                      help="write the optimized HLO text here (the lowered StableHLO for cuda)")
  parser.add_argument("--platform", choices=("tpu", "cuda"), default="tpu",
                      help="tpu: compile with libtpu; cuda: lower (not compile) for GPUs, "
                      "without libtpu")
  parser.add_argument("--devices", type=int, default=8,
                      help="GPUs of the abstract mesh for --platform cuda (default 8)")


def _add_adapter_flags(sub, verb: str) -> None:
  """A base (CHECKPOINT_PATH) plus PEFT adapters (t5lite.interop.peft.adapter_batch)."""
  sub.add_argument("--adapter", default=None, metavar="RUN_DIR",
                   help="a PEFT run's RUN_DIR: its adapters on the base CHECKPOINT_PATH "
                   "(checked by fingerprint)" + (" for every input that names none (or one of "
                   "the --adapters names)" if verb == "infer" else "; results go to "
                   "RUN_DIR/eval unless EVAL_OUTPUT_DIR is set"))
  if verb == "infer":
    sub.add_argument("--adapters", default=None, metavar="NAME=RUN_DIR,...",
                     help="adapters of the base CHECKPOINT_PATH (LoRA, or soft prompts, or "
                     "prefixes: one kind) that JSONL inputs pick by "
                     'name ({"inputs": "...", "adapter": "NAME"}; "base": the base alone); one '
                     "batch mixes them in one program")


def _lengths(text: str) -> dict[str, int]:
  """'inputs=512,targets=114' -> {'inputs': 512, 'targets': 114}, each within the ceiling."""
  from t5lite.util.checks import check_feature_lengths
  try:
    lengths = {k.strip(): int(v) for k, v in (part.split("=") for part in text.split(","))}
    return check_feature_lengths(lengths, "--lengths")
  except ValueError as e:  # ConfigError included: argparse prints it with the usage line
    detail = str(e) if isinstance(e, ConfigError) else f"expected NAME=LENGTH,..., got {text!r}"
    raise argparse.ArgumentTypeError(detail) from e


def _add_data_verbs(verbs) -> None:
  raw = argparse.RawDescriptionHelpFormatter
  tasks = verbs.add_parser("tasks", help="list, show and measure registered tasks",
                           description="Registered tasks come from t5lite_tasks and --module.",
                           epilog=help_text.epilog("tasks"), formatter_class=raw)
  _add_module_flag(tasks)
  sub = tasks.add_subparsers(dest="tasks_verb", metavar="list|show|stats", required=True)
  sub.add_parser("list", help="every task and mixture")
  for name, text in (("show", "raw, preprocessed and decoded examples"),
                     ("stats", "token counts and packing efficiency")):
    p = sub.add_parser(name, help=text)
    p.add_argument("name")
    p.add_argument("--split", default="train")
    p.add_argument("--lengths", type=_lengths, default={"inputs": 512, "targets": 114},
                   help="task feature lengths, e.g. inputs=512,targets=114")
    if name == "show":
      p.add_argument("-n", type=int, default=3, help="examples to show")
    else:
      p.add_argument("--max_examples", type=int, default=1000)
      p.add_argument("--family", default=None,
                     help="the model family whose feature converter packs the examples "
                     "(default: T5's encoder-decoder; t5lite.families.names() lists them)")
  bench = verbs.add_parser("bench", help="benchmarks side by side with a peer: data pipeline, "
                           "train step, decoding (vs HF), checkpoint checksums (vs orbax "
                           "alone); each ends with one JSON line of ratios",
                           epilog=help_text.epilog("bench"), formatter_class=raw)
  bench.add_argument("what", choices=("data", "train", "decode", "checkpoint", "recipes",
                                         "peft", "moe", "gpu"))
  bench.add_argument("args", nargs=argparse.REMAINDER, help="flags of the benchmark (--help)")
  plot = verbs.add_parser("plot", help="one PNG of the loss and eval curves of one or more runs",
                          epilog=help_text.epilog("plot"), formatter_class=raw)
  plot.add_argument("args", nargs=argparse.REMAINDER,
                    help="RUN [RUN ...] [--x step|tokens] [--smooth W] [--out PNG] [--csv CSV]")
  cache = verbs.add_parser("cache", help="run a task's preprocessors up to CACHE_POINT into "
                           "array_record shards (training reads them with USE_CACHED_TASKS)",
                           epilog=help_text.epilog("cache"), formatter_class=raw)
  cache.add_argument("name")
  cache.add_argument("--split", action="append", help="split(s) to cache (default: all)")
  cache.add_argument("--cache_dir", default=None, help="default: $T5LITE_CACHE_DIR or "
                     "~/.cache/t5lite/tasks")
  cache.add_argument("--num_workers", type=int, default=1,
                     help="split the work over N workers, each writing its own shard: local "
                     "processes, or hosts when --worker_index is given")
  cache.add_argument("--worker_index", type=int, default=None,
                     help="write only this worker's shard (one host of --num_workers)")
  cache.add_argument("--processes", type=int, default=None,
                     help="local processes at once (default: the CPUs)")
  _add_module_flag(cache)
