"""MoeConfig: the Mixture-of-Experts option of a model's MLPs (ModelConfig.moe).

Some MLP blocks of each stack become routed MLPs (t5lite.models.moe.layer): a float32 router picks
the top-k of `num_experts` experts for every token, each expert an MLP of the model's own
shape, and an expert takes at most `capacity` tokens of a sequence; tokens past it skip the
block (the residual alone carries them). Which layers are sparse follows HF's Switch
Transformers: with sparse_step s, layer i is sparse when s == 1 or i % s == 1 (s = 2: layers
1, 3, 5, ...); 0 makes none sparse.

Capacity per sequence of L tokens: a fixed `expert_capacity` (HF's checkpoints), or
ceil(capacity_factor * k * L / num_experts) (the paper's, with separate train and eval
factors). Router losses, added to the training loss and logged: Switch's load-balancing loss
num_experts * sum_e f_e * P_e (f: the fraction of tokens whose first choice is e, P: the mean
router probability of e) times aux_loss_coef, and ST-MoE's z-loss mean(logsumexp(logits)^2)
times z_loss_coef. `router_losses` says over what they are taken:

  'per_layer'  each sparse layer's own tokens, summed over layers (Switch, T5X)
  'pooled'     the router logits of all sparse layers of a stack concatenated along the
               sequence, one loss per stack (HF's SwitchTransformersForConditionalGeneration
               with output_router_logits=True; like HF, 0 for a stack whose sparse_step <= 1)
"""
from __future__ import annotations

import dataclasses
import math

from t5lite.errors import ConfigError
from t5lite.models.sub_config import SubConfig

ROUTER_LOSSES = ("per_layer", "pooled")


@dataclasses.dataclass(frozen=True)
class MoeConfig(SubConfig):
  """Routed MLPs in some layers of each stack; see the module docstring."""

  num_experts: int = 8
  """Experts per sparse layer (each a full MLP of d_ff)."""
  top_k: int = 1
  """Experts each token goes to: 1 (Switch) or more (GShard / ST-MoE's top-2). Outputs are
  weighted by the chosen experts' router probabilities."""
  capacity_factor: float = 1.25
  """Training capacity: ceil(factor * top_k * tokens of a sequence / num_experts) per expert."""
  eval_capacity_factor: float = 2.0
  """The same without dropout (evaluation, decoding, parity)."""
  expert_capacity: int = 0
  """> 0: a fixed capacity per expert and sequence, in training and evaluation (HF's
  `expert_capacity`), in place of the factors."""
  encoder_sparse_step: int = 2
  """Layer i of the encoder (or of a decoder-only model's stack) is sparse when the step is 1
  or i % step == 1 (HF's encoder_sparse_step); 0: no sparse layer."""
  decoder_sparse_step: int = 2
  """The same for an encoder-decoder model's decoder (HF's decoder_sparse_step)."""
  jitter_noise: float = 0.0
  """Training only: the router's inputs times U(1 - j, 1 + j) (HF's router_jitter_noise 0.01)."""
  expert_dropout: float = -1.0
  """Dropout on the experts' hidden activations (Switch finetunes with 0.4); < 0: the model's
  dropout_rate."""
  aux_loss_coef: float = 1e-2
  """Weight of the load-balancing loss (Switch: 1e-2; HF's default 1e-3)."""
  z_loss_coef: float = 1e-3
  """Weight of the router z-loss (ST-MoE: 1e-3)."""
  router_losses: str = "per_layer"
  """'per_layer' (Switch / T5X) or 'pooled' (HF); see the module docstring."""

  def __post_init__(self):
    if not isinstance(self.num_experts, int) or self.num_experts < 1:
      raise ConfigError(f"MoeConfig.num_experts must be a positive integer, got "
                        f"{self.num_experts!r}")
    if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
      raise ConfigError(f"MoeConfig.top_k={self.top_k!r} must be between 1 and num_experts="
                        f"{self.num_experts}: a token cannot go to more experts than exist")
    for field in ("capacity_factor", "eval_capacity_factor"):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"MoeConfig.{field}={value!r} must be > 0: with no capacity every "
                          "token would skip the experts")
    for field in ("expert_capacity", "encoder_sparse_step", "decoder_sparse_step"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"MoeConfig.{field} must be an integer >= 0, got {value!r}")
    if not 0.0 <= self.jitter_noise < 1.0:
      raise ConfigError(f"MoeConfig.jitter_noise must be in [0, 1), got {self.jitter_noise}")
    if self.expert_dropout >= 1.0:
      raise ConfigError(f"MoeConfig.expert_dropout must be < 1, got {self.expert_dropout}")
    for field in ("aux_loss_coef", "z_loss_coef"):
      value = getattr(self, field)
      if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"MoeConfig.{field} must be >= 0, got {value}")
    if self.router_losses not in ROUTER_LOSSES:
      raise ConfigError(f"MoeConfig.router_losses={self.router_losses!r} is not one of "
                        f"{ROUTER_LOSSES}")

  def sparse_step(self, stack: str) -> int:
    """The sparse step of 'encoder' or 'decoder'."""
    return self.decoder_sparse_step if stack == "decoder" else self.encoder_sparse_step

  def is_sparse(self, stack: str, layer: int) -> bool:
    """Whether layer `layer` (0-based) of `stack` has a routed MLP (HF's rule)."""
    step = self.sparse_step(stack)
    return step > 0 and (step == 1 or layer % step == 1)

  def sparse_layers(self, stack: str, num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if self.is_sparse(stack, i)]

  def capacity(self, tokens: int, training: bool) -> int:
    """Slots per expert for a sequence of `tokens` tokens."""
    if self.expert_capacity:
      return self.expert_capacity
    factor = self.capacity_factor if training else self.eval_capacity_factor
    return max(1, math.ceil(factor * self.top_k * tokens / self.num_experts))

  def dropout(self, model_rate: float) -> float:
    return model_rate if self.expert_dropout < 0 else self.expert_dropout
