"""What `t5lite --help` and `t5lite VERB --help` say beyond the flags: the gin flags, the macros
a run file takes, the shipped configs, exit codes, and an example of each verb."""
from __future__ import annotations

from t5lite.launch import PREEMPTED_EXIT_CODE

GIN_HELP = """gin flags (T5X style):
  --gin_file=FILE        a gin file (repeatable; paths as given, or under the repo's gin/)
  --gin.NAME=VALUE       a binding, e.g. --gin.ModelConfig.dropout_rate=0.1 or
                         --gin.MODEL_DIR=/tmp/run (bare words are taken as strings)
  --module NAME_OR_PATH  import a module of your own before the gin flags are parsed: its
                         tasks, families, objectives, recipes and gin configurables register
                         (repeatable; a name on PYTHONPATH, e.g. my_pkg.tasks, or a .py file)"""
MODULE_HELP = ("import this module before gin parses (it registers tasks, mixtures, families, "
               "recipes, gin configurables): a module name importable from PYTHONPATH, or a "
               "path to a .py file; repeatable")
EXIT_HELP = f"""exit codes:
  0 done, 1 failed, 2 bad setup (flags, gin, mesh, a job that did not form),
  {PREEMPTED_EXIT_CODE} preempted: SIGTERM reached a process and every process saved the same
     step; rerun the same command to resume (schedulers requeue on this code)"""
COMPILE_HELP = ("compile the train step (or decoding) for a TPU topology on this host: memory "
                "per device against HBM, XLA's flops and estimated step time")

# The macros of the shipped run files (T5X's names), per gin verb.
MACROS = {
    "train": """macros (gin/runs/pretrain.gin, finetune.gin; --gin.NAME=VALUE):
  MODEL_DIR               where checkpoints, metrics and configs go (required; gs:// or s3:// too)
  MIXTURE_OR_TASK_NAME    a registered task or mixture (required; `t5lite tasks list`)
  TASK_FEATURE_LENGTHS    e.g. "{'inputs': 512, 'targets': 114}"
  TRAIN_STEPS, BATCH_SIZE the final step and the global batch in rows
  INITIAL_CHECKPOINT_PATH params to start from (finetuning; an imported HF model too)
  EVAL_PERIOD, RANDOM_SEED, DROPOUT_RATE, USE_CACHED_TASKS, LOSS_NORMALIZING_FACTOR
shipped configs (gin/, installed with the package):
  runs/   pretrain, finetune, demo, lora, prompt_tuning, distilbert, stdlib_*_pretrain, wandb,
          pods/t5_1_1_{small..xxl}_{v4,v5e,v5p}
  models/ t5_1_1/{small..xxl}, t5_1_0/, transformer/, bert/, roberta/, albert/, electra/,
          gpt2/, llama_style/, switch/, tiny, demo, ... (`ls gin/models`)
  (docs/pretraining.md lists TrainConfig's fields: --gin.TrainConfig.log_period=10, ...)""",
    "eval": """macros (gin/runs/eval.gin):
  CHECKPOINT_PATH         a MODEL_DIR (its newest step) or one checkpoints/STEP folder (required)
  MIXTURE_OR_TASK_NAME    tasks or mixtures with metrics (required)
  TASK_FEATURE_LENGTHS, BATCH_SIZE, SPLIT (default validation), EVAL_OUTPUT_DIR""",
    "infer": """macros (gin/runs/infer.gin):
  CHECKPOINT_PATH         a MODEL_DIR or one checkpoints/STEP folder (required)
  INFER_INPUT             a text file (one input a line) or JSONL ({"inputs": ...}); - : stdin
  INFER_OUTPUT            a JSONL file; - : stdout
  INPUTS_LENGTH, MAX_DECODE_LENGTH, BATCH_SIZE""",
}

EXAMPLES = {
    "train": """examples:
  t5lite train --gin_file=gin/runs/demo.gin --gin.MODEL_DIR=/tmp/demo
  t5lite train --gin_file=gin/runs/pretrain.gin --gin_file=gin/models/t5_1_1/base.gin \\
    --gin.MIXTURE_OR_TASK_NAME=c4_span_corruption --gin.MODEL_DIR=gs://BUCKET/t5_base
  t5lite train --gin_file=gin/runs/finetune.gin --gin_file=gin/models/t5_1_1/base.gin \\
    --gin.MIXTURE_OR_TASK_NAME=glue_cola_v002 --gin.INITIAL_CHECKPOINT_PATH=/tmp/t5_base \\
    --gin.TRAIN_STEPS=1010000 --gin.MODEL_DIR=/tmp/cola""",
    "eval": """example:
  t5lite eval --gin_file=gin/runs/eval.gin --gin.CHECKPOINT_PATH=/tmp/cola \\
    --gin.MIXTURE_OR_TASK_NAME=glue_cola_v002    # -> /tmp/cola/eval/metrics-STEP.json""",
    "infer": """example:
  echo "cola sentence: the cat sat" | t5lite infer --gin_file=gin/runs/infer.gin \\
    --gin.CHECKPOINT_PATH=/tmp/cola""",
    "smoke": """example:
  t5lite smoke --gin_file=gin/models/llama_style/tiny.gin   # 30 steps; fails unless the loss falls""",
    "compile": """example:
  t5lite compile --gin_file=gin/runs/pods/t5_1_1_xl_v5e.gin  # fits? estimated MFU?""",
    "tasks": """examples:
  t5lite tasks list
  t5lite tasks show stdlib_span_corruption -n 2 --lengths inputs=128,targets=32
  t5lite tasks stats c4_span_corruption --max_examples 500""",
    "cache": """example:
  t5lite cache stdlib_span_corruption --split train    # then --gin.USE_CACHED_TASKS=True""",
    "bench": """examples:
  t5lite bench train --repeats 5       # t5lite's train step beside HF PyTorch's
  t5lite bench decode                  # greedy and beam decoding beside HF
  t5lite bench gpu --dry_run           # the GPU check, tiny, anywhere""",
    "plot": """examples:
  t5lite plot /tmp/demo                                   # -> /tmp/demo/loss.png
  t5lite plot runs/a runs/b --x tokens --smooth 0.8 --out ab.png""",
}

# Top-level one-liners of the plain-flag verbs, whose own modules parse their flags.
EXPORT = ("export a checkpoint: HF transformers (hf, --merge for LoRA), params only (params), a "
          "jax.export serving artifact (serving), a PEFT run's adapter for the peft library "
          "(peft), a smaller student of a BERT-style model (student)")
IMPORT = ("import into a t5lite MODEL_DIR: HF transformers (hf) or T5X (t5x) checkpoints, a "
          "peft library adapter onto its base (peft)")


def epilog(verb: str, *parts: str) -> str:
  """The verb's --help epilog: its macros (gin verbs), the given parts, its example."""
  return "\n\n".join(p for p in (MACROS.get(verb), *parts, EXAMPLES.get(verb)) if p)
