"""Recipes: how a run trains beyond its family (t5lite.train.recipes.base). The trainer asks
the run's recipe (recipe_of) and names none.

Built in: 'plain' (the family alone), 'peft' (TrainConfig.peft), 'distillation'
(TrainConfig.distillation). A user's recipe registers when its module is imported
(`t5lite train --module my_module`) and is selected with TrainConfig.recipe = 'its_name'.
"""
from t5lite.train.recipes.base import PlainRecipe, Recipe
from t5lite.train.recipes.registry import check_config, get, names, recipe_of, register
from t5lite.train.recipes import peft, distillation  # noqa: F401 (registers, in this order)

__all__ = ["Recipe", "PlainRecipe", "register", "get", "names", "recipe_of", "check_config"]
