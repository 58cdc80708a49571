"""Starting a model from another one's params: what HF's `from_pretrained` does for a model
with another head.

Finetuning a pretrained BERT with a classification head: the encoder and embeddings carry
over, the head is new (initialized as in a fresh run), the pretraining heads (MLM, NSP) are
left behind, and a vocabulary that grew by added tokens (GPT-1's [START] [DELIM] [EXTRACT])
keeps its old rows and gets fresh ones for the new ids:

    plan = plan_warm_start(wanted_shapes, saved_shapes, old_vocab=4000, new_vocab=4003)
    plan.carried   ['encoder']..., ['token_embedder']['embedding'] is in plan.grown
    plan.new       ["['head']['classifier']['kernel']", ...]
    plan.dropped   ["['mlm_transform']['kernel']", ...]

The backbone (every param under `encoder`, `decoder` or `token_embedder`) must carry over or
grow: a checkpoint of another size is still an error naming the params.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np

from t5lite.errors import ConfigError

Tree = Any
BACKBONE = ("['encoder']", "['decoder']", "['token_embedder']")


@dataclasses.dataclass(frozen=True)
class WarmStartPlan:
  """Which params come from where (jax keystr paths)."""
  carried: tuple[str, ...]
  grown: tuple[str, ...]
  """Vocabulary-sized params whose first rows (columns) come from the checkpoint."""
  new: tuple[str, ...]
  dropped: tuple[str, ...]

  @property
  def exact(self) -> bool:
    return not (self.grown or self.new or self.dropped)

  def summary(self) -> str:
    parts = [f"{len(self.carried)} params carried over"]
    if self.grown:
      parts.append(f"grown for added tokens: {', '.join(self.grown)}")
    if self.new:
      parts.append(f"newly initialized: {', '.join(self.new)}")
    if self.dropped:
      parts.append(f"not used: {', '.join(self.dropped)}")
    return "; ".join(parts)


def _grows(saved: tuple[int, ...], wanted: tuple[int, ...], old_vocab: int,
           new_vocab: int) -> bool:
  """wanted is saved with its vocabulary axis longer (old_vocab -> new_vocab rows)."""
  if len(saved) != len(wanted) or old_vocab >= new_vocab:
    return False
  differ = [i for i, (a, b) in enumerate(zip(saved, wanted)) if a != b]
  return len(differ) == 1 and saved[differ[0]] == old_vocab and wanted[differ[0]] == new_vocab


def plan_warm_start(wanted: Mapping[str, tuple[int, ...]], saved: Mapping[str, tuple[int, ...]],
                    *, old_vocab: int, new_vocab: int, source: str) -> WarmStartPlan:
  """Sorts params into carried / grown / new / dropped; refuses a backbone that differs."""
  carried, grown, new, problems = [], [], [], []
  for key, shape in wanted.items():
    if key in saved and tuple(saved[key]) == tuple(shape):
      carried.append(key)
    elif key in saved and _grows(tuple(saved[key]), tuple(shape), old_vocab, new_vocab):
      grown.append(key)
    elif key in saved:
      problems.append(f"{key}: checkpoint {tuple(saved[key])}, model {tuple(shape)}")
    elif key.startswith(BACKBONE):
      problems.append(f"{key}: missing from the checkpoint")
    else:
      new.append(key)
  if problems:
    more = [f"... and {len(problems) - 10} more"] if len(problems) > 10 else []
    raise ConfigError(f"INITIAL_CHECKPOINT_PATH {source} does not fit this model: its encoder / "
                      "decoder / embeddings differ:\n  " + "\n  ".join(problems[:10] + more)
                      + "\n  (sizes and layer counts must match; a head may differ)")
  dropped = sorted(k for k in saved if k not in wanted)
  return WarmStartPlan(tuple(carried), tuple(grown), tuple(new), tuple(dropped))


def shapes_of(tree: Tree) -> dict[str, tuple[int, ...]]:
  return {jax.tree_util.keystr(p): tuple(x.shape) for p, x in
          jax.tree_util.tree_leaves_with_path(tree)}


def subset_tree(tree: Tree, leaves: Mapping[str, Any]) -> dict:
  """A nested dict (what orbax restores) holding leaves[k] at each keystr path k of `tree`
  that `leaves` names, e.g. abstract params of the checkpoint's shapes."""
  out: dict = {}
  for path, _ in jax.tree_util.tree_leaves_with_path(tree):
    key = jax.tree_util.keystr(path)
    if key in leaves:
      node = out
      names = [str(getattr(k, "key", k)) for k in path]
      for name in names[:-1]:
        node = node.setdefault(name, {})
      node[names[-1]] = leaves[key]
  return out


def merge(fresh: Tree, loaded: Mapping[str, Any], plan: WarmStartPlan) -> Tree:
  """fresh params with the carried ones replaced and the grown ones' old rows overwritten by
  `loaded` ({keystr: array}); each result keeps its fresh leaf's sharding."""
  def pick(path, leaf):
    key = jax.tree_util.keystr(path)
    if key in plan.carried:
      return jax.device_put(loaded[key], leaf.sharding).astype(leaf.dtype)
    if key in plan.grown:  # on the devices: the fresh leaf may span several hosts
      old = np.asarray(loaded[key])  # replicated when restored: every host holds it whole
      index = tuple(slice(0, n) for n in old.shape)
      grow = jax.jit(lambda new, o: new.at[index].set(o.astype(new.dtype)),
                     out_shardings=leaf.sharding)
      return grow(leaf, old)
    return leaf
  return jax.tree_util.tree_map_with_path(pick, fresh)


def flat(tree: Tree) -> dict[str, Any]:
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
