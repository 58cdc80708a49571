"""peft adapter directories of every kind t5lite trains: LoRA (t5lite.interop.peft.lora),
prompt and prefix tuning (t5lite.interop.peft.prompts), chosen by the adapter's method when
writing and by adapter_config.json's peft_type when reading.

    save(config, params, out)       adapter_config.json + adapter_model.safetensors
    load(adapter_dir, base_config)  (AdapterConfig, adapter params, saved module prefixes)
"""
from __future__ import annotations

from typing import Any

from t5lite.errors import ConfigError
from t5lite.interop.peft import lora as peft_format
from t5lite.interop.peft import prompts as peft_prompts
from t5lite.models.adapters import AdapterConfig
from t5lite.models.config import ModelConfig

Tree = Any


def save(config: ModelConfig, params: Tree, out: str, base_name_or_path: str = "", *,
         saved_modules=()) -> list[str]:
  """Writes an adapted model's adapter as peft's save_pretrained does; returns the file names.
  params: the whole tree or the adapter half (with the saved modules' params)."""
  if config.adapter is None:
    raise ConfigError("this model has no adapter (ModelConfig.adapter is None): nothing to "
                      "write as a peft adapter")
  write = peft_format.save_peft if config.adapter.method == "lora" else peft_prompts.save
  return write(config, params, out, base_name_or_path, saved_modules=saved_modules)


def load(adapter_dir: str, base_config: ModelConfig) -> tuple[AdapterConfig, Tree, tuple]:
  """A peft adapter directory (LoRA, prompt or prefix tuning) for a base of base_config."""
  settings, tensors = peft_format.read_dir(adapter_dir)
  if settings["peft_type"] == "LORA":
    return peft_format.load_lora(adapter_dir, settings, tensors, base_config)
  return peft_prompts.load(adapter_dir, settings, tensors, base_config.replace(adapter=None))
