"""SpanBoundaryConfig: SpanBERT's span boundary objective (ModelConfig.span_boundary).

Set, an encoder-only model pretrains with a second head beside the MLM head: each masked span
token is predicted from the final states just outside its span and its (1-based) position in
the span, through a 2-layer GELU + norm head and the tied output projection
(t5lite.models.heads.SpanBoundaryHead); the loss adds the SBO mean to the MLM mean over the
same span tokens. It needs span-masked batches (gin/runs/stdlib_spanbert_pretrain.gin). None:
no span boundary head. Checks that need the rest of the model (encoder-only, head='') are
ModelConfig's.
"""
from __future__ import annotations

import dataclasses

from t5lite.errors import ConfigError
from t5lite.models.sub_config import SubConfig


@dataclasses.dataclass(frozen=True)
class SpanBoundaryConfig(SubConfig):
  """SpanBERT's span boundary head; see the module docstring."""

  max_span_length: int = 10
  """Longest masked span the head has a position embedding for (longer spans share the
  last row)."""

  def __post_init__(self):
    value = self.max_span_length
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f"SpanBoundaryConfig.max_span_length must be an integer >= 1, got "
                        f"{value!r}")
