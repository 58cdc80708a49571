"""Prompt and prefix tuning <-> the peft library's PROMPT_TUNING / PREFIX_TUNING directories.

One tensor, `prompt_embeddings`, holds either adapter (peft's get_prompt_embedding_to_save):

    prompt tuning   (n, E)              our <input stack>/prompt_embeddings: the encoder's
                                        (T5, BERT) or a decoder-only model's decoder's
    prefix tuning   (n, L * 2 * kvh*K)  row i = for each layer l, the key then the value of
                                        virtual slot i ((L, 2, kvh, K) flattened), peft's
                                        past_key_values; ours: <stack>/layers_l/attention/
                                        prefix_key and prefix_value (n, kvh, K)

Prefix tuning trained through Li and Liang's MLP (AdapterConfig.prefix_projection) goes out
as the prefixes the MLP gives, as peft saves it too. peft's prefix tuning of an encoder-decoder
model reaches only the decoder's self-attention, with its own mapping of layers to prefix
slots; t5lite's puts prefixes before every attention (Li and Liang), so that interchange is
refused. peft's seq2seq prompt tuning keeps 2n rows (num_transformer_submodules=2) and its
generate uses the first n, the encoder's: those are read, the rest dropped with a warning.

A saved module (a finetuning head trained whole) travels as its HF tensors under
`base_model.`, where peft's prompt-learning models keep them.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Any

import numpy as np
import safetensors.numpy
from flax import traverse_util

from t5lite.errors import ConfigError
from t5lite.interop.peft import lora as peft_format
from t5lite.models.adapters import PREFIX_KEY, PREFIX_VALUE, PROMPT, AdapterConfig
from t5lite.models.config import ModelConfig
from t5lite.models.params import unscan_params

Tree = Any
PEFT_TYPES = {"prompt_tuning": "PROMPT_TUNING", "prefix_tuning": "PREFIX_TUNING"}
SAVED_PREFIX = "base_model."
KEY = "prompt_embeddings"


def input_stack(config: ModelConfig) -> str:
  """The stack a soft prompt goes before: the encoder, or a decoder-only model's decoder."""
  return "encoder" if config.has_encoder else "decoder"


def _prefix_stack(config: ModelConfig) -> tuple[str, int]:
  """(stack, layers) of a prefix-tuned model that peft can hold, else a ConfigError."""
  if config.has_encoder and config.has_decoder:
    raise ConfigError(
        "peft's prefix tuning of an encoder-decoder model reaches only the decoder's "
        "self-attention, with its own mapping of layers to prefix slots; t5lite's follows Li "
        "and Liang (prefixes before every attention: encoder, decoder, cross), so these "
        "prefixes have no peft equivalent. Export the model merged is impossible too (a prefix "
        "is no weight): keep it as a t5lite RUN_DIR, or prefix-tune a decoder-only model")
  if config.shared_layer_groups:
    raise ConfigError("an ALBERT model shares its layers, so its prefixes are per layer group, "
                      "while peft keeps one per layer: no peft equivalent")
  stack = input_stack(config)
  return stack, config.num_encoder_layers if stack == "encoder" else config.num_decoder_layers


def save(config: ModelConfig, params: Tree, out: str, base_name_or_path: str = "", *,
         saved_modules=()) -> list[str]:
  """Writes a prompt- or prefix-tuned model's adapter as peft's save_pretrained does."""
  adapter = config.adapter
  flat = traverse_util.flatten_dict(unscan_params(params))
  n = adapter.num_virtual_tokens
  settings = {"num_virtual_tokens": n, "num_transformer_submodules": 1,
              "num_attention_heads": config.num_heads}
  if adapter.method == "prompt_tuning":
    path = (input_stack(config), PROMPT)
    if path not in flat:
      raise ConfigError("the params hold no soft prompt (prompt_embeddings): pass the whole "
                        "params or the adapter half of the prompt-tuned model")
    embeddings = np.asarray(flat[path], np.float32)  # (n, E)
    layers = config.num_encoder_layers if config.has_encoder else config.num_decoder_layers
    settings.update(token_dim=int(embeddings.shape[1]), num_layers=layers,
                    prompt_tuning_init="RANDOM", prompt_tuning_init_text=None,
                    tokenizer_name_or_path=None, tokenizer_kwargs=None)
  else:
    stack, layers = _prefix_stack(config)
    rows = []
    for i in range(layers):
      module = (stack, f"layers_{i}", "attention")
      if module + (PREFIX_KEY,) not in flat:
        raise ConfigError("the params hold no prefixes (prefix_key / prefix_value): pass the "
                          "whole params or the adapter half of the prefix-tuned model")
      rows += [np.asarray(flat[module + (name,)], np.float32) for name in (PREFIX_KEY,
                                                                           PREFIX_VALUE)]
    stacked = np.stack(rows, axis=1)  # (n, L * 2, kvh, K)
    embeddings = stacked.reshape(n, -1)
    settings.update(token_dim=config.kv_heads * config.d_kv, num_layers=layers,
                    num_attention_heads=config.kv_heads, prefix_projection=False,
                    encoder_hidden_size=config.kv_heads * config.d_kv)
  _, entries, _ = peft_format.sites(config)
  task = peft_format.task_type(config)
  tensors, modules = peft_format.saved_tensors(
      config, flat, entries, tuple(map(tuple, saved_modules)), task)
  tensors = {SAVED_PREFIX + name: value for name, value in tensors.items()}
  tensors[KEY] = np.ascontiguousarray(embeddings)
  os.makedirs(out, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(out, peft_format.WEIGHTS_FILE),
                              metadata={"format": "pt"})
  settings.update(peft_type=PEFT_TYPES[adapter.method], task_type=task,
                  modules_to_save=modules or None, inference_mode=True,
                  base_model_name_or_path=base_name_or_path or None, revision=None,
                  auto_mapping=None)
  peft_format.write_settings(out, settings)
  return [peft_format.CONFIG_FILE, peft_format.WEIGHTS_FILE]


def load(adapter_dir: str, settings: dict, tensors: dict, base: ModelConfig
         ) -> tuple[AdapterConfig, Tree, tuple]:
  """(AdapterConfig, adapter params, saved module prefixes) of a peft PROMPT_TUNING or
  PREFIX_TUNING directory for a base of config `base` (scanned iff scan_layers)."""
  method = {v: k for k, v in PEFT_TYPES.items()}[settings["peft_type"]]
  if KEY not in tensors:
    raise ConfigError(f"{adapter_dir} holds no {KEY} tensor ({settings['peft_type']})")
  embeddings = np.asarray(tensors.pop(KEY), np.float32)
  n = int(settings.get("num_virtual_tokens") or 0)
  if n < 1 or embeddings.ndim != 2 or embeddings.shape[0] < n:
    raise ConfigError(f"{adapter_dir}: {KEY} has shape {embeddings.shape}, which does not hold "
                      f"num_virtual_tokens={n} rows")
  flat = {}
  if method == "prompt_tuning":
    if embeddings.shape[0] > n:
      warnings.warn(f"{adapter_dir} holds {embeddings.shape[0]} prompt rows for "
                    f"num_virtual_tokens={n} (peft's seq2seq layout, "
                    f"num_transformer_submodules={settings.get('num_transformer_submodules')}): "
                    "t5lite reads the first n, the encoder's prompt, which peft's generate uses")
    if embeddings.shape[1] != base.embedding_width:
      raise ConfigError(f"{adapter_dir}: the soft prompt is {embeddings.shape[1]} wide, the "
                        f"base's embeddings {base.embedding_width}: an adapter of another model")
    flat[(input_stack(base), PROMPT)] = embeddings[:n]
  else:
    stack, layers = _prefix_stack(base)
    shape = (n, layers, 2, base.kv_heads, base.d_kv)
    if embeddings.shape != (n, math.prod(shape[1:])):
      raise ConfigError(f"{adapter_dir}: {KEY} has shape {embeddings.shape}; this base's "
                        f"prefixes need ({n}, {math.prod(shape[1:])}) = {layers} layers x key "
                        f"and value x {base.kv_heads} heads x {base.d_kv}")
    prefixes = embeddings.reshape(shape)
    for i in range(layers):
      module = (stack, f"layers_{i}", "attention")
      flat[module + (PREFIX_KEY,)] = prefixes[:, i, 0]
      flat[module + (PREFIX_VALUE,)] = prefixes[:, i, 1]
  found = {}
  for key, value in tensors.items():
    if not key.startswith(SAVED_PREFIX):
      raise ConfigError(f"{adapter_dir}: tensor {key} is not peft's {KEY} nor a saved module "
                        f"(under {SAVED_PREFIX})")
    found[key[len(SAVED_PREFIX):]] = value
  _, entries, shapes = peft_format.sites(base)
  saved = peft_format.load_saved(adapter_dir, base, entries, shapes, found, flat)
  adapter = AdapterConfig(method=method, num_virtual_tokens=n)
  return adapter, peft_format.in_layout(base, flat, adapter_dir), saved
