"""The registry of recipes: name -> Recipe class, and the recipe a TrainConfig asks for.

    @register
    class MyRecipe(Recipe):
      name = "my_recipe"
      ...
    TrainConfig(..., recipe="my_recipe")   # gin: TrainConfig.recipe = 'my_recipe'

Registering is importing: t5lite.train.recipes imports the built-in ones; a recipe defined
elsewhere (a user's module: `t5lite train --module my_module`) registers when its module is
imported. Gin-free, like t5lite.families.registry: a TrainConfig is taken duck-typed.
"""
from __future__ import annotations

import difflib
from typing import Any

from t5lite.errors import ConfigError, ConfigKeyError
from t5lite.train.recipes.base import PlainRecipe, Recipe

_ORDER: list[type[Recipe]] = []  # registration order: which field a conflict names first
_BY_NAME: dict[str, type[Recipe]] = {}


def register(cls: type[Recipe]) -> type[Recipe]:
  """Class decorator: makes `cls` the recipe called `cls.name` (a later class of the same name
  replaces it, so re-importing a module is harmless)."""
  if not getattr(cls, "name", ""):
    raise ValueError(f"{cls.__name__} has no `name`: a recipe needs one to be registered")
  old = _BY_NAME.get(cls.name)
  if old is None:
    _ORDER.append(cls)
  else:
    _ORDER[_ORDER.index(old)] = cls
  _BY_NAME[cls.name] = cls
  return cls


def names() -> list[str]:
  """The registered recipe names, sorted."""
  return sorted(_BY_NAME)


def get(name: str) -> type[Recipe]:
  """The recipe class called `name`; an unknown name is an error that lists the close ones."""
  if name not in _BY_NAME:
    close = difflib.get_close_matches(name, names(), n=3)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise ConfigKeyError(f"unknown recipe {name!r}{hint} (registered: {', '.join(names())}; "
                         "a recipe registers when its module is imported: `t5lite train "
                         "--module MODULE`)")
  return _BY_NAME[name]


def _selected(value: Any) -> tuple[type[Recipe], Any]:
  """(class, options) of a TrainConfig.recipe value: a name, or an options object."""
  if isinstance(value, str):
    cls = get(value)
    if cls.field != "recipe":
      raise ConfigError(f"TrainConfig.recipe = {value!r}: that recipe takes its options from "
                        f"TrainConfig.{cls.field}; set that instead")
    return cls, None
  for cls in _ORDER:
    if cls.options_type is not None and isinstance(value, cls.options_type):
      if cls.field != "recipe":
        raise ConfigError(f"TrainConfig.recipe is a {type(value).__name__}: set "
                          f"TrainConfig.{cls.field} to it instead")
      return cls, value
  raise ConfigError(f"TrainConfig.recipe is {value!r}: name a registered recipe "
                    f"({', '.join(names())}) or give the options object of one")


def recipe_of(config) -> Recipe:
  """A fresh recipe object for a TrainConfig: the one its fields select (TrainConfig.peft,
  TrainConfig.distillation, TrainConfig.recipe), or PlainRecipe; two selected: refused."""
  chosen = [(cls.field, cls, getattr(config, cls.field)) for cls in _ORDER
            if cls.field != "recipe" and getattr(config, cls.field, None) is not None]
  if getattr(config, "recipe", None) is not None:
    chosen.append(("recipe", *_selected(config.recipe)))
  if len(chosen) > 1:
    (first, a, _), (second, b, _) = chosen[:2]
    hint = b.hints.get(a.name) or a.hints.get(b.name) or "a run follows one recipe"
    raise ConfigError(f"TrainConfig.{first} and TrainConfig.{second} are both set: {hint}")
  if not chosen:
    return PlainRecipe()
  _, cls, options = chosen[0]
  return cls(options)


def check_config(config) -> None:
  """Refuses a TrainConfig its recipe cannot train (no I/O: TrainConfig.__post_init__)."""
  recipe_of(config).check_config(config)


register(PlainRecipe)
