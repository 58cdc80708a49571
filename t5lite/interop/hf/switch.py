"""The HF layout of Switch Transformers (`SwitchTransformersForConditionalGeneration`): T5's
encoder-decoder (hf_t5) whose sparse layers hold a router and experts.

Layout facts: a sparse layer's feed-forward block is `layer.{1|2}.mlp.router.classifier`
(E, D) and `mlp.experts.expert_{j}.wi` / `.wo` (torch Linear); a dense one `mlp.wi` / `mlp.wo`
(no DenseReluDense, no gating: `dense_act_fn` is one activation). Layer i of a stack is
sparse when its sparse step s is 1 or i % s == 1; config.json's `encoder_sparse_step` /
`decoder_sparse_step` win over `num_sparse_*_layers` (from which HF derives a step,
num_layers // num_sparse, when the step is absent). The capacity is a fixed `expert_capacity`
per expert and sequence; HF's router losses are pooled per stack (MoeConfig.router_losses =
'pooled'), weighted by router_z_loss_coef and router_aux_loss_coef.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from t5lite.errors import ConfigError
from t5lite.interop.hf import t5 as hf_t5
from t5lite.interop import limits
from t5lite.interop.hf.layout import Entry, HFLayout, refuse, register
from t5lite.models.config import ModelConfig
from t5lite.models.moe.config import MoeConfig

TO_HF_ACTIVATION = {"relu": "relu", "gelu": "gelu_new", "gelu_exact": "gelu"}
FROM_HF_ACTIVATION = {v: k for k, v in TO_HF_ACTIVATION.items()}


def _sparse_step(hf: Mapping, stack: str, num_layers: int) -> int:
  """The stack's sparse step as HF builds it (see the module docstring)."""
  key, count_key = f"{stack}_sparse_step", f"num_sparse_{stack}_layers"
  if hf.get(key) is not None:
    step = hf[key]
  else:
    count = hf.get(count_key, 3)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
      raise ConfigError(f"config.json: {count_key}={count!r} is not an integer >= 0")
    step = num_layers // count if count > 0 else num_layers
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    raise ConfigError(f"config.json: {key}={step!r} is not an integer >= 0")
  return step


def config_to_hf(config: ModelConfig) -> dict:
  """HF config.json contents; raises for variants Switch Transformers cannot express."""
  moe = config.moe
  if moe is None or config.architecture != "encoder_decoder":
    raise ConfigError("HF 'switch_transformers' is an encoder-decoder with ModelConfig.moe set")
  refuse(config, "switch_transformers", hf_t5.T5_NEEDS)
  if config.mlp_activation not in TO_HF_ACTIVATION:
    raise ConfigError(f"HF 'switch_transformers' has no equivalent of mlp_activation="
                      f"{config.mlp_activation!r} (its experts are ungated: "
                      f"{sorted(TO_HF_ACTIVATION)})")
  if config.tie_output_embedding != config.scale_logits:
    raise ConfigError(f"tie_output_embedding={config.tie_output_embedding} but scale_logits="
                      f"{config.scale_logits}: HF's Switch Transformers tie and scale together")
  if moe.top_k != 1 or not moe.expert_capacity:
    raise ConfigError(f"HF's Switch Transformers route top-1 with a fixed expert_capacity per "
                      f"sequence; this model has top_k={moe.top_k}, expert_capacity="
                      f"{moe.expert_capacity}: set MoeConfig.top_k=1 and expert_capacity (e.g. "
                      "64) to export it")
  hf = hf_t5.config_to_hf(config.replace(mlp_activation="relu", moe=None))
  hf.pop("feed_forward_proj")
  hf.pop("scale_decoder_outputs")  # Switch scales exactly when it ties (checked above)
  sparse = {s: len(moe.sparse_layers(s, n)) for s, n in (
      ("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers))}
  hf.update({
      "architectures": ["SwitchTransformersForConditionalGeneration"],
      "model_type": "switch_transformers",
      "dense_act_fn": TO_HF_ACTIVATION[config.mlp_activation],
      "num_experts": moe.num_experts,
      "expert_capacity": moe.expert_capacity,
      "encoder_sparse_step": moe.encoder_sparse_step,
      "decoder_sparse_step": moe.decoder_sparse_step,
      "num_sparse_encoder_layers": sparse["encoder"],
      "num_sparse_decoder_layers": sparse["decoder"],
      "router_bias": False,
      "router_dtype": "float32",
      "router_jitter_noise": moe.jitter_noise,
      "router_ignore_padding_tokens": False,
      "router_z_loss_coef": moe.z_loss_coef,
      "router_aux_loss_coef": moe.aux_loss_coef,
  })
  return hf


def config_from_hf(hf: Mapping, *, tied: bool, **overrides) -> ModelConfig:
  """ModelConfig from Switch Transformers config.json contents."""
  if hf.get("model_type") not in SwitchLayout.model_types:
    raise ConfigError(f"model_type={hf.get('model_type')!r}: not an HF Switch Transformers config")
  act = HFLayout.choice(hf, "dense_act_fn", FROM_HF_ACTIVATION, "relu")
  if hf.get("router_bias"):
    raise ConfigError("config.json: router_bias=true has no t5lite equivalent (the router of "
                      "Switch Transformers has no bias)")
  if hf.get("router_dtype", "float32") != "float32":
    raise ConfigError(f"config.json: router_dtype={hf.get('router_dtype')!r}: t5lite's router "
                      "always runs in float32")
  sizes = hf_t5.hf_sizes({**hf, "model_type": "t5"})
  experts = limits.size_field(hf.get("num_experts", 8), "num_experts", "config.json")
  capacity = limits.size_field(hf.get("expert_capacity", 64), "expert_capacity", "config.json")
  moe = MoeConfig(
      num_experts=experts, top_k=1, expert_capacity=capacity,
      encoder_sparse_step=_sparse_step(hf, "encoder", sizes["num_layers"]),
      decoder_sparse_step=_sparse_step(hf, "decoder", sizes["num_decoder_layers"]),
      jitter_noise=HFLayout.number(hf, "router_jitter_noise", 0.01, high=1.0, low_open=False),
      aux_loss_coef=HFLayout.number(hf, "router_aux_loss_coef", 1e-3, low_open=False),
      z_loss_coef=HFLayout.number(hf, "router_z_loss_coef", 1e-3, low_open=False),
      router_losses="pooled")
  t5_like = {**hf, "model_type": "t5", "feed_forward_proj": "relu",
             "scale_decoder_outputs": hf.get("tie_word_embeddings", True)}
  return hf_t5.config_from_hf(t5_like, tied=tied, **{"mlp_activation": act, "moe": moe,
                                                      **overrides})


def _feed_forward(config: ModelConfig, stack: str, layer: int, ours: tuple[str, ...],
                  hf: str) -> list[Entry]:
  mlp = ours + ("mlp",)
  if not config.moe.is_sparse(stack, layer):
    return [Entry((mlp + (w, "kernel"),), f"{hf}.mlp.{w}.weight", "linear") for w in ("wi", "wo")]
  entries = [Entry((mlp + ("router",),), f"{hf}.mlp.router.classifier.weight", "linear")]
  for j in range(config.moe.num_experts):
    entries += [Entry((mlp + (w,),), f"{hf}.mlp.experts.expert_{j}.{w}.weight", "linear",
                      index=j) for w in ("wi", "wo")]
  return entries


def weight_map(config: ModelConfig) -> list[Entry]:
  """hf_t5's weight map with Switch's feed-forward blocks."""
  entries = [e for e in hf_t5.weight_map(config.replace(moe=None, mlp_activation="relu"))
             if ".DenseReluDense." not in e.hf]
  # Untied, transformers 5 reads each stack's input embedding from its own tensor.
  entries += [Entry((("token_embedder", "embedding"),), f"{stack}.embed_tokens.weight")
              for stack in ("encoder", "decoder")]
  for stack, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    block = 1 if stack == "encoder" else 2
    for i in range(n):
      entries += _feed_forward(config, stack, i, (stack, f"layers_{i}"),
                               f"{stack}.block.{i}.layer.{block}")
  return entries


@register
class SwitchLayout(HFLayout):
  """Switch Transformers (`SwitchTransformersForConditionalGeneration`)."""
  model_types = ("switch_transformers",)

  def config_to_hf(self, config: ModelConfig) -> dict:
    return config_to_hf(config)

  def config_from_hf(self, hf, tensors, **overrides) -> ModelConfig:
    tied = hf_t5.tied_lm_head(tensors, "Switch Transformers")
    if tensors is not None:
      for stack in ("encoder", "decoder"):
        table = tensors.get(f"{stack}.embed_tokens.weight")
        if table is not None and not np.array_equal(table, tensors["shared.weight"]):
          # transformers 5 unties the stacks' input embeddings with tie_word_embeddings=false
          raise ConfigError(f"{stack}.embed_tokens.weight differs from shared.weight: t5lite's "
                            "encoder and decoder read one token embedding; this checkpoint "
                            "cannot be imported as it is")
    return config_from_hf(hf, tied=tied, **overrides)

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    return weight_map(config)

  def checkpoint_tensors(self, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """A tied checkpoint stores the stacks' input embeddings once, as shared.weight."""
    missing = {f"{stack}.embed_tokens.weight": tensors["shared.weight"]
               for stack in ("encoder", "decoder")
               if f"{stack}.embed_tokens.weight" not in tensors and "shared.weight" in tensors}
    return {**tensors, **missing} if missing else tensors

  def check_claim(self, hf, where, max_params=None) -> tuple[int, str]:
    config = self.config_from_hf(hf, None)
    ceiling = limits.max_import_params(max_params)
    d, f, e = config.d_model, config.d_ff, config.moe.num_experts
    claimed = hf_t5.implied_params(hf_t5.hf_sizes({**hf, "model_type": "t5"}, where), False)
    for stack, n in (("encoder", config.num_encoder_layers),
                     ("decoder", config.num_decoder_layers)):
      claimed += len(config.moe.sparse_layers(stack, n)) * ((e - 1) * 2 * d * f + d * e)
    named = f"num_experts={e:,}, d_model={d:,}, d_ff={f:,}"
    limits.check_ceiling(claimed, f"{where} ({named})", ceiling)
    return claimed, f"{where} ({named})"
