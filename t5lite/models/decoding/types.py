"""What decoding.py and beam_search.py share: token ids and the prefilled decoder.

Its own module so that the imports go one way: decoding imports beam_search, and both import
this (beam_search needs `Prefill`, decoding builds it).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

PAD_ID = 0  # also the decoder start / BOS token
EOS_ID = 1

# step(cache, tokens (B,), positions (B,)) -> (next-token logits (B, V), cache)
StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]


class Prefill(NamedTuple):
  """The decoder after its prompt: what every decoding loop starts from."""
  logits: jax.Array     # (B, V) float32: the distribution of the first output token
  cache: Any            # the 'cache' collection after the prompt
  positions: jax.Array  # (B,) int32: position of the first output token
  step: StepFn
