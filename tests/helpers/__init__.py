"""What tests share: tiny model configs, tree comparisons, a run's logged metrics, a tiny run.

Test modules import it by name (`from helpers import tiny, assert_trees_equal`): pytest puts
tests/ on sys.path. The small tasks the training tests run on are registered in one place,
tests/train_tasks.py, which subprocess runs also import (MIXTURE_OR_TASK_MODULE).
conftest.py keeps the environment setup (set before JAX is imported) and the fixtures.
"""
from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np

from t5lite.models import ModelConfig, make_model

TINY = dict(vocab_size=128, d_model=32, d_ff=64, num_heads=4, d_kv=8, num_encoder_layers=2,
            num_decoder_layers=2)
BYTE_VOCAB_SIZE = 384  # train_tasks.VOCAB's 359 ids (bytes + 100 extra ids), rounded up


def tiny(**changes) -> ModelConfig:
  """A tiny encoder-decoder (vocab 128, width 32, 2 + 2 layers) with changes."""
  return ModelConfig(**{**TINY, **changes})


def tiny_decoder_only(**changes) -> ModelConfig:
  """A tiny causal LM (RoPE, SwiGLU, 2 layers) over train_tasks' byte vocabulary; with
  prefix_lm=True a prefix LM."""
  return tiny(**{"architecture": "decoder_only", "vocab_size": BYTE_VOCAB_SIZE,
                 "num_encoder_layers": 0, "position_encoding": "rope",
                 "mlp_activation": "swiglu", **changes})


def tiny_encoder_only(**changes) -> ModelConfig:
  """A tiny BERT-style MLM (LayerNorm, learned positions up to 64, GELU, tied and scaled
  output embedding, 2 layers) over train_tasks' byte vocabulary."""
  return tiny(**{"architecture": "encoder_only", "vocab_size": BYTE_VOCAB_SIZE,
                 "num_decoder_layers": 0, "position_encoding": "learned", "norm": "layer",
                 "mlp_activation": "gelu", "tie_output_embedding": True, "scale_logits": True,
                 "max_position_embeddings": 64, **changes})


@functools.lru_cache(maxsize=None)
def jitted_apply(config: ModelConfig, enable_dropout: bool = False):
  """A cached jitted model.apply(params, **inputs) for a config."""
  model = make_model(config, enable_dropout=enable_dropout)

  @jax.jit
  def apply(params, inputs, rng=None):
    rngs = {"dropout": rng} if rng is not None else None
    return model.apply({"params": params}, **inputs, rngs=rngs)
  return apply


# --- trees ----------------------------------------------------------------------------------

def _leaves(tree) -> list[tuple[str, np.ndarray]]:
  return [(jax.tree_util.keystr(path), np.asarray(leaf))
          for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))]


def _paired_leaves(a, b):
  leaves_a, leaves_b = _leaves(a), _leaves(b)
  paths_a, paths_b = [p for p, _ in leaves_a], [p for p, _ in leaves_b]
  assert paths_a == paths_b, (f"different trees: only in the first {set(paths_a) - set(paths_b)}"
                              f", only in the second {set(paths_b) - set(paths_a)}")
  return [(path, x, y) for (path, x), (_, y) in zip(leaves_a, leaves_b)]


def assert_trees_equal(a, b) -> None:
  """Bitwise: the same paths and, at each leaf, the same dtype, shape and bytes (arrays on
  devices are fetched first). The failing leaf is named by its path."""
  for path, x, y in _paired_leaves(a, b):
    assert (x.dtype, x.shape) == (y.dtype, y.shape), (
        f"{path}: {x.dtype}{x.shape} != {y.dtype}{y.shape}")
    assert x.tobytes() == y.tobytes(), f"{path}: values differ"


def assert_trees_close(a, b, rtol: float = 1e-6, atol: float = 0.0) -> None:
  """np.testing.assert_allclose at every leaf (the same paths), naming the failing leaf."""
  for path, x, y in _paired_leaves(a, b):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=path)


def tree_digest(root) -> dict[str, str]:
  """Every file under root with the sha256 of its bytes, and every folder: equal digests mean
  a byte-identical tree."""
  import hashlib
  digest = {}
  for folder, dirs, files in os.walk(root):
    for d in dirs:
      digest[os.path.relpath(os.path.join(folder, d), root) + "/"] = "dir"
    for f in files:
      with open(os.path.join(folder, f), "rb") as handle:
        digest[os.path.relpath(os.path.join(folder, f), root)] = hashlib.sha256(
            handle.read()).hexdigest()
  return digest


# --- runs -----------------------------------------------------------------------------------

def quiet(_) -> None:
  """A `log` for train() that prints nothing."""


def metrics_records(model_dir) -> list[dict]:
  """MODEL_DIR/metrics.jsonl (a folder or a bucket URL), one dict per line, in order."""
  from t5lite.util import paths
  text = paths.read_text(paths.join(model_dir, "metrics.jsonl"))
  return [json.loads(line) for line in text.splitlines()]


def logged_losses(model_dir) -> dict[int, float]:
  """step -> training loss from metrics.jsonl; a step logged twice (re-run after a crash or a
  preemption) keeps its last record."""
  return {r["step"]: r["loss"] for r in metrics_records(model_dir) if r.get("loss") is not None}


def checkpoint_params(path) -> tuple[ModelConfig, dict, int]:
  """(model config, params as numpy arrays, step) of a MODEL_DIR's newest checkpoint or of a
  step folder."""
  from t5lite.runtime.model_dir import load_params
  config, params, step = load_params(path)
  return config, jax.device_get(params), step


def train_config(model_dir, **changes):
  """A tiny run's TrainConfig: 3 AdamW steps, batches of 8 from train_test_copy (64 / 16
  tokens), no evals; `changes` replace fields."""
  from t5lite.train.optimizers import OptimizerConfig
  from t5lite.train.trainer import TrainConfig
  base = dict(model_dir=str(model_dir), train_steps=3, batch_size=8,
              mixture_or_task_name="train_test_copy",
              task_feature_lengths={"inputs": 64, "targets": 16}, eval_period=0,
              optimizer=OptimizerConfig(name="adamw"))
  return TrainConfig(**{**base, **changes})


# --- HF transformers peers (parity tests; torch is imported on first use) -------------------

def hf_t5(seed: int = 0, vocab_size: int = 101, untied: bool = True, **t5_config):
  """A random HF T5ForConditionalGeneration in eval mode, no dropout. untied: lm_head gets
  its own random tensor (transformers 5.x ties it to the embedding otherwise)."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(
      transformers.T5Config(vocab_size=vocab_size, dropout_rate=0.0, **t5_config)).eval()
  if untied:
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.3)
  return model


def hf_generate(model, inputs: np.ndarray, max_new_tokens: int, **kwargs) -> np.ndarray:
  """HF generate's tokens for 0-padded (B, L) inputs, without its start token, 0-padded to
  (B, max_new_tokens): the layout of t5lite.generate."""
  import torch
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(inputs),
                         attention_mask=torch.tensor(inputs > 0).long(),
                         max_new_tokens=max_new_tokens, **kwargs).numpy()[:, 1:]
  return np.pad(out, ((0, 0), (0, max_new_tokens - out.shape[1])))


def random_hf_models(tmp_path_factory, classes: dict):
  """name -> (HF directory, t5lite config, params) of `classes[name]` = (model class, config
  factory, ...): a random HF model with every weight, biases and norms too, moved off its
  init (N(0, 0.05) added), saved once and read back through t5lite.load_hf."""
  import torch

  import t5lite
  built = {}

  def get(name):
    if name not in built:
      cls, make_config = classes[name][:2]
      torch.manual_seed(0)
      model = cls(make_config()).eval()
      with torch.no_grad():
        for p in model.parameters():
          p.add_(torch.randn_like(p) * 0.05)
      path = str(tmp_path_factory.mktemp(name))
      model.save_pretrained(path)
      built[name] = (path, *t5lite.load_hf(path))
    return built[name]
  return get
