"""The registry of model families: name -> Family class, and the lookup for a ModelConfig.

    @register
    class MyFamily(Family):
      name = "my_family"
      ...
    family = family_of(ModelConfig(architecture="encoder_only", family="my_family"))

Registering is importing: t5lite.families imports the built-in families; a family defined
elsewhere (a user's module, a test file) registers when its module is imported.
"""
from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from t5lite.errors import ConfigKeyError
from t5lite.models.config import ModelConfig

if TYPE_CHECKING:  # annotations only: base.py imports nothing from here
  from t5lite.families.base import Family, LossOptions

_FAMILIES: dict[str, type["Family"]] = {}


def register(cls: type["Family"]) -> type["Family"]:
  """Class decorator: makes `cls` the family called `cls.name` (a later class of the same name
  replaces it, so re-importing a module is harmless)."""
  if not getattr(cls, "name", ""):
    raise ValueError(f"{cls.__name__} has no `name`: a family needs one to be registered")
  _FAMILIES[cls.name] = cls
  return cls


def names() -> list[str]:
  """The registered family names, sorted."""
  return sorted(_FAMILIES)


def get(name: str) -> type["Family"]:
  """The family class called `name`; an unknown name is an error that lists the close ones."""
  if name not in _FAMILIES:
    close = difflib.get_close_matches(name, names(), n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ConfigKeyError(f"unknown model family {name!r}{hint} (registered: {', '.join(names())}; "
                     "a family registers when its module is imported)")
  return _FAMILIES[name]


def family_of(config: ModelConfig, loss: "LossOptions | None" = None) -> "Family":
  """The family object of a model config (ModelConfig.family, or its architecture's family),
  with the loss options its loss_fn uses (default: plain cross entropy)."""
  cls = get(config.family_name)
  return cls(config) if loss is None else cls(config, loss)
