"""Folding LoRA into its base: `t5lite export hf --merge`.

    merge(config, params) -> (config without adapter, params with kernel += scale * A B)

The merged model's logits equal the adapted model's (up to float32 rounding of the sum). A
prompt- or prefix-tuned model has nothing to fold (its adapter is extra inputs, not a change
of weights) and is refused.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from flax import traverse_util

from t5lite.errors import ConfigError
from t5lite.models import adapters
from t5lite.models.adapters import LORA_A, LORA_B
from t5lite.models.config import ModelConfig

Tree = Any


def merge(config: ModelConfig, params: Tree) -> tuple[ModelConfig, Tree]:
  """(config without adapter, params with every LoRA folded into its kernel): kernel +=
  scale * A B in float32, cast back to the kernel's dtype. Saved modules stay (they are
  part of the model). Scanned or not."""
  adapter = config.adapter
  if adapter is None:
    raise ConfigError("this model has no adapter (ModelConfig.adapter is None): nothing to "
                      "merge")
  if adapter.method != "lora":
    raise ConfigError(f"a {adapter.method} model cannot be merged: its "
                      f"{'soft prompt' if adapter.method == 'prompt_tuning' else 'prefixes'} "
                      "are extra inputs, not a change of weights, so no plain HF model equals "
                      "it. Use `t5lite export peft` (peft loads it onto the base) or keep the "
                      "RUN_DIR")
  scale = adapter.scale
  flat = traverse_util.flatten_dict(params)
  out = {k: v for k, v in flat.items() if not adapters.is_adapter_path(k)}
  for path in flat:
    if path[-1] != LORA_A:
      continue
    module = path[:-1]
    kernel = flat[module + ("kernel",)]
    a = np.asarray(flat[path], np.float32)
    b = np.asarray(flat[module + (LORA_B,)], np.float32)
    lead = a.ndim + b.ndim - 2 - len(kernel.shape)  # a stacked layer axis (scan_layers)
    r = a.shape[-1]
    delta = np.matmul(a.reshape(a.shape[:lead] + (-1, r)), b.reshape(b.shape[:lead + 1] + (-1,)))
    merged = np.asarray(kernel, np.float32) + scale * delta.reshape(kernel.shape)
    out[module + ("kernel",)] = merged.astype(kernel.dtype)
  return config.replace(adapter=None), traverse_util.unflatten_dict(out)
