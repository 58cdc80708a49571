"""The landmark model files (gin/models/{bert,roberta,albert,gpt2,llama_style,transformer}/)
parse, build and are the published models.

Each published size has the parameter count that HF transformers counts for the same model
(built on torch's meta device: no memory, no weights; tied parameters counted once), and,
where the HF layout exists (t5lite.interop.hf.<type>), exactly the ModelConfig that importing
the published config.json gives. The original Transformer has no HF class: its count is
re-derived here from the paper's layout.
"""
import pytest

from t5lite import count_params
from t5lite.cli import gin_config
from t5lite.families import family_of
from t5lite.models import abstract_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# file -> the family it names
FAMILIES = {
    "gin/models/bert/tiny.gin": "bert",
    "gin/models/bert/base.gin": "bert",
    "gin/models/bert/large.gin": "bert",
    "gin/models/roberta/base.gin": "roberta",
    "gin/models/albert/base.gin": "albert",
    "gin/models/albert/large.gin": "albert",
    "gin/models/gpt2/small.gin": "gpt2",
    "gin/models/gpt2/medium.gin": "gpt2",
    "gin/models/llama_style/tiny.gin": "llama",
    "gin/models/transformer/base.gin": "encoder_decoder",
}
LARGE = ("gin/models/bert/large.gin", "gin/models/albert/large.gin", "gin/models/gpt2/medium.gin")

_ALBERT_BASE = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                    embedding_size=128)  # AlbertConfig() is xxlarge; albert-base-v2's sizes
# file -> (HF class name, its config class name, the published config's values; HF's
# defaults give the rest: BertConfig() is bert-base-uncased, GPT2Config() is gpt2)
PUBLISHED = {
    "gin/models/bert/base.gin": ("BertForPreTraining", "BertConfig", {}),
    "gin/models/bert/large.gin": ("BertForPreTraining", "BertConfig", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)),
    "gin/models/roberta/base.gin": ("RobertaForMaskedLM", "RobertaConfig", dict(
        max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5)),
    "gin/models/albert/base.gin": ("AlbertForPreTraining", "AlbertConfig", _ALBERT_BASE),
    "gin/models/albert/large.gin": ("AlbertForPreTraining", "AlbertConfig", dict(
        _ALBERT_BASE, hidden_size=1024, num_attention_heads=16, intermediate_size=4096,
        num_hidden_layers=24)),
    "gin/models/gpt2/small.gin": ("GPT2LMHeadModel", "GPT2Config", {}),
    "gin/models/gpt2/medium.gin": ("GPT2LMHeadModel", "GPT2Config", dict(
        n_embd=1024, n_layer=24, n_head=16)),
}
# The counts HF reports (and the gin files' opening comments quote).
HF_COUNTS = {
    "gin/models/bert/base.gin": 110_106_428,
    "gin/models/bert/large.gin": 336_226_108,
    "gin/models/roberta/base.gin": 124_697_433,
    "gin/models/albert/base.gin": 11_813_810,
    "gin/models/albert/large.gin": 17_847_474,
    "gin/models/gpt2/small.gin": 124_439_808,
    "gin/models/gpt2/medium.gin": 354_823_168,
}


def slow_if_large(path):
  return pytest.param(path, marks=pytest.mark.slow) if path in LARGE else path


def model_config(path):
  gin_config.parse([path])
  return gin_config.model_config()


def hf_config(path):
  _, config_class, values = PUBLISHED[path]
  return getattr(transformers, config_class)(**values)


def hf_count(model_class: str, config) -> int:
  with torch.device("meta"):
    model = getattr(transformers, model_class)(config)
  return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


def test_every_landmark_file_ships_and_test_gin_builds_it():
  from helpers.gin_files import MODEL_FILES  # test_gin parametrizes over these
  assert set(FAMILIES) <= set(MODEL_FILES)
  assert set(PUBLISHED) <= set(FAMILIES) and set(HF_COUNTS) == set(PUBLISHED)


@pytest.mark.parametrize("path", [slow_if_large(f) for f in FAMILIES])
def test_file_parses_builds_and_names_its_family(path):
  config = model_config(path)
  assert config.family_name == FAMILIES[path]
  assert family_of(config).name == FAMILIES[path]
  assert count_params(abstract_params(config)) > 0
  if not config.shared_layer_groups:  # shared layers run unscanned (ModelConfig refuses both)
    assert count_params(config.replace(scan_layers=True)) == count_params(config)


@pytest.mark.parity
@pytest.mark.parametrize("path", [slow_if_large(f) for f in PUBLISHED])
def test_parameter_count_equals_hf(path):
  model_class, _, _ = PUBLISHED[path]
  ours, hf = count_params(model_config(path)), hf_count(model_class, hf_config(path))
  assert ours == hf == HF_COUNTS[path], (ours, hf)


@pytest.mark.parametrize("path", [slow_if_large(f) for f in PUBLISHED])
def test_config_is_what_importing_the_published_config_json_gives(path):
  """The gin file says exactly what t5lite's HF layout reads from the published model's
  config.json, and exports back without a refusal."""
  from t5lite.interop.hf import checkpoints as hf
  from t5lite.interop.hf import layout as hf_layout
  hf_dict = hf_config(path).to_dict()
  assert hf_dict["model_type"] in hf_layout.supported()
  ours = model_config(path)
  imported = hf.config_from_hf(hf_dict)
  differ = {f: (getattr(ours, f), getattr(imported, f)) for f in ours.to_dict()
            if getattr(ours, f) != getattr(imported, f)}
  assert not differ, differ
  hf.config_to_hf(ours)


@pytest.mark.parity
def test_tiny_configs_match_hf_counts():
  """bert/tiny and llama_style/tiny are the same models as HF's of the same sizes."""
  bert = model_config("gin/models/bert/tiny.gin")
  assert count_params(bert) == hf_count("BertForPreTraining", transformers.BertConfig(
      vocab_size=bert.vocab_size, hidden_size=bert.d_model, intermediate_size=bert.d_ff,
      num_attention_heads=bert.num_heads, num_hidden_layers=bert.num_encoder_layers))
  llama = model_config("gin/models/llama_style/tiny.gin")
  assert count_params(llama) == hf_count("LlamaForCausalLM", transformers.LlamaConfig(
      vocab_size=llama.vocab_size, hidden_size=llama.d_model, intermediate_size=llama.d_ff,
      num_attention_heads=llama.num_heads, num_key_value_heads=llama.num_key_value_heads,
      num_hidden_layers=llama.num_decoder_layers, head_dim=llama.d_kv))


@pytest.mark.parametrize("path", ["gin/models/bert/tiny.gin", "gin/models/llama_style/tiny.gin"])
def test_tiny_configs_export_and_import_unchanged(path):
  """Their HF config.json (the family's layout) reads back as the very same config."""
  from t5lite.interop.hf import checkpoints as hf
  ours = model_config(path)
  assert hf.config_from_hf(hf.config_to_hf(ours)) == ours


def transformer_params(vocab, d, ff, heads, d_kv, encoder_layers, decoder_layers) -> int:
  """The original Transformer's parameters (Vaswani et al. 2017, post-LN with biases): one
  embedding table shared by encoder, decoder and the output projection, no parameters in the
  sinusoidal positions, no final norm."""
  inner = heads * d_kv
  attention = 3 * (d * inner + inner) + (inner * d + d)  # q, k, v and the output, with biases
  ffn = (d * ff + ff) + (ff * d + d)
  norm = 2 * d  # LayerNorm scale and bias
  encoder_layer = attention + ffn + 2 * norm
  decoder_layer = 2 * attention + ffn + 3 * norm  # self-attention, cross-attention, FFN
  return vocab * d + encoder_layers * encoder_layer + decoder_layers * decoder_layer


def test_the_original_transformer_has_its_derived_count():
  config = model_config("gin/models/transformer/base.gin")
  assert (config.d_model, config.d_ff, config.num_heads, config.d_kv) == (512, 2048, 8, 64)
  assert (config.num_encoder_layers, config.num_decoder_layers) == (6, 6)
  derived = transformer_params(config.vocab_size, 512, 2048, 8, 64, 6, 6)
  assert count_params(config) == derived == 63_082_496
  # The paper's layout, field by field.
  assert (config.norm, config.norm_position, config.use_bias, config.mlp_activation,
          config.position_encoding, config.scale_embeddings, config.tie_output_embedding,
          config.scale_logits, config.scale_attention, config.dropout_rate) == (
              "layer", "post", True, "relu", "sinusoidal_interleaved", True, True, False, True,
              0.1)
  # Tiny overrides change the count as the derivation says (the tests train it so).
  tiny = config.replace(vocab_size=256, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                        num_encoder_layers=2, num_decoder_layers=1)
  assert count_params(tiny) == transformer_params(256, 32, 64, 4, 8, 2, 1)
