"""HF encoder models for parity tests: CASES (BERT, RoBERTa, two ALBERTs of odd shapes) and
make_hf_model, a random one with every parameter moved off its init. Imports torch and
transformers: only parity tests import this module."""
import torch
import transformers

T = transformers
SIZES = dict(intermediate_size=44, max_position_embeddings=40)
# name: (HF config class, model class, auto class, config kwargs). Odd widths and head counts,
# erf and tanh GELU, a non-default epsilon, 3 token types, 1 group with E == H (ALBERT projects
# anyway) and 2 groups of 2 with E != H.
CASES = {
    "bert": (T.BertConfig, T.BertForPreTraining, T.AutoModelForPreTraining,
             dict(vocab_size=53, hidden_size=30, num_hidden_layers=3, num_attention_heads=5,
                  type_vocab_size=3, **SIZES)),
    "roberta": (T.RobertaConfig, T.RobertaForMaskedLM, T.AutoModelForMaskedLM,
                dict(vocab_size=71, hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                     type_vocab_size=1, layer_norm_eps=1e-5, **SIZES)),
    "albert_one_group": (T.AlbertConfig, T.AlbertForPreTraining, T.AutoModelForPreTraining,
                         dict(vocab_size=61, embedding_size=30, hidden_size=30,
                              num_hidden_layers=3, num_hidden_groups=1, num_attention_heads=5,
                              type_vocab_size=3, **SIZES)),
    "albert_two_groups": (T.AlbertConfig, T.AlbertForPreTraining, T.AutoModelForPreTraining,
                          dict(vocab_size=97, embedding_size=10, hidden_size=36,
                               num_hidden_layers=4, num_hidden_groups=2, inner_group_num=2,
                               num_attention_heads=3, type_vocab_size=2, **SIZES)),
}


def make_hf_model(name, seed=0):
  config_cls, model_cls, _, kwargs = CASES[name]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**kwargs)).eval()
  with torch.no_grad():  # biases off 0 and norm scales off 1, so that a swapped one shows
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  return model


def assert_gradients_match(config, grads, model, skip=(), tolerance=1e-5) -> int:
  """Every gradient of the HF torch `model` (after its backward) equals t5lite's `grads` for
  `config`, mapped to HF names by the same layout that exports params: within tolerance x
  max(1, the tensor's largest |gradient|). Names starting with a prefix in `skip` are left
  out; tied weights count once (under their first name). Returns how many were compared."""
  import numpy as np

  from t5lite.interop.hf.checkpoints import params_to_hf
  ours = params_to_hf(config, grads)
  compared = 0
  for name, param in model.named_parameters():
    if name.startswith(tuple(skip)):
      continue
    assert name in ours, f"{name} has no t5lite gradient"
    expected = param.grad.double().numpy()
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(np.asarray(ours[name], np.float64), expected, rtol=0,
                               atol=tolerance * scale, err_msg=name)
    compared += 1
  return compared
