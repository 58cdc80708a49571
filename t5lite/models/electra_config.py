"""ElectraConfig: ELECTRA's replaced-token-detection pretraining (ModelConfig.electra).

Set, the encoder-only model's pretraining head is ELECTRA's discriminator head (dense, the
config's activation, dense to one logit per token: replaced or original) in place of the MLM
head. With generator_hidden_fraction > 0 a generator MLM of that fraction of d_model trains
beside it, sharing its embeddings (t5lite.families.electra); the loss is

    generator MLM mean + discriminator_loss_weight x discriminator sigmoid CE mean.

None: no discriminator head (a plain MLM encoder, e.g. HF's ElectraForMaskedLM generator).
Checks that need the rest of the model (encoder-only, no other pretraining head, a generator
no wider than the discriminator) are ModelConfig's.
"""
from __future__ import annotations

import dataclasses
import math

from t5lite.errors import ConfigError
from t5lite.models.sub_config import SubConfig


@dataclasses.dataclass(frozen=True)
class ElectraConfig(SubConfig):
  """ELECTRA's discriminator head and, optionally, its generator; see the module docstring."""

  generator_hidden_fraction: float = 0.0
  """A generator MLM of this fraction of d_model (ELECTRA: 1/4 small and large, 1/3 base)
  trains beside the discriminator, sharing its embeddings. 0: the discriminator alone (as
  imported from HF's ElectraForPreTraining)."""
  discriminator_loss_weight: float = 50.0
  """loss = generator MLM loss + this x the discriminator's loss (the paper's 50)."""
  sampling_temperature: float = 1.0
  """The generator's samples are drawn from softmax(logits / this) (ELECTRA's code: 1.0).
  Above 1 the replacements are less plausible, so easier to detect."""

  def __post_init__(self):
    for field in ("generator_hidden_fraction", "discriminator_loss_weight"):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and value >= 0):
        raise ConfigError(f"ElectraConfig.{field} must be a number >= 0, got {value!r}")
    temperature = self.sampling_temperature
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature > 0):
      raise ConfigError("ElectraConfig.sampling_temperature must be a number > 0 (ELECTRA's "
                        f"1.0), got {temperature!r}")

  @property
  def pretrains_pair(self) -> bool:
    """Whether a generator trains beside the discriminator."""
    return self.generator_hidden_fraction > 0

  def generator_width(self, d_model: int) -> int:
    """The generator's hidden size for a discriminator of width d_model."""
    return round(d_model * self.generator_hidden_fraction)
