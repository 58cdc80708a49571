"""HF transformers' PyTorch BERT and GPT-2 train steps: the baselines of
`t5lite bench train --family bert|gpt2`.

    bert   BertForPreTraining(input_ids, attention_mask, token_type_ids, labels,
           next_sentence_label).loss        # MLM mean CE over labels != -100 + NSP mean CE
    gpt2   GPT2LMHeadModel(input_ids, labels=input_ids).loss   # mean CE of next tokens

Each side's model comes from one HF config.json dict (`hf_config`): HF builds its model from it;
t5lite's ModelConfig is what the family's HF layout reads from it (`t5lite_config`), so both are
the same network. HF's weights are t5lite's init, converted by the layout (params_to_hf) and
loaded with load_state_dict, so both start identical. The step is HFTrainer's
(hf_t5_train): loss.backward(), fused torch AdamW (rank >= 2 params decay, as t5lite's AdamW),
zero_grad(set_to_none=True); no clipping, no dropout (0 in the config on both sides).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from t5lite.bench.hf_t5_train import HFTrainer, IGNORE_INDEX
from t5lite.models.config import ModelConfig

FAMILIES = ("bert", "gpt2")
VOCAB = {"bert": 30522, "gpt2": 50257}  # bert-base-uncased's WordPiece, GPT-2's BPE
# hidden, layers, heads, FF: the same small fp32 shape as the T5 bench's 'bench' model.
SIZES = {"bench": dict(hidden=256, layers=4, heads=4, ff=1024),
         "tiny": dict(hidden=32, layers=1, heads=4, ff=64, vocab=128)}
MAX_POSITIONS = 512


def hf_config(family: str, size: str = "bench", max_positions: int = MAX_POSITIONS) -> dict:
  """The HF config.json dict of a family at a size (no dropout: both sides deterministic)."""
  s = SIZES[size]
  vocab = s.get("vocab", VOCAB[family])
  if family == "bert":
    return {"model_type": "bert", "architectures": ["BertForPreTraining"], "vocab_size": vocab,
            "hidden_size": s["hidden"], "num_hidden_layers": s["layers"],
            "num_attention_heads": s["heads"], "intermediate_size": s["ff"], "hidden_act": "gelu",
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "max_position_embeddings": max_positions, "type_vocab_size": 2,
            "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0}
  if family == "gpt2":
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
            "n_embd": s["hidden"], "n_layer": s["layers"], "n_head": s["heads"],
            "n_inner": s["ff"], "n_positions": max_positions,
            "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "tie_word_embeddings": True, "bos_token_id": vocab - 1, "eos_token_id": vocab - 1}
  raise ValueError(f"family {family!r} is not one of {FAMILIES}")


def t5lite_config(hf: dict, dtype: str = "float32") -> ModelConfig:
  """The t5lite ModelConfig equal to an HF config dict (the family's HF layout reads it)."""
  from t5lite.interop.hf import checkpoints as hf_export  # imports (registers) every layout
  return hf_export.config_from_hf(hf).replace(dtype=dtype, dropout_rate=0.0)


def hf_tensors(config: ModelConfig, params) -> dict[str, np.ndarray]:
  """t5lite params as the HF model's state dict (numpy)."""
  from t5lite.interop.hf import checkpoints as hf_export
  return hf_export.params_to_hf(config, params)


def model_from_t5lite(hf: dict, config: ModelConfig, params, device: str = "cpu"):
  """The HF model of config dict `hf` holding t5lite's params, in train mode. Every tensor of
  its state dict is loaded except those tied to a loaded one (lm_head / the MLM decoder)."""
  import torch
  import transformers
  transformers.utils.logging.set_verbosity_error()
  cls, config_cls = {"bert": (transformers.BertForPreTraining, transformers.BertConfig),
                     "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config)
                     }[hf["model_type"]]
  hf_cfg = config_cls(**{k: v for k, v in hf.items() if k != "model_type"})
  hf_cfg._attn_implementation = "sdpa"  # HF's default and its fastest on CPU
  model = cls(hf_cfg).to(torch.float32)
  tensors = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in
             hf_tensors(config.replace(dtype="float32", param_dtype="float32"), params).items()}
  result = model.load_state_dict(tensors, strict=False)
  tied = {"lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
  missing = [k for k in result.missing_keys if k not in tied and not k.endswith("position_ids")]
  if missing or result.unexpected_keys:
    raise AssertionError(f"HF {cls.__name__}: missing {missing}, unexpected "
                         f"{result.unexpected_keys}")
  model.tie_weights()
  return model.to(device).train()


class HFFamilyTrainer(HFTrainer):
  """HFTrainer's step, optimizer and helpers on BertForPreTraining / GPT2LMHeadModel."""

  def __init__(self, hf: dict, config: ModelConfig, params, **settings):
    """settings: HFTrainer's (learning_rate, b1, b2, eps, weight_decay, device, num_threads)."""
    self.hf = hf
    super().__init__(config, params, **settings)

  def make_model(self, config: ModelConfig, params, device: str):
    return model_from_t5lite(self.hf, config, params, device)


def useful_tokens(batch: dict[str, Any]) -> int:
  """Tokens an HF batch trains on: every input position (no padding in these batches)."""
  return int(np.asarray(batch["input_ids"]).size)


__all__ = ["FAMILIES", "HFFamilyTrainer", "IGNORE_INDEX", "hf_config", "hf_tensors",
           "model_from_t5lite", "t5lite_config", "useful_tokens"]
