"""TrainConfig: the settings of one training run (gin binds it through T5X's macro names;
t5lite.train.trainer re-exports it). Which recipe the run follows (t5lite.train.recipes) is
one of them: TrainConfig.peft, TrainConfig.distillation or TrainConfig.recipe.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from t5lite.errors import ConfigError
from t5lite.eval.evaluator import DecodeConfig
from t5lite.families.distillation import DistillationConfig
from t5lite.families.peft import PeftConfig
from t5lite.runtime import checkpoints as ckpt_lib
from t5lite.runtime import model_dir as model_dir_lib
from t5lite.runtime import partitioning as part
from t5lite.runtime.wandb_sink import WandbConfig
from t5lite.train import recipes
from t5lite.train.optimizers import OptimizerConfig
from t5lite.train.step import StepConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """One training run. Gin binds it through T5X's macro names (gin/runs/pretrain.gin)."""

  model_dir: str
  """Where checkpoints, metrics, the model config and the vocabulary go (MODEL_DIR)."""
  train_steps: int
  """The final step (TRAIN_STEPS): a resumed or finetuning run stops there, as in T5X."""
  batch_size: int
  """Global batch size in rows, over all processes (BATCH_SIZE)."""
  mixture_or_task_name: str
  """A registered task or mixture (MIXTURE_OR_TASK_NAME)."""
  task_feature_lengths: Mapping[str, int]
  """e.g. {'inputs': 512, 'targets': 114} (TASK_FEATURE_LENGTHS)."""
  seed: int = 0
  """Seeds the init, the data order and dropout (RANDOM_SEED): the one seed of a run."""
  initial_checkpoint_path: str | None = None
  """Params to start from when MODEL_DIR has no checkpoint (INITIAL_CHECKPOINT_PATH)."""
  use_cached_tasks: bool = False
  """Read tasks from `t5lite cache` output (USE_CACHED_TASKS)."""
  cache_dir: str | None = None
  """Where cached tasks are (default: $T5LITE_CACHE_DIR or ~/.cache/t5lite/tasks)."""
  accept_data_changes: bool = False
  """Resume even though the task's files changed since the checkpoint (refused by default:
  the saved positions point into the old files)."""
  pack: bool = True
  """Pack several examples per row (T5X pretraining does)."""
  data_workers: int = 0
  """Worker processes computing batch rows (0: in the training process)."""
  log_period: int = 100
  """Write metrics and print the progress line every this many steps (and at the end)."""
  eval_period: int = 1000
  """Evaluate on eval_split every this many steps (EVAL_PERIOD); 0 = never."""
  run_eval_before_training: bool = False
  """Also evaluate once before the first step (T5X's name), e.g. to see what finetuning
  improves."""
  eval_steps: int = 20
  """Batches per evaluation (fewer when the split ends first)."""
  infer_eval_period: int = 0
  """Decode eval_split and compute each task's metrics (ROUGE, accuracy, ...) every this many
  steps (and at the end); 0 = never. Unpacked, in order, the same examples every time."""
  infer_eval_examples: int | None = 128
  """Examples per task for the inference eval (None: the whole split)."""
  decode: DecodeConfig = dataclasses.field(default_factory=DecodeConfig)
  """Decoding settings of the inference eval."""
  eval_split: str = "validation"
  """The split evaluated; tasks without it are skipped."""
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  step: StepConfig = dataclasses.field(default_factory=StepConfig)
  """Loss options (LOSS_NORMALIZING_FACTOR, z-loss, ...), microbatches, non-finite policy."""
  mesh: part.MeshConfig = dataclasses.field(default_factory=part.MeshConfig)
  fsdp: bool = False
  """Shard parameters' embed axis over the mesh's 'fsdp' axis (logical_axis_rules)."""
  compiler_options: Mapping[str, bool | int | float | str] | None = None
  """XLA options of the train and eval steps' compiles (jax.jit's compiler_options), for
  the backend the run compiles for: e.g. the v5e xl preset's
  {'xla_tpu_enable_windowed_einsum_for_all_gather': False} (docs/compile.md says why).
  None: XLA's defaults. An option the backend does not know fails the first compile."""
  checkpoint: ckpt_lib.CheckpointConfig = dataclasses.field(
      default_factory=ckpt_lib.CheckpointConfig)
  profile_steps: int = 0
  """Trace this many steps with jax.profiler into MODEL_DIR/profile (0: no profile), for
  TensorBoard's profile plugin or XProf (t5lite.train.actions.Profile)."""
  profile_after_steps: int = 1
  """Steps this process runs before the traced ones (the first pays one-time costs)."""
  wandb: WandbConfig | None = None
  """Also log to Weights & Biases (t5lite.runtime.wandb_sink; gin/runs/wandb.gin turns it
  on); None: metrics.jsonl and TensorBoard only."""
  preemption_check_period: int = 1
  """With several processes, agree on SIGTERM every this many steps: one all-gather of a flag,
  which waits for the step to finish. Raise it when steps take milliseconds."""
  lease_timeout_s: float = 600.0
  """A run holds MODEL_DIR's lease (t5lite/runtime/lease.py) and renews it every tenth of
  this; a lease not renewed for this long (its holder on another host died) is taken over."""
  distillation: DistillationConfig | None = None
  """Train the model as a student of a frozen teacher (t5lite.families.distillation)."""
  peft: PeftConfig | None = None
  """Train adapters (LoRA) on a frozen base model, the base's params left out of the train
  state and checkpoints (t5lite.families.peft)."""
  recipe: Any = None
  """Another recipe (t5lite.train.recipes): a registered recipe's name, e.g. 'my_recipe' (a
  user's registers when its module is imported: `t5lite train --module`), or the options
  object of one. None: the plain run (or the peft / distillation field's recipe)."""

  def __post_init__(self):
    # Floats, bools and strings pass `< 1`: TRAIN_STEPS=10.5 trained to step 11.
    from t5lite.util.checks import check_feature_lengths, require_int
    for name in ("train_steps", "batch_size", "log_period", "eval_steps",
                 "preemption_check_period"):
      require_int(getattr(self, name), f"TrainConfig.{name}", minimum=1)
    for name in ("seed", "data_workers", "eval_period", "infer_eval_period", "profile_steps",
                 "profile_after_steps"):
      require_int(getattr(self, name), f"TrainConfig.{name}", minimum=0 if name != "seed" else None)
    require_int(self.infer_eval_examples, "TrainConfig.infer_eval_examples", minimum=1,
                optional=True)
    _check_compiler_options(self.compiler_options)
    # Before anything is allocated (a length of 10**12 once asked for 2.3 PB).
    check_feature_lengths(self.task_feature_lengths, "TASK_FEATURE_LENGTHS", self.batch_size)
    if not self.model_dir:
      raise ConfigError("TrainConfig.model_dir (MODEL_DIR) is not set")
    model_dir_lib.check_location(self.model_dir)
    model_dir_lib.check_path_length(self.model_dir)
    model_dir_lib.check_location(self.initial_checkpoint_path, "INITIAL_CHECKPOINT_PATH")
    recipes.check_config(self)  # one recipe at most, and one it can train


def _check_compiler_options(options) -> None:
  """compiler_options: None or a mapping of option names to plain values (what jax.jit takes)."""
  if options is None:
    return
  if not isinstance(options, Mapping) or not all(
      isinstance(k, str) and isinstance(v, (bool, int, float, str)) for k, v in options.items()):
    raise ConfigError(f"TrainConfig.compiler_options={options!r} must map XLA option names to "
                      "bools, numbers or strings, e.g. "
                      "{'xla_tpu_enable_windowed_einsum_for_all_gather': False}")
