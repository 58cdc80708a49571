"""Every HF layout either carries a ModelConfig option through export and import or refuses it
by name: no option that changes a model's numbers is dropped silently. Also the untrusted-input
guards of the layouts and of HF tokenizer folders."""
import json
import os

import jax
import numpy as np
import pytest

import t5lite
from t5lite.errors import ConfigError
from t5lite.interop.hf import layout as hf_layout
from t5lite.cli.imports import hf_vocabulary
from t5lite.models import abstract_params
from t5lite.models.span_boundary_config import SpanBoundaryConfig

BASES = {  # tiny config.json of each model type; each layout fills in its defaults
    "t5": dict(model_type="t5", vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_layers=1,
               num_heads=4, feed_forward_proj="gated-gelu"),
    "bert": dict(model_type="bert", vocab_size=64, hidden_size=16, num_hidden_layers=1,
                 num_attention_heads=4, intermediate_size=24, max_position_embeddings=32),
    "roberta": dict(model_type="roberta", vocab_size=64, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=4, intermediate_size=24, max_position_embeddings=34,
                    type_vocab_size=1),
    "albert": dict(model_type="albert", vocab_size=64, embedding_size=8, hidden_size=16,
                   num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
                   max_position_embeddings=32),
    "gpt2": dict(model_type="gpt2", vocab_size=64, n_embd=16, n_layer=1, n_head=4,
                 n_positions=32, bos_token_id=63, eos_token_id=63),
    "llama": dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
}
# (field, values to try): each either round-trips or is refused.
PERTURBATIONS = [
    ("norm", ["rms", "layer"]), ("norm_position", ["pre", "post"]), ("use_bias", [True, False]),
    ("scale_attention", [True, False]), ("layer_norm_epsilon", [1e-3]),
    ("mlp_activation", ["relu", "gelu", "gelu_exact", "gated-gelu", "swiglu"]),
    ("position_encoding", ["relative_bias", "sinusoidal", "sinusoidal_interleaved", "learned",
                           "rope"]),
    ("num_key_value_heads", [0, 2]), ("d_kv", [6]), ("type_vocab_size", [0, 3]),
    ("embedding_norm", [True, False]), ("scale_embeddings", [True, False]),
    ("embedding_size", [0, 8, 16]), ("shared_layer_groups", [0, 1]),
    ("pooler", [True, False]), ("sentence_classes", [0, 2]),
    ("tie_output_embedding", [True, False]), ("scale_logits", [True, False]),
    ("position_offset", [0, 2]), ("rope_theta", [500.0]),
    ("relative_attention_num_buckets", [8]), ("bos_id", [3]), ("eos_id", [4]),
    ("prefix_lm", [True]), ("lm_loss_weight", [0.5]),
    ("span_boundary", [SpanBoundaryConfig(), SpanBoundaryConfig(max_span_length=3)]),
]
# The finetuning heads' options, walked from each head model of each layout (hf_heads).
HEAD_PERTURBATIONS = [
    ("head", ["sequence_classification", "token_classification", "question_answering",
              "multiple_choice"]),
    ("num_labels", [1, 5]),
    ("problem_type", ["single_label_classification", "multi_label_classification",
                      "regression"]),
    ("classifier_dropout", [0.0, 0.3]), ("pooler", [True, False]),
    ("tie_output_embedding", [False]), ("lm_loss_weight", [0.5]),
    ("span_boundary", [SpanBoundaryConfig(), SpanBoundaryConfig(max_span_length=3)]),
]


def effective(config):
  """The fields that decide a model's numbers (those that do not apply are left out)."""
  c = config
  out = {f: getattr(c, f) for f in (
      "architecture", "vocab_size", "d_model", "d_ff", "num_heads", "d_kv", "kv_heads", "norm",
      "norm_position", "use_bias", "scale_attention", "layer_norm_epsilon", "mlp_activation",
      "position_encoding", "type_vocab_size", "embedding_size", "embedding_norm",
      "scale_embeddings", "shared_layer_groups", "pooler", "sentence_classes",
      "tie_output_embedding", "scale_logits", "bos_id", "eos_id", "prefix_lm", "head",
      "problem_type", "lm_loss_weight", "span_boundary")}
  out["encoder_layers"] = c.num_encoder_layers if c.has_encoder else 0
  out["decoder_layers"] = c.num_decoder_layers if c.has_decoder else 0
  if c.shared_layer_groups == c.num_encoder_layers and c.layers_per_group == 1:
    out["shared_layer_groups"] = 0  # a group per layer of one layer each: no sharing
  if out["shared_layer_groups"]:
    out["layers_per_group"] = c.layers_per_group
  if not c.has_decoder:  # an encoder decodes nothing: no start or end token
    del out["bos_id"], out["eos_id"]
  if c.head in ("token_classification", "question_answering"):
    del out["pooler"]  # these heads read no pooler (HF builds them without one)
  if c.position_encoding == "learned":
    out.update(max_position_embeddings=c.max_position_embeddings,
               position_offset=c.position_offset)
  if c.position_encoding == "rope":
    out["rope_theta"] = c.rope_theta
  if c.head:  # no MLM / LM decoder: tying changes nothing
    del out["tie_output_embedding"]
  if c.head in ("sequence_classification", "token_classification"):
    out["num_labels"] = c.num_labels  # QA has 2 outputs, multiple choice 1, whatever it says
  if c.head and c.head != "question_answering" and c.has_encoder:  # decoders' have no dropout
    out["classifier_dropout"] = (c.dropout_rate if c.classifier_dropout is None
                                 else c.classifier_dropout)
  if c.position_encoding == "relative_bias":
    out.update(buckets=c.relative_attention_num_buckets,
               distance=c.relative_attention_max_distance)
  return out


def walk(base, perturbations, tmp_path):
  """(carried, refused): each perturbed config through save_hf and load_hf, asserting that
  it comes back with the same effective fields or is refused by name."""
  carried = refused = 0
  for field, values in perturbations:
    for value in values:
      try:
        changed = base.replace(**{field: value})
      except ConfigError:
        continue  # not a model at all (e.g. an encoder-only option on a decoder)
      out = tmp_path / f"{field}-{value}"
      try:
        # Zeros of the right shapes: what is checked is the layout, not the numbers.
        params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract_params(changed))
        t5lite.save_hf(changed, params, str(out))
      except ConfigError as e:
        refused += 1
        assert field in str(e) or "cannot" in str(e) or "no equivalent" in str(e), str(e)
        continue
      loaded, _ = t5lite.load_hf(str(out))
      assert effective(loaded) == effective(changed), (field, value)
      carried += 1
  return carried, refused


@pytest.mark.parametrize("model_type", sorted(BASES))
def test_every_option_round_trips_or_is_refused_by_name(model_type, tmp_path):
  base = hf_layout.for_model_type(model_type).config_from_hf(BASES[model_type], None)
  carried, refused = walk(base, PERTURBATIONS, tmp_path)
  assert carried and refused  # each layout both maps and refuses options


@pytest.mark.parametrize("model_type", sorted(set(BASES) - {"t5"}))
def test_every_head_option_round_trips_or_is_refused_by_name(model_type, tmp_path):
  """From each head model a layout has (with the pooler HF's class has), every head option."""
  layout = hf_layout.for_model_type(model_type)
  pretraining = layout.config_from_hf(BASES[model_type], None)
  encoder = pretraining.architecture == "encoder_only"
  carried = refused = 0
  for head in layout.heads.heads:
    base = pretraining.replace(head=head, num_labels=3, **(
        dict(sentence_classes=0, pooler=head in layout.heads.pooled) if encoder else {}))
    c, r = walk(base, HEAD_PERTURBATIONS, tmp_path / head)
    carried, refused = carried + c, refused + r
  assert carried and refused


def test_an_hf_tokenizer_folder_cannot_point_outside_itself(tmp_path):
  """A vocabulary.json in an imported HF folder is not ours to follow: its file names could
  lead anywhere. import reads vocab.txt itself."""
  outside = tmp_path / "outside.txt"
  outside.write_text("[PAD]\nsecret\n")
  source = tmp_path / "hf"
  source.mkdir()
  (source / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n")
  (source / "vocabulary.json").write_text(json.dumps(
      {"kind": "wordpiece", "extra_ids": 0, "vocab_file": str(outside)}))
  vocabulary = hf_vocabulary(str(source))
  assert "hello" in vocabulary.tokens and "secret" not in vocabulary.tokens
  os.remove(source / "vocab.txt")
  os.symlink(outside, source / "merges.txt")
  (source / "vocab.json").write_text("{}")
  with pytest.raises(ConfigError, match="outside"):
    hf_vocabulary(str(source))


@pytest.mark.parametrize("change, named", [
    (dict(num_hidden_layers=10**9), "layer applications"),
    (dict(inner_group_num=10**6), "layer applications"),
    (dict(layer_norm_eps="abc"), "layer_norm_eps"),
    (dict(layer_norm_eps=-1.0), "layer_norm_eps"),
    (dict(initializer_range=[0.02]), "initializer_range"),
    (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
])
def test_bad_albert_sizes_and_numbers_are_refused_before_anything_is_built(change, named):
  with pytest.raises(ConfigError, match=named):
    hf_layout.for_model_type("albert").check_claim({**BASES["albert"], **change}, "config.json")


def test_bert_checkpoints_with_gamma_beta_names_or_no_pretraining_heads_load(tmp_path):
  """The original BERT release names LayerNorm tensors gamma/beta; BertForMaskedLM saves no
  pooler or next-sentence head: both load (the second as an MLM-only BERT)."""
  import safetensors.numpy
  import torch
  import transformers
  torch.manual_seed(0)
  hf = transformers.BertConfig(**{k: v for k, v in BASES["bert"].items() if k != "model_type"})
  for model in (transformers.BertForPreTraining(hf), transformers.BertForMaskedLM(hf)):
    path = tmp_path / type(model).__name__
    model.eval().save_pretrained(path)
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    renamed = {k.replace("LayerNorm.weight", "LayerNorm.gamma")
               .replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in tensors.items()}
    safetensors.numpy.save_file(renamed, path / "model.safetensors")
    config, params = t5lite.load_hf(str(path))
    assert config.pooler == isinstance(model, transformers.BertForPreTraining)
    ids = np.random.RandomState(0).randint(1, 64, (1, 7))
    with torch.no_grad():
      out = model(input_ids=torch.tensor(ids))
    want = (out.prediction_logits if config.pooler else out.logits).numpy()
    assert np.abs(t5lite.logits(config, params, ids) - want).max() <= 1e-4 * np.abs(want).max()
    back, info = type(model).from_pretrained(
        t5lite.save_hf(config, params, str(tmp_path / "out" / path.name)) and
        str(tmp_path / "out" / path.name), output_loading_info=True)
    assert not any(info.values()), info
