"""What ModelConfig's sub-configs (moe, electra, span_boundary) share: their JSON form.

A sub-config is a frozen dataclass that subclasses SubConfig; model_config.json holds it as an
object of its fields, and reading one refuses unknown keys by name.

Example: MoeConfig(num_experts=8).to_dict() -> {'num_experts': 8, 'top_k': 1, ...};
MoeConfig.from_dict({'experts': 8}) -> ConfigError "unknown MoeConfig fields ['experts']; ...".
"""
from __future__ import annotations

import dataclasses
from typing import Any

from t5lite.errors import ConfigError


class SubConfig:
  """to_dict / from_dict for a dataclass sub-config of ModelConfig."""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values: dict[str, Any]):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"unknown {cls.__name__} fields {unknown}; known fields: "
                        f"{sorted(known)}")
    return cls(**values)
