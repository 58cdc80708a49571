"""ModelConfig validation, aliases and JSON round trips."""
import json

import pytest

from t5lite.errors import ConfigError
from t5lite.models import ModelConfig
from t5lite.models.electra_config import ElectraConfig
from t5lite.models.span_boundary_config import SpanBoundaryConfig
from t5lite.runtime import model_dir


def test_defaults_are_t5_v1_1_small():
  c = ModelConfig()
  assert (c.d_model, c.d_ff, c.num_heads, c.d_kv, c.num_encoder_layers) == (512, 1024, 6, 64, 8)
  assert c.mlp_activation == "gated-gelu" and not c.tie_output_embedding and not c.scale_logits


def test_geglu_alias_and_json_round_trip():
  c = ModelConfig(mlp_activation="geglu", scan_layers=True, dtype="bfloat16")
  assert c.mlp_activation == "gated-gelu"
  assert ModelConfig.from_json(c.to_json()) == c


@pytest.mark.parametrize("changes, message", [
    (dict(architecture="seq2seq"), "architecture"),
    (dict(mlp_activation="tanh"), "mlp_activation"),
    (dict(norm="batch"), "norm"),
    (dict(position_encoding="alibi"), "position_encoding"),
    (dict(dtype="int8"), "dtype"),
    (dict(d_model=0), "d_model"),
    (dict(prefix_lm=True), "prefix_lm"),
    (dict(position_encoding="rope", d_kv=7), "even d_kv"),
    (dict(dropout_rate=1.0), "dropout_rate"),
    (dict(architecture="encoder_only", num_encoder_layers=0), "num_encoder_layers"),
    # T5's log-spaced buckets divide by what is left: 1 bucket crashed with ZeroDivisionError.
    (dict(relative_attention_num_buckets=1), "relative_attention_num_buckets=1 must be >= 4"),
    (dict(relative_attention_num_buckets=8, relative_attention_max_distance=4),
     "relative_attention_max_distance=4 > num_buckets // 2"),
])
def test_invalid_values_name_the_field(changes, message):
  with pytest.raises(ValueError, match=message):
    ModelConfig(**changes)


def test_from_dict_rejects_unknown_fields():
  with pytest.raises(ValueError, match="unknown ModelConfig fields \\['d_modle'\\]"):
    ModelConfig.from_dict({"d_modle": 3})


# --- family sub-configs (ElectraConfig, SpanBoundaryConfig) and old MODEL_DIRs ----------------

ENCODER = dict(architecture="encoder_only", vocab_size=97, d_model=48, d_ff=96, num_heads=3,
               d_kv=16, num_encoder_layers=2, norm="layer", norm_position="post")
OLD_DEFAULTS = dict(replaced_token_detection=False, generator_hidden_fraction=0.0,
                    discriminator_loss_weight=50.0, span_boundary_objective=False,
                    max_span_length=10)


def old_model_config_json(path, family, **old_keys):
  """A model_config.json as t5lite wrote it before ELECTRA's and SpanBERT's options moved
  into sub-configs: every field at the top level, the five old keys included (defaults too),
  no 'electra' or 'span_boundary' key."""
  values = ModelConfig(**ENCODER, family=family).to_dict()
  del values["electra"], values["span_boundary"]
  values.update(OLD_DEFAULTS, **old_keys)
  path.mkdir()
  (path / "model_config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("family, old_keys, new", [
    ("electra", dict(replaced_token_detection=True, generator_hidden_fraction=0.25,
                     discriminator_loss_weight=30.0),
     dict(electra=ElectraConfig(generator_hidden_fraction=0.25, discriminator_loss_weight=30.0))),
    ("electra", dict(replaced_token_detection=True), dict(electra=ElectraConfig())),
    ("electra", {}, {}),  # a lone generator (HF's ElectraForMaskedLM): a plain MLM
    ("bert", dict(span_boundary_objective=True, max_span_length=30),
     dict(span_boundary=SpanBoundaryConfig(max_span_length=30))),
    ("bert", dict(max_span_length=4), {}),  # without the objective the length did nothing
    ("bert", {}, {}),
])
def test_an_old_model_dir_loads_into_the_sub_configs(tmp_path, family, old_keys, new):
  """MODEL_DIRs written before the move keep loading (and resuming: check_compatible), as the
  same model; saved again, the file is in the new form and round-trips exactly."""
  old_model_config_json(tmp_path / "old", family, **old_keys)
  expected = ModelConfig(**ENCODER, family=family, **new)
  loaded = model_dir.load_model_config(tmp_path / "old")
  assert loaded == expected
  model_dir.check_compatible(tmp_path / "old", expected)
  model_dir.prepare(tmp_path / "new", loaded, None)
  text = (tmp_path / "new" / "model_config.json").read_text()
  assert not set(OLD_DEFAULTS) & set(json.loads(text))
  again = model_dir.load_model_config(tmp_path / "new")
  assert again == expected and again.to_json() + "\n" == text


def test_sub_configs_round_trip_through_json_exactly():
  config = ModelConfig(**ENCODER, family="electra", electra=ElectraConfig(1 / 3, 7.5))
  assert ModelConfig.from_json(config.to_json()) == config
  assert json.loads(config.to_json())["electra"] == {"generator_hidden_fraction": 1 / 3,
                                                     "discriminator_loss_weight": 7.5,
                                                     "sampling_temperature": 1.0}
  # A config saved before sampling_temperature existed loads with ELECTRA's 1.0.
  saved = json.loads(config.to_json())
  del saved["electra"]["sampling_temperature"]
  assert ModelConfig.from_dict(saved) == config
  spanbert = ModelConfig(**ENCODER, span_boundary=SpanBoundaryConfig(max_span_length=3))
  assert ModelConfig.from_json(spanbert.to_json()) == spanbert
  assert ModelConfig.from_json(ModelConfig().to_json()) == ModelConfig()


def test_old_and_new_keys_together_or_a_lone_generator_fraction_are_refused():
  values = ModelConfig(**ENCODER).to_dict()
  with pytest.raises(ConfigError, match=r"\['replaced_token_detection'\].*electra"):
    ModelConfig.from_dict(dict(values, replaced_token_detection=True))
  del values["electra"]
  with pytest.raises(ConfigError, match="generator_hidden_fraction=0.5 with "
                                        "replaced_token_detection=false"):
    ModelConfig.from_dict(dict(values, generator_hidden_fraction=0.5))
  with pytest.raises(ConfigError, match=r"unknown ElectraConfig fields \['replaced'\]"):
    ModelConfig.from_dict(dict(values, electra={"replaced": True}))


@pytest.mark.parametrize("make, message", [
    (lambda: ElectraConfig(generator_hidden_fraction=-0.5),
     r"ElectraConfig.generator_hidden_fraction must be a number >= 0, got -0.5"),
    (lambda: ElectraConfig(discriminator_loss_weight=float("nan")),
     r"ElectraConfig.discriminator_loss_weight must be a number >= 0, got nan"),
    (lambda: SpanBoundaryConfig(max_span_length=0),
     r"SpanBoundaryConfig.max_span_length must be an integer >= 1, got 0"),
    (lambda: ModelConfig(electra=ElectraConfig()), "encoder_only"),
    (lambda: ModelConfig(**ENCODER, pooler=True, electra=ElectraConfig()), "fix pooler"),
    (lambda: ModelConfig(**ENCODER, electra=ElectraConfig(),
                         span_boundary=SpanBoundaryConfig()), "fix span_boundary"),
    (lambda: ModelConfig(**ENCODER, electra=ElectraConfig(generator_hidden_fraction=2.0)),
     r"hidden size 96 \(ElectraConfig.generator_hidden_fraction=2.0 x d_model=48\)"),
    (lambda: ModelConfig(**ENCODER, head="token_classification",
                         span_boundary=SpanBoundaryConfig()),
     "architecture='encoder_only', head='token_classification'"),
    (lambda: ModelConfig(**ENCODER, electra={"generator_hidden_fraction": 0.25}),
     "ModelConfig.electra must be an ElectraConfig or None, got dict"),
])
def test_bad_sub_config_settings_name_their_values(make, message):
  with pytest.raises(ConfigError, match=message):
    make()


def test_an_old_distillation_record_names_the_same_teacher(tmp_path):
  """A distillation MODEL_DIR recorded before the move (its teacher_config in the old keys)
  resumes with the same teacher and still refuses another one."""
  from t5lite.train.recipes import teacher as teacher_lib
  old_model_config_json(tmp_path / "teacher", "electra", replaced_token_detection=True,
                        generator_hidden_fraction=0.25)
  old_config = json.loads((tmp_path / "teacher" / "model_config.json").read_text())
  config = ModelConfig(**ENCODER, family="electra", electra=ElectraConfig(0.25))
  record = {"teacher": str(tmp_path / "teacher"), "teacher_config": config.to_dict(),
            "teacher_fingerprint": "f" * 16}
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / teacher_lib.RECORD_FILE).write_text(json.dumps(
      {**record, "teacher_config": old_config}))
  teacher_lib.check_record(str(tmp_path / "run"), record)
  other = {**record, "teacher_config": config.replace(d_model=config.d_model * 2).to_dict()}
  with pytest.raises(ConfigError, match="teacher_config differ"):
    teacher_lib.check_record(str(tmp_path / "run"), other)


@pytest.mark.parametrize("text", ["{", '{"mixture_or_task_name": "t"}',
                                  '{"mixture_or_task_name": "t", "task_feature_lengths": [64]}',
                                  '{"mixture_or_task_name": 3, "task_feature_lengths": {}}'])
def test_a_damaged_task_record_is_named_in_one_line(tmp_path, text):
  """task.json (what a run trained on: `t5lite infer` reads it) round-trips; a damaged one is
  a ConfigError naming the file; a folder without one (an older MODEL_DIR) gives None."""
  assert model_dir.load_task_record(tmp_path) is None
  model_dir.prepare(tmp_path, ModelConfig(), None, task=("a_task", {"inputs": 7, "targets": 3}))
  assert model_dir.load_task_record(tmp_path) == {
      "mixture_or_task_name": "a_task", "task_feature_lengths": {"inputs": 7, "targets": 3}}
  (tmp_path / "task.json").write_text(text)
  with pytest.raises(ConfigError, match=r"task\.json is damaged .*: remove it") as error:
    model_dir.load_task_record(tmp_path)
  assert "\n" not in str(error.value)
