"""T5's encoder-decoder with shared parameters (Raffel et al. 2020, section 3.2.2 and Table 2,
"Encoder-decoder, shared"): decoder layer i runs encoder layer i's self-attention and MLP
weights, with their layer norms, so the model has about the parameters of one stack at the
compute of two. What only a decoder has stays its own: the cross-attention and its norm; and
so does what each stack has once: its relative position bias (bidirectional in the encoder,
causal in the decoder) and its final norm.

Stored params hold the encoder's copy only. `tie` puts it into the decoder's places on the
way into the Flax module (nn.map_variables in t5lite.models.network), so autodiff sums a
shared weight's gradient over both uses; `untie` drops the decoder's copies from what the
module's init creates. The mapping is a pure rename of subtrees, the same for scanned layers
(`layers`, stacked) and unscanned ones (`layers_0`, ...).

HF transformers' T5 has no such option: `expand` gives the params of the plain
encoder-decoder that computes the same function (every shared weight written twice), which is
what an HF export holds (a T5ForConditionalGeneration whose decoder starts as a copy).
"""
from __future__ import annotations

from typing import Any

from t5lite.errors import ConfigError

SHARED = {"attention": "self_attention", "mlp": "mlp",
          **{f"{side}_{e}": f"{side}_{d}" for side in ("pre", "post")
             for e, d in (("attention_layer_norm", "self_attention_layer_norm"),
                          ("mlp_layer_norm", "mlp_layer_norm"))}}
"""An encoder layer's submodule -> the decoder layer's submodule that runs its params."""


def check(config) -> None:
  """ConfigError unless config (with shared_encoder_decoder) can share: two stacks of one
  depth, and no MoE or adapter (their layers' params differ per stack)."""
  if (config.architecture != "encoder_decoder"
      or config.num_encoder_layers != config.num_decoder_layers
      or config.moe is not None or config.adapter is not None):
    raise ConfigError("ModelConfig.shared_encoder_decoder needs an encoder-decoder with "
                      "num_encoder_layers == num_decoder_layers, no moe and no adapter; got "
                      f"{config.architecture}, {config.num_encoder_layers} and "
                      f"{config.num_decoder_layers} layers")


def _is_layer(name: str) -> bool:
  return name == "layers" or name.startswith("layers_")


def tie(variables: dict[str, Any]) -> dict[str, Any]:
  """Variables (or {'params': ...}) with each encoder layer's shared subtrees also in the
  decoder layer of the same name; anything else as it is."""
  params = variables.get("params")
  if not params or "encoder" not in params:
    return variables  # nothing stored yet (a module's init)
  decoder = dict(params.get("decoder", {}))
  for layer, encoder_layer in params["encoder"].items():
    if _is_layer(layer):
      decoder[layer] = {**decoder.get(layer, {}),
                        **{SHARED[name]: tree for name, tree in encoder_layer.items()
                           if name in SHARED}}
  return {**variables, "params": {**params, "decoder": decoder}}


def untie(variables: dict[str, Any]) -> dict[str, Any]:
  """Variables without the decoder layers' copies of shared subtrees."""
  params = variables.get("params")
  if not params or "decoder" not in params:
    return variables
  shared = set(SHARED.values())
  decoder = {layer: ({k: v for k, v in tree.items() if k not in shared} if _is_layer(layer)
                     else tree) for layer, tree in params["decoder"].items()}
  return {**variables, "params": {**params, "decoder": decoder}}


def expand(params, config) -> Any:
  """The params of the unshared model that computes the same function (the config with
  shared_encoder_decoder=False); params of an unshared config as they are."""
  if not config.shared_encoder_decoder:
    return params
  return tie({"params": params})["params"]
