"""`t5lite bench data`: the report's figures, and both sides doing the same span corruption."""
import json

import numpy as np
import pytest

from t5lite.bench import data as bench
from t5lite.bench import hf_t5_collator as hf
from t5lite.data import describe
from t5lite.data.objectives.span_corruption import span_corruption_lengths

VOCAB = 1_000_000  # test ids stay below 400_000; sentinels count down from 999_999
FIELDS = ("t5lite_examples_per_s", "hf_examples_per_s", "ratio_vs_hf", "inputs_length",
          "batch_size", "repeats", "cores_for_1000_seq_s")


def token_documents(n=300, seed=0):
  """Documents of distinct ids (2, 3, 4, ...), so a reconstruction pins every position."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(1, 400, n)
  ids = np.arange(2, 2 + sizes.sum(), dtype=np.int32)
  return np.split(ids, np.cumsum(sizes)[:-1])


def split_at_sentinels(seq, vocab_size):
  """[a a S b S c] -> [[a a], [b], [c]] for sentinels S (ids of the top 1000)."""
  parts = [[]]
  for token in seq:
    if token >= vocab_size - 1000:
      parts.append([])
    else:
      parts[-1].append(token)
  return parts


def check_span_corruption(raw, inputs, targets, vocab_size):
  """inputs / targets (EOS included) are T5 span corruption of raw (as corruption.py does it)."""
  inputs, targets = [int(t) for t in inputs], [int(t) for t in targets]
  assert inputs[-1] == 1 and targets[-1] == 1  # EOS on both
  inputs, targets = inputs[:-1], targets[:-1]
  if len(raw) < 2:  # the reference's degenerate case: the mask is all non-noise
    assert (inputs, targets) == ([int(t) for t in raw], [vocab_size - 1])
    return
  spans = sum(t >= vocab_size - 1000 for t in inputs)
  expected = list(range(vocab_size - 1, vocab_size - 1 - spans, -1))
  assert [t for t in inputs if t >= vocab_size - 1000] == expected  # <X0> <X1> ... in order
  assert [t for t in targets if t >= vocab_size - 1000] == expected
  assert targets[0] == vocab_size - 1 and inputs[-1] == expected[-1]  # non-noise first, noise last
  nonnoise = split_at_sentinels(inputs, vocab_size)
  noise = split_at_sentinels(targets, vocab_size)[1:]
  assert all(noise) and all(nonnoise[:-1]) and not nonnoise[-1]  # positive span lengths
  restored = [t for pair in zip(nonnoise, noise) for part in pair for t in part]
  assert restored == [int(t) for t in raw]
  # Noise and span counts as T5's float32 helper computes them.
  noise_tokens = min(max(int(np.round(np.float32(len(raw)) * np.float32(0.15))), 1), len(raw) - 1)
  assert sum(map(len, noise)) == noise_tokens
  assert spans == max(int(np.round(np.float32(noise_tokens) / np.float32(3.0))), 1)


def test_run_reports_positive_figures():
  report = bench.run(inputs_length=64, batch_size=4, repeats=2, seconds_per_run=0.05,
                     documents=token_documents(), vocab_size=VOCAB, log=None)
  for field in FIELDS:
    assert report[field] > 0, field
  assert (report["inputs_length"], report["batch_size"], report["repeats"]) == (64, 4, 2)
  assert report["ratio_vs_hf"] == pytest.approx(
      report["t5lite_examples_per_s"] / report["hf_examples_per_s"], rel=0.01)
  assert bench.TASK_NAME not in bench.TaskRegistry.names()  # the run cleans up after itself


@pytest.mark.e2e
@pytest.mark.slow
def test_main_ends_with_one_json_line(capsys):
  assert bench.main(["--inputs_length", "32", "--batch_size", "2", "--repeats", "1",
                     "--seconds_per_run", "0.02"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  report = json.loads(lines[-1])
  assert report["bench"] == "data" and all(report[f] > 0 for f in FIELDS)
  assert not any(line.startswith("{") for line in lines[:-1])


@pytest.mark.parametrize("inputs_length", [32, 128, 512, 1024, 2048])
def test_hf_lengths_helper_agrees_with_t5lite(inputs_length):
  assert hf.compute_input_and_target_lengths(inputs_length, 0.15, 3.0) == \
      span_corruption_lengths(inputs_length)


def test_hf_collator_docstring_examples():
  collator = hf.FlaxDataCollatorForT5MLM(vocab_size=100)
  sentinels = collator.create_sentinel_ids(np.array([[0, 1, 1, 0, 1]], np.int8))
  np.testing.assert_array_equal(sentinels, [[0, 99, -1, 0, 98]])
  np.testing.assert_array_equal(collator.filter_input_ids(np.array([[5, 6, 7, 8, 9]]), sentinels),
                                [[5, 99, 8, 98, 1]])
  np.testing.assert_array_equal(hf.shift_tokens_right(np.array([[5, 6, 1]]), 0, 0), [[0, 5, 6]])
  chunks = hf.group_texts([np.array([1, 2]), np.array([3, 4, 5, 6]), np.array([7, 8])], 3)
  assert [c.tolist() for c in chunks] == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("inputs_length", [64, 512])
def test_hf_side_is_t5_span_corruption(inputs_length):
  """HF's collator on grouped chunks: exact lengths, sentinel layout, and inputs + labels
  put back together give the chunk, so both sides of the benchmark do the same work."""
  expanded, targets_length = hf.compute_input_and_target_lengths(inputs_length, 0.15, 3.0)
  collator = hf.FlaxDataCollatorForT5MLM(vocab_size=VOCAB, input_length=inputs_length,
                                         target_length=targets_length, seed=3)
  # 1000 documents: exactly HF's first map batch, so every chunk is a run of consecutive ids.
  batches = hf.HFBatches(token_documents(1000), collator, 8, expanded, seed=3)
  batch = next(batches)
  # Rows are permuted chunks; each is recovered from its first token (always non-noise).
  assert batch["input_ids"].shape == (8, inputs_length)
  assert batch["labels"].shape == batch["decoder_input_ids"].shape == (8, targets_length)
  for inputs, labels, decoder in zip(batch["input_ids"], batch["labels"],
                                     batch["decoder_input_ids"]):
    first = int(inputs[0])  # the chunk starts with non-noise
    check_span_corruption(np.arange(first, first + expanded), inputs, labels, VOCAB)
    np.testing.assert_array_equal(decoder, np.concatenate([[0], labels[:-1]]))


def test_hf_noise_mask_counts_and_shape():
  collator = hf.FlaxDataCollatorForT5MLM(vocab_size=VOCAB, seed=1)
  for _ in range(20):
    mask = collator.random_spans_noise_mask(568)
    starts = np.flatnonzero(mask[1:] & ~mask[:-1])
    assert mask.sum() == 85 and len(starts) == 28 and not mask[0] and mask[-1]


def test_t5lite_side_is_t5_span_corruption():
  """The benchmark's task, in source order: full pieces give exactly inputs_length / targets
  length, and the pieces put back together are the concatenated documents."""
  documents = token_documents(140)
  task = bench.register_task(documents, VOCAB)
  try:
    raw, targets_length = span_corruption_lengths(64)
    examples = describe.preprocessed_examples(task, "train", {"inputs": 64,
                                                              "targets": targets_length}, 1000)
  finally:
    bench.TaskRegistry.remove(bench.TASK_NAME)
  stream = np.concatenate(documents[:128])  # the first group of 128 documents
  pieces = [stream[i:i + raw] for i in range(0, len(stream), raw)]
  assert len(examples) >= len(pieces)
  for piece, ex in zip(pieces, examples):
    check_span_corruption(piece, ex["inputs"], ex["targets"], VOCAB)
    if len(piece) == raw:
      assert (len(ex["inputs"]), len(ex["targets"])) == (64, targets_length)


def test_streamed_corpus_benchmark_measures_a_c4_shaped_corpus(tmp_path):
  """`bench data --source`: the corpus is C4-shaped and as big as asked, and one measurement
  (in this process) reports its figures and an exact resume."""
  import glob
  import gzip
  from t5lite.bench import data_stream
  pattern = data_stream.synthesize(str(tmp_path), 0.002, shards=4)
  files = sorted(glob.glob(pattern))
  assert len(files) == 4
  records = [json.loads(line) for f in files for line in gzip.open(f, "rt", encoding="utf-8")]
  assert set(records[0]) == {"text", "timestamp", "url"}
  assert 0.002e9 <= sum(len(json.dumps(r)) + 1 for r in records) < 0.0021e9 + 4 * 20_000
  assert data_stream.synthesize(str(tmp_path), 0.002, shards=4) == pattern  # kept, not rewritten
  report = data_stream.measure("jsonl_gz", pattern, batch_size=4, batches=3)
  assert report["resume_exact"] is True and report["examples_per_s"] > 0
  assert report["peak_rss_mb"] >= report["rss_after_imports_mb"] > 0
