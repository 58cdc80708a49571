"""ModelConfig validation, aliases and JSON round trips."""
import pytest

from t5lite.models import ModelConfig


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
