"""Every shipped gin model config parses and builds; bad gin gets clear errors."""
import jax
import pytest

from helpers.gin_files import MODEL_FILES
from t5lite.cli import gin_config
from t5lite.models import abstract_params, count_params


# Parameter counts of the published T5 checkpoints, as HF reports them.
PUBLISHED = {
    "gin/models/t5_1_0/small.gin": 60_506_624,
    "gin/models/t5_1_0/base.gin": 222_903_552,
    "gin/models/t5_1_0/large.gin": 737_668_096,
    "gin/models/t5_1_1/small.gin": 76_961_152,
    "gin/models/t5_1_1/base.gin": 247_577_856,
    "gin/models/t5_1_1/large.gin": 783_150_080,
    "gin/models/switch/base_8.gin": 619_339_008,
    "gin/models/switch/base_128.gin": 7_415_217_408,
}


def test_the_expected_model_files_ship():
  expected = {f"gin/models/t5_1_0/{s}.gin" for s in ("small", "base", "large", "3B", "11B")}
  expected |= {f"gin/models/t5_1_1/{s}.gin" for s in ("small", "base", "large", "xl", "xxl")}
  expected |= {"gin/models/tiny.gin", "gin/models/decoder_only/tiny.gin",
               "gin/models/encoder_only/tiny.gin"}
  assert expected <= set(MODEL_FILES)


def slow_if_large(path: str):
  """The 24-layer sizes (about a second each to build) run in `make test` only."""
  large = any(path.endswith(f"/{size}.gin") for size in ("large", "xl", "xxl", "3B", "11B"))
  return pytest.param(path, marks=pytest.mark.slow) if large else path


@pytest.mark.parametrize("path", [slow_if_large(f) for f in MODEL_FILES])
def test_model_file_builds_abstractly(path):
  gin_config.parse([path])
  config = gin_config.model_config()
  shapes = abstract_params(config)  # jax.eval_shape: no memory, no compute
  leaves = jax.tree_util.tree_leaves(shapes)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  if path in PUBLISHED:
    assert count_params(shapes) == PUBLISHED[path]
  # Shared layers (ALBERT) run as a loop, never scanned; so do Mixture-of-Experts stacks.
  if not config.shared_layer_groups and config.moe is None:
    scanned = abstract_params(config.replace(scan_layers=True))
    assert count_params(scanned) == count_params(shapes)


def test_bindings_override_files_and_bare_words_are_strings():
  gin_config.parse(["gin/models/tiny.gin"], ["ModelConfig.d_model=48", "MODEL_DIR=/tmp/run"])
  assert gin_config.model_config().d_model == 48
  import gin
  assert gin.query_parameter("MODEL_DIR/macro.value") == "/tmp/run"


def test_malformed_file_names_file_and_line(tmp_path):
  bad = tmp_path / "bad.gin"
  bad.write_text("ModelConfig.d_model = 64\nModelConfig.d_ff = (128,\n")
  # Python 3.12's tokenizer points at the unclosed bracket (line 2), 3.11's at the EOF (3).
  with pytest.raises(gin_config.GinConfigError, match=r"bad\.gin: line [23]: .*unclosed"):
    gin_config.parse([str(bad)])
  bad.write_text("MODEL_CONFIG = @ModelConfig()\nModelConfig.d_modle = 64\n")
  with pytest.raises(gin_config.GinConfigError,
                     match=r"(?s)bad\.gin.*d_modle.*line 2.*Did you mean: d_model"):
    gin_config.parse([str(bad)])


def test_unknown_file_suggests_near_names():
  with pytest.raises(gin_config.GinConfigError, match="did you mean gin/models/t5_1_1/base.gin"):
    gin_config.parse(["gin/models/t5_1_1/bsae.gin"])


def test_missing_model_config_says_what_to_add():
  gin_config.parse([], ["X=1"])
  with pytest.raises(gin_config.GinConfigError, match="--gin_file=gin/models/"):
    gin_config.model_config()


def test_invalid_field_value_is_reported():
  gin_config.parse(["gin/models/tiny.gin"], ["ModelConfig.norm='batch'"])
  with pytest.raises(gin_config.GinConfigError, match="norm='batch'"):
    gin_config.model_config()


def test_split_gin_flags():
  files, bindings, rest = gin_config.split_gin_flags(
      ["train", "--gin_file=a.gin", "--gin_file", "b.gin", "--gin.X=1", "--steps", "3"])
  assert files == ["a.gin", "b.gin"] and bindings == ["X=1"] and rest == ["train", "--steps", "3"]


RUN_FILES = [f for f in gin_config.shipped_gin_files() if f.startswith("gin/runs/")]
T5X_MACROS = ["MODEL_DIR", "TRAIN_STEPS", "BATCH_SIZE", "MIXTURE_OR_TASK_NAME",
              "TASK_FEATURE_LENGTHS", "RANDOM_SEED", "INITIAL_CHECKPOINT_PATH",
              "USE_CACHED_TASKS", "EVAL_PERIOD", "LOSS_NORMALIZING_FACTOR", "DROPOUT_RATE"]


def test_the_expected_run_files_ship():
  assert {"gin/runs/pretrain.gin", "gin/runs/finetune.gin", "gin/runs/eval.gin",
          "gin/runs/infer.gin", "gin/runs/demo.gin", "gin/runs/demo_finetune.gin"} <= set(RUN_FILES)


# Run files that set options of one kind of model (a head, SpanBERT's objective) build with a
# model file of that kind: (model file, its d_model).
RUN_MODELS = {"gin/runs/bert_finetune.gin": ("gin/models/bert/tiny.gin", 128),
              "gin/runs/stdlib_spanbert_pretrain.gin": ("gin/models/bert/tiny.gin", 128),
              "gin/runs/gpt1_finetune.gin": ("gin/models/llama_style/tiny.gin", 64),
              "gin/runs/distilbert.gin": ("gin/models/bert/tiny.gin", 128),
              "gin/runs/tinybert.gin": ("gin/models/bert/tiny.gin", 128),
              "gin/runs/stdlib_electra_pretrain.gin": ("gin/models/electra/tiny.gin", 128)}


PEFT_RUNS = {"gin/runs/lora.gin": "lora", "gin/runs/prompt_tuning.gin": "prompt_tuning"}
# Add-ons, given after a run file of their own: (the run file they are tried after).
ADD_ONS = {"gin/runs/wandb.gin": "gin/runs/pretrain.gin"}


@pytest.mark.parametrize("path", RUN_FILES)
def test_run_file_builds_its_config(path):
  """Every run file, with a model file where it has none and its required macros bound."""
  from t5lite.eval.run import EvalConfig, InferConfig
  from t5lite.train.trainer import TrainConfig
  macro, cls = {"gin/runs/eval.gin": ("EVAL_CONFIG", EvalConfig),
                "gin/runs/infer.gin": ("INFER_CONFIG", InferConfig)}.get(
                    path, ("TRAIN_CONFIG", TrainConfig))
  model_file, d_model = RUN_MODELS.get(path, ("gin/models/tiny.gin", 64))
  # As users run them: the model file, then the run file that adapts it. A pod preset
  # (gin/runs/pods/) includes its own model and is taken alone.
  files = [model_file, path] if path in RUN_MODELS else [path, model_file]
  if path.startswith("gin/runs/pods/"):
    files, d_model = [path], None
  if path in ADD_ONS:
    files = [ADD_ONS[path], model_file, path]
  # A PEFT run starts from BASE, and refuses INITIAL_CHECKPOINT_PATH (full finetuning's).
  start = "BASE='/tmp/base'" if path in PEFT_RUNS else "INITIAL_CHECKPOINT_PATH='/tmp/pretrained'"
  gin_config.parse(files, [
      "MODEL_DIR='/tmp/run'", "MIXTURE_OR_TASK_NAME='stdlib_span_corruption'", start,
      "TRAIN_STEPS=2000000", "CHECKPOINT_PATH='/tmp/run'", "TEACHER='/tmp/teacher'"])
  config = gin_config.run_config(macro, cls, path)
  if path in PEFT_RUNS:
    assert config.peft.base == "/tmp/base" and config.peft.adapter.method == PEFT_RUNS[path]
  if path == "gin/runs/wandb.gin":
    assert config.wandb is not None and config.wandb.mode is None
  if cls is TrainConfig:
    assert config.model_dir == "/tmp/run" and config.train_steps == 2000000
    for name in T5X_MACROS:  # T5X users' scripts can rely on these names
      assert gin_config.macro(name, default=KeyError) is not KeyError, name
    assert d_model is None or gin_config.model_config().d_model == d_model
  else:
    assert config.checkpoint_path == "/tmp/run" and config.decode.method == "greedy"


def test_finetune_overrides_pretraining_defaults():
  gin_config.parse(["gin/runs/finetune.gin", "gin/models/t5_1_1/base.gin"],
                   ["MODEL_DIR='/tmp/ft'", "MIXTURE_OR_TASK_NAME='x'",
                    "INITIAL_CHECKPOINT_PATH='/tmp/pre'"])
  config = gin_config.train_config()
  # DROPOUT_RATE lands in the model config: the one dropout rate of a run.
  assert gin_config.model_config().dropout_rate == 0.1
  assert config.optimizer.schedule.name == "constant"
  assert config.optimizer.schedule.value == 1e-3 and config.initial_checkpoint_path == "/tmp/pre"
  assert config.task_feature_lengths == {"inputs": 512, "targets": 128}


def test_shipped_includes_resolve_beside_folders_named_like_them(tmp_path, monkeypatch):
  """A runs/ or models/ folder in the current folder (the demo writes runs/) is a namespace
  package to Python; gin's package reader used to crash on `include 'runs/pretrain.gin'`."""
  for name in ("runs", "models"):
    (tmp_path / name).mkdir()
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))  # `python -m t5lite.cli` puts the cwd first
  gin_config.parse(["gin/runs/demo_finetune.gin"], ["MODEL_DIR='/tmp/x'",
                                                   "INITIAL_CHECKPOINT_PATH='/tmp/y'"])
  assert gin_config.train_config().mixture_or_task_name == "stdlib_docstring_summary"
  assert gin_config.model_config().d_model == 128
