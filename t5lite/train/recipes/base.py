"""What a recipe is: how a run trains beyond what its model family says.

A family (t5lite.families) is a kind of model and its loss. A recipe is what rides along one
run of it: the params the step reads but never trains (a distillation teacher, a PEFT base:
the step's `fixed_params`), the family it actually trains (wrapped around the model's), which
params train, how a fresh state starts, what MODEL_DIR records of it and what a resumed run
must match. The trainer (t5lite.train.trainer) asks the run's recipe and names none:

    recipe = recipes.recipe_of(train_config)               # one object per Trainer
    family = recipe.prepare(family, mesh=mesh, rules=rules)  # reads what it needs
    mask = recipe.trainable_mask(family, params)
    init, reads_fixed = recipe.fresh_init(family, vocabulary, seed)
    recipe.check(model_dir, vocabulary)   # every process, before MODEL_DIR is written
    recipe.record(model_dir)              # process 0, once the run goes on

A recipe of one's own subclasses Recipe, sets `name`, overrides what differs and registers
(t5lite.train.recipes.register); `TrainConfig.recipe = 'its_name'` (or an object of its
`options_type`) selects it. The built-in ones keep their TrainConfig fields
(`TrainConfig.peft`, `TrainConfig.distillation`: `field`).
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

Tree = Any


class Recipe:
  """How a run trains beyond its family; the default (PlainRecipe) changes nothing."""

  name: ClassVar[str] = ""
  """The registry name: TrainConfig.recipe = 'name' selects it."""
  options_type: ClassVar[type | None] = None
  """Its options (a dataclass): TrainConfig.recipe (or `field`) = @Options() selects it too."""
  field: ClassVar[str] = "recipe"
  """The TrainConfig field holding its options ('peft', 'distillation'); 'recipe' for any
  other recipe, built-in or a user's."""
  hints: ClassVar[dict[str, str]] = {}
  """{other recipe's name: what to do instead}, said when both are set (a run follows one)."""
  compiles_ahead: ClassVar[bool] = False
  """Whether `t5lite compile` compiles its step without prepare() (nothing read from disk,
  the family unchanged; trainable_mask is still asked)."""

  def __init__(self, options: Any = None):
    self.options = options
    self.fixed_params: Tree | None = None
    """Params every step reads beside the train state, placed on the mesh by prepare():
    never donated, differentiated or saved (None: the step takes none)."""

  def check_config(self, config) -> None:
    """Refuses a TrainConfig (`config`) this recipe cannot train; no I/O (TrainConfig's
    __post_init__ calls it)."""

  def prepare(self, family, *, mesh, rules):
    """Reads and places what the run needs beside its model (sets self.fixed_params); returns
    the family the run trains (family.config is the model config MODEL_DIR keeps)."""
    return family

  def trainable_mask(self, family, params: Tree) -> Tree:
    """Which of the train state's params the optimizer updates (a tree of bools)."""
    return family.trainable_mask(params)

  def fresh_init(self, family, vocabulary, seed: int) -> tuple[Callable, bool]:
    """(init, reads_fixed): init(rng, *fixed) -> the params of a fresh start, traced under
    jit; reads_fixed: whether it takes self.fixed_params as its second argument."""
    return family.init_params, False

  def model_params(self, family, params: Tree) -> Tree:
    """The whole model's params of a train state's (what evaluation and export see)."""
    return params

  def check(self, model_dir: str, vocabulary) -> None:
    """Refuses a MODEL_DIR whose record differs (a resumed run must train as it started);
    every process, before anything is written there."""

  def record(self, model_dir: str) -> None:
    """Writes what MODEL_DIR keeps of the recipe (process 0, once the run goes on)."""


class PlainRecipe(Recipe):
  """A run of the family alone: no fixed params, the family's mask, init and params."""

  name = "plain"
  compiles_ahead = True
