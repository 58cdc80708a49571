"""The span corruption stream (groups of 128 non-empty documents, corrupted a group at a time)
and the in-order reader under every row: same elements as the grain stages they replace,
and a state taken anywhere restores to the same continuation."""
from __future__ import annotations

import grain
import numpy as np
import pytest

from t5lite.data.objectives import chains as pretraining
from t5lite.data.rows import InOrder
from t5lite.errors import ConfigError

SEED = 17


def documents(count: int, seed: int = 0) -> list[dict]:
  """Odd lengths 0..300 (about one in six empty), tokens 3..999."""
  rng = np.random.default_rng(seed)
  lengths = np.where(rng.random(count) < 0.16, 0, rng.integers(1, 301, count))
  return [{"targets": rng.integers(3, 1000, n).astype(np.int32)} for n in lengths]


def corrupt() -> pretraining._CorruptGroup:
  return pretraining._CorruptGroup(length=97, vocab_size=1100, eos=(1, 1), noise_density=0.15,
                                   mean_noise_span_length=3.0)


def stream(docs, epochs=1):
  return pretraining._CorruptedGroups(InOrder(grain.MapDataset.source(docs), epochs),
                                      corrupt(), SEED)


def assert_examples_equal(got, expected):
  assert len(got) == len(expected)
  for a, b in zip(got, expected):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])


def test_groups_are_128_non_empty_documents_each_with_its_own_generator():
  docs = documents(333)
  kept = [d for d in docs if len(d["targets"])]
  groups = [kept[i:i + 128] for i in range(0, len(kept), 128)]
  assert len(groups) == 3 and len(groups[-1]) < 128  # a short last group is corrupted too
  expected = [ex for g, group in enumerate(groups)
              for ex in corrupt().flat_map((group, np.random.default_rng([SEED, g])))]
  got = list(stream(docs))
  assert_examples_equal(got, expected)
  assert len(got) == sum(-(-sum(len(d["targets"]) for d in g) // 97) for g in groups)
  assert all(ex["inputs"][-1] == 1 and ex["targets"][-1] == 1 for ex in got)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_state_taken_anywhere_restores_to_the_same_continuation(epochs):
  docs = documents(290, seed=1)
  everything = list(stream(docs, epochs))
  iterator = iter(stream(docs, epochs))
  states = []
  for k in range(len(everything)):
    if k % 23 == 0 or k in (1, len(everything) - 1):
      states.append((k, iterator.get_state()))
    next(iterator)
  states.append((len(everything), iterator.get_state()))
  for k, state in states:
    restored = iter(stream(docs, epochs))
    restored.set_state(state)
    assert_examples_equal(list(restored), everything[k:])


def test_a_state_of_the_earlier_grain_stages_is_refused_with_the_fix():
  iterator = iter(stream(documents(10)))
  with pytest.raises(ConfigError, match="saved by an earlier t5lite.*new MODEL_DIR"):
    iterator.set_state({"parent": {"next_index": 3}, "index_for_rng": 1})


def test_the_in_order_reader_equals_grains_reader_and_shares_its_state():
  source = grain.MapDataset.source([{"x": np.int32(i)} for i in range(7)])
  ours = iter(InOrder(source, 2))
  grains = iter(source.repeat(2).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
  for _ in range(5):
    assert next(ours)["x"] == next(grains)["x"]
  assert ours.get_state() == grains.get_state() == {"next_index": 5}
  fresh_ours, fresh_grains = iter(InOrder(source, 2)), iter(source.repeat(2).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
  fresh_ours.set_state(grains.get_state())
  fresh_grains.set_state(ours.get_state())
  rest = [int(e["x"]) for e in fresh_ours]
  assert rest == [int(e["x"]) for e in fresh_grains] == [5, 6, 0, 1, 2, 3, 4, 5, 6]
  assert [int(e["x"]) for e in InOrder(source.filter(lambda e: e["x"] % 3), 1)] == [1, 2, 4, 5]
  assert list(InOrder(grain.MapDataset.source([]), None)) == []
