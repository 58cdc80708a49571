"""TrainState: the step counter, params and optimizer state, as one plain pytree.

    state = TrainState.create(params, optimizer)     # step 0, optimizer.init(params)
    state, metrics = train_step(state, batch, ...)   # t5lite.train.step

The optimizer itself is not stored: a GradientTransformation is a pair of functions, not data,
so keeping it out leaves a tree of arrays only, which jit can donate and shard leaf by leaf and a
checkpointer (orbax) can save and restore without pickling code.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

Tree = Any


@flax.struct.dataclass
class TrainState:
  """Everything a training run must save to resume exactly."""

  step: jax.Array
  """int32 scalar: number of steps taken (skipped non-finite steps included); it also seeds the
  dropout rng, so a restored state reproduces the same dropout masks."""
  params: Tree
  """Model params (a nested dict of arrays, as Flax returns under 'params')."""
  opt_state: Tree
  """optax state of the optimizer the step is given."""

  @classmethod
  def create(cls, params: Tree, optimizer: optax.GradientTransformation) -> "TrainState":
    """Step 0 with the optimizer's initial state for `params`.

    Call it under jax.jit with out_shardings to create the optimizer state already sharded.
    """
    return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
