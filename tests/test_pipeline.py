"""The grain pipeline: determinism, exact resume, topology independence, caching, mixtures."""
import json

import numpy as np
import pytest

from t5lite.data import cache, describe, pipeline
from t5lite.data.converters import sequence as conv
from t5lite.data import preprocessors as pp
from t5lite.data.objectives.chains import span_corruption_preprocessors
from t5lite.data.registry import (CACHE_POINT, Feature, MixtureRegistry, TaskRegistry,
                                  add_mixture, add_task)
from t5lite.data.sources.readers import FunctionSource
from t5lite.data.vocab.vocabularies import ByteVocabulary
from t5lite.errors import ConfigError

VOCAB = ByteVocabulary(extra_ids=100)
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}
LENGTHS = {"inputs": 64, "targets": 16}


def documents(n=40, tag="doc"):
  rng = np.random.RandomState(len(tag))
  words = ["alpha", "beta", "gamma", "delta", "épsilon", "ζeta", "eta", "theta"]
  return [{"id": i, "text": f"{tag} {i}: " + " ".join(rng.choice(words, rng.randint(3, 40)))}
          for i in range(n)]


def _docs_a():
  return documents(40, "a")


def _docs_b():
  return documents(24, "bb")


@pytest.fixture(scope="module", autouse=True)
def registered():
  """A span-corruption task, a copy task (text -> text) and a mixture, on byte tokens."""
  names = ["test_pipe_sc", "test_pipe_copy", "test_pipe_copy_b"]
  for name in names + ["test_pipe_mix"]:
    TaskRegistry.remove(name)
    MixtureRegistry.remove(name)
  add_task("test_pipe_sc", {"train": FunctionSource(_docs_a)}, FEATURES,
           [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT,
            *span_corruption_preprocessors()])
  copy = [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, CACHE_POINT,
          pp.append_eos_after_trim]
  add_task("test_pipe_copy", {"train": FunctionSource(_docs_a)}, FEATURES, copy)
  add_task("test_pipe_copy_b", {"train": FunctionSource(_docs_b)}, FEATURES, copy)
  add_mixture("test_pipe_mix", [("test_pipe_copy", 3.0), ("test_pipe_copy_b", 1.0)])
  yield
  for name in names:
    TaskRegistry.remove(name)
  MixtureRegistry.remove("test_pipe_mix")


def batches(name, n, *, process_index=0, process_count=1, state=None, pack=True,
            num_workers=0, **config):
  config = pipeline.PipelineConfig(**{"global_batch_size": 8, "task_feature_lengths": LENGTHS,
                                      **config})
  it = pipeline.get_dataset(name, config, conv.EncDecFeatureConverter(pack=pack),
                            process_index=process_index, process_count=process_count,
                            num_workers=num_workers)
  if state is not None:
    it.set_state(state)
  return it, [next(it) for _ in range(n)]


def assert_same(a, b):
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def concat_rows(parts):
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def test_same_seed_same_batches_and_seed_matters():
  _, first = batches("test_pipe_sc", 3, seed=1)
  _, again = batches("test_pipe_sc", 3, seed=1)
  _, other = batches("test_pipe_sc", 3, seed=2)
  for a, b in zip(first, again):
    assert_same(a, b)
  assert not np.array_equal(first[0]["encoder_input_tokens"], other[0]["encoder_input_tokens"])
  assert first[0]["encoder_input_tokens"].shape == (8, 64)
  assert first[0]["decoder_target_tokens"].shape == (8, 16)


@pytest.mark.parametrize("name", ["test_pipe_sc", "test_pipe_mix"])
def test_restored_iterator_continues_with_the_identical_next_batches(name):
  it, _ = batches(name, 4, seed=3)
  state = json.loads(json.dumps(it.get_state()))  # the state survives JSON
  expected = [next(it) for _ in range(3)]
  _, resumed = batches(name, 3, seed=3, state=state)
  for a, b in zip(expected, resumed):
    assert_same(a, b)


@pytest.mark.parametrize("saved_with, restored_with", [(1, 2), (2, 1), (2, 4), (4, 1)])
def test_resume_on_another_topology_neither_repeats_nor_skips(saved_with, restored_with):
  saving = [batches("test_pipe_sc", 2, seed=5, process_index=i, process_count=saved_with)[0]
            for i in range(saved_with)]
  state = pipeline.merge_states([it.get_state() for it in saving])
  expected = [concat_rows([next(it) for it in saving]) for _ in range(3)]
  restored = [batches("test_pipe_sc", 0, seed=5, process_index=i, process_count=restored_with,
                      state=state)[0] for i in range(restored_with)]
  for want in expected:
    assert_same(concat_rows([next(it) for it in restored]), want)


def test_global_batches_do_not_depend_on_the_process_count():
  _, whole = batches("test_pipe_sc", 2, seed=7)
  halves = [batches("test_pipe_sc", 2, seed=7, process_index=i, process_count=2)[1]
            for i in range(2)]
  for step in range(2):
    assert_same(concat_rows([halves[0][step], halves[1][step]]), whole[step])


def test_two_processes_read_disjoint_shards_that_cover_the_data():
  """One epoch, unpacked copy task: every document appears exactly once over both processes."""
  seen = []
  for process in range(2):
    it, _ = batches("test_pipe_copy", 0, seed=0, process_index=process, process_count=2,
                    num_epochs=1, pack=False, global_batch_size=4)
    while True:
      try:
        batch = next(it)
      except StopIteration:
        break
      for row, segments in zip(batch["encoder_input_tokens"], batch["encoder_segment_ids"]):
        text = VOCAB.decode(row[segments > 0].tolist())
        seen.append((process, int(text.split(":")[0].split()[1])))
  ids = [doc_id for _, doc_id in seen]
  assert sorted(ids) == list(range(40))
  per_process = [{i for p, i in seen if p == process} for process in range(2)]
  assert not per_process[0] & per_process[1]


def test_mixture_follows_its_rates():
  _, out = batches("test_pipe_mix", 12, seed=0, pack=False)
  texts = [VOCAB.decode(row[seg > 0].tolist()) for b in out
           for row, seg in zip(b["encoder_input_tokens"], b["encoder_segment_ids"])]
  share_a = sum(t.startswith("a ") for t in texts) / len(texts)
  assert abs(share_a - 0.75) < 0.1, share_a


def test_packing_puts_several_examples_in_a_row():
  long = {"inputs": 512, "targets": 512}  # room for several whole documents per row
  _, out = batches("test_pipe_copy", 2, seed=0, task_feature_lengths=long)
  segments = out[0]["encoder_segment_ids"]
  assert segments.max() >= 2  # short copy examples share rows
  stats = describe.task_stats("test_pipe_copy", "train", long,
                              lambda pack: conv.EncDecFeatureConverter(pack=pack), max_examples=40)
  assert stats["packing_efficiency"] > stats["padding_efficiency"]


def test_cached_task_gives_the_same_batches_and_missing_cache_is_explained(tmp_path):
  task = TaskRegistry.get("test_pipe_sc")
  with pytest.raises(FileNotFoundError, match="t5lite cache test_pipe_sc --split train"):
    batches("test_pipe_sc", 1, use_cached=True, cache_dir=str(tmp_path))
  cache.cache_task(task, "train", str(tmp_path), worker_index=1, num_workers=2)
  with pytest.raises(FileNotFoundError, match="1 of 2 finished shards"):
    batches("test_pipe_sc", 1, use_cached=True, cache_dir=str(tmp_path))
  info = cache.cache_task(task, "train", str(tmp_path), worker_index=0, num_workers=2)
  assert info["examples"] == 20
  _, cached = batches("test_pipe_sc", 2, seed=4, use_cached=True, cache_dir=str(tmp_path))
  _, fresh = batches("test_pipe_sc", 2, seed=4)
  for a, b in zip(cached, fresh):
    assert_same(a, b)


def test_bad_setups_are_explained():
  with pytest.raises(ValueError, match="does not divide evenly over 3 processes"):
    batches("test_pipe_sc", 1, process_count=3)
  with pytest.raises(ValueError, match="fewer than the global batch size 64"):
    batches("test_pipe_copy_b", 1, global_batch_size=64)
  it, _ = batches("test_pipe_sc", 1, seed=1)
  state = it.get_state()
  with pytest.raises(ValueError, match="seed=1, this run has 2"):
    batches("test_pipe_sc", 0, seed=2, state=state)


@pytest.mark.e2e
@pytest.mark.slow
def test_worker_processes_give_the_same_batches_and_states():
  """Rows computed in 2 spawned workers: identical batches, and states that restore
  in-process (and vice versa) exactly where the consumer stopped, prefetch or not."""
  _, expected = batches("test_pipe_sc", 4, seed=9)
  workers, got = batches("test_pipe_sc", 2, seed=9, num_workers=2)
  try:
    for a, b in zip(expected[:2], got):
      assert_same(a, b)
    state = json.loads(json.dumps(workers.get_state()))
    _, resumed = batches("test_pipe_sc", 2, seed=9, state=state)
    for a, b in zip(expected[2:], resumed):
      assert_same(a, b)
    fresh, _ = batches("test_pipe_sc", 1, seed=9)
    workers.set_state(fresh.get_state())
    for want in expected[1:3]:
      assert_same(next(workers), want)
  finally:
    workers.close()


def _ten():
  return documents(10, "t")


@pytest.fixture
def small_tasks():
  """Ten documents: for epochs that do not divide evenly over the rows."""
  copy = [pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize, pp.append_eos_after_trim]
  tasks = {"test_pipe_ten": dict(), "test_pipe_ten_window": dict(shuffle_buffer_size=2)}
  for name, extra in tasks.items():
    TaskRegistry.remove(name)
    add_task(name, {"train": FunctionSource(_ten)}, FEATURES, copy, **extra)
  yield
  for name in tasks:
    TaskRegistry.remove(name)


def _doc_ids(batch):
  ids = []
  for row, segments in zip(batch["encoder_input_tokens"], batch["encoder_segment_ids"]):
    if segments.any():
      ids.append(int(VOCAB.decode(row[segments > 0].tolist()).split(":")[0].split()[1]))
  return ids


@pytest.mark.parametrize("name, shuffle", [("test_pipe_ten", False), ("test_pipe_ten", True),
                                           ("test_pipe_ten_window", True)])
def test_finite_epochs_cover_every_example_once_per_epoch(small_tasks, name, shuffle):
  """10 examples over 4 rows: rows finish at different steps, finished rows are all-zero
  padding, and every example appears exactly once per epoch (in order when not shuffled)."""
  it, _ = batches(name, 0, pack=False, shuffle=shuffle, num_epochs=2, global_batch_size=4)
  seen = [_doc_ids(b) for b in it]
  flat = [i for ids in seen for i in ids]
  assert sorted(flat) == sorted(list(range(10)) * 2)
  assert len(seen) == 6 and [len(ids) for ids in seen][-1] == 2  # rows 0, 1 hold 3 per epoch
  if not shuffle:  # each row repeats on its own: rows 2 and 3 start epoch 2 at step 2
    assert seen[0] == [0, 1, 2, 3] and seen[2] == [8, 9, 2, 3] and seen[5] == [8, 9]


def test_mixture_rows_draw_their_tasks_independently():
  _, out = batches("test_pipe_mix", 6, seed=0, pack=False)
  per_step = [{VOCAB.decode(r[s > 0].tolist())[0] for r, s in
               zip(b["encoder_input_tokens"], b["encoder_segment_ids"])} for b in out]
  assert any(len(tasks) == 2 for tasks in per_step)  # both tasks within one global batch


def test_a_row_that_preprocessing_empties_fails_clearly(small_tasks):
  keep_one = pp.filter_by(lambda ex: ex["text"].startswith("t 0:"))
  TaskRegistry.remove("test_pipe_one")
  add_task("test_pipe_one", {"train": FunctionSource(_ten)}, FEATURES,
           [keep_one, pp.rekey({"inputs": "text", "targets": "text"}), pp.tokenize,
            pp.append_eos_after_trim])
  try:
    with pytest.raises(ValueError, match="batch row 1: preprocessing dropped every one"):
      batches("test_pipe_one", 1, global_batch_size=2)
  finally:
    TaskRegistry.remove("test_pipe_one")


def test_state_of_another_pipeline_is_refused():
  it, _ = batches("test_pipe_sc", 1, seed=1)
  state = it.get_state()
  with pytest.raises(ValueError, match="restoring it would skip or repeat examples"):
    batches("test_pipe_sc", 0, seed=1, state=state, task_feature_lengths={"inputs": 32,
                                                                          "targets": 8})


@pytest.mark.parametrize("objective", ["causal_lm", "prefix_lm", "mlm", "text_infilling"])
def test_every_objective_chain_runs_through_the_pipeline(objective):
  """Each chain on real packing: no token cut by the converter (prefix LM halves fit)."""
  from t5lite.data.objectives import chains as pretraining
  chain = {"causal_lm": pretraining.causal_lm_preprocessors(),
           "prefix_lm": pretraining.prefix_lm_preprocessors(),
           "mlm": pretraining.mlm_preprocessors(mask_id=VOCAB.extra_id(0)),
           "text_infilling": pretraining.text_infilling_preprocessors(mask_id=VOCAB.extra_id(0))
           }[objective]
  name = f"test_pipe_{objective}"
  TaskRegistry.remove(name)
  add_task(name, {"train": FunctionSource(_docs_a)}, FEATURES,
           [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT, *chain])
  try:
    lengths = {"inputs": 32, "targets": 32}
    examples = describe.preprocessed_examples(TaskRegistry.get(name), "train", lengths, 30)
    for ex in examples:
      if objective == "causal_lm":
        assert len(ex["targets"]) <= 32 and 1 not in ex["targets"]
      elif objective == "mlm":
        assert len(ex["inputs"]) == len(ex["targets"]) <= 32 and ex["weights"].sum() >= 1
      else:
        assert len(ex["inputs"]) <= 32 and len(ex["targets"]) <= 32
        assert ex["targets"][-1] == 1
    if objective == "prefix_lm":  # the halves are the piece: nothing lost
      assert all(len(ex["inputs"]) + len(ex["targets"]) == 31 + 2 for ex in examples[:20])
    converter = {"causal_lm": conv.DecoderOnlyFeatureConverter(),
                 "mlm": conv.EncoderOnlyFeatureConverter()}.get(
        objective, conv.EncDecFeatureConverter())
    if objective == "causal_lm":  # an LM task's lengths; 'inputs' would ask for a prompt
      with pytest.raises(ConfigError, match="give a language-modelling task {'targets': N}"):
        next(pipeline.get_dataset(name, pipeline.PipelineConfig(
            global_batch_size=2, task_feature_lengths=lengths), converter))
      lengths = {"targets": 32}
    config = pipeline.PipelineConfig(global_batch_size=2, task_feature_lengths=lengths)
    batch = next(pipeline.get_dataset(name, config, converter))
    assert all(v.shape[0] == 2 for v in batch.values())
  finally:
    TaskRegistry.remove(name)


def test_worker_processes_end_finite_epochs_like_the_in_process_iterator(small_tasks):
  in_process, _ = batches("test_pipe_ten", 0, pack=False, shuffle=False, num_epochs=1,
                          global_batch_size=4)
  expected = list(in_process)
  workers, _ = batches("test_pipe_ten", 0, pack=False, shuffle=False, num_epochs=1,
                       global_batch_size=4, num_workers=2)
  try:
    got = list(workers)
  finally:
    workers.close()
  assert len(got) == len(expected) == 3
  for a, b in zip(got, expected):
    assert_same(a, b)
