"""t5lite.eval.qa_postprocess: a hand-built window, HF's postprocess_qa_predictions (written
out below as utils_qa.py has it, offsets None outside the context) on random logits over
several windows per example, and the squad head metric's grouping."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from t5lite.eval import qa_postprocess as qa

CONTEXT = "Bo won the cup"
OFFSETS = [(-1, -1)] * 4 + [(0, 2), (3, 6), (7, 10), (11, 14), (-1, -1)]


def test_hand_built_window():
  start = np.array([9, 8, 0, 0, 5, 1, 0, 2, 0], np.float32)
  end = np.array([9, 0, 0, 0, 4, 6, 0, 3, 0], np.float32)
  window = {"example_id": "a", "start_logits": start, "end_logits": end, "offsets": OFFSETS,
            "context": CONTEXT}
  texts, n_best = qa.postprocess_qa_predictions([window])
  assert texts == {"a": "Bo won"}
  assert [a["text"] for a in n_best["a"]][:3] == ["Bo won", "Bo", "Bo won the cup"]
  assert n_best["a"][0]["score"] == 11.0
  assert sum(a["probability"] for a in n_best["a"]) == pytest.approx(1.0)
  # max_answer_length 1 leaves single tokens: "Bo" (5 + 4) beats "won" (1 + 6).
  assert qa.postprocess_qa_predictions([window], max_answer_length=1)[0] == {"a": "Bo"}
  # No context token at all: an empty answer, as HF's fallback.
  assert qa.best_answers([{**window, "offsets": [(-1, -1)] * 9}])[0]["text"] == ""


def hf_postprocess(windows, n_best_size, max_answer_length):
  """HF utils_qa.postprocess_qa_predictions (v1), on feature dicts."""
  features_per_example = collections.defaultdict(list)
  for i, w in enumerate(windows):
    features_per_example[w["example_id"]].append(i)
  out = {}
  for example_id, indices in features_per_example.items():
    prelim = []
    for i in indices:
      start_logits, end_logits = windows[i]["start_logits"], windows[i]["end_logits"]
      offset_mapping = [None if o[0] < 0 else tuple(o) for o in windows[i]["offsets"]]
      start_indexes = np.argsort(start_logits)[-1:-n_best_size - 1:-1].tolist()
      end_indexes = np.argsort(end_logits)[-1:-n_best_size - 1:-1].tolist()
      for s in start_indexes:
        for e in end_indexes:
          if (s >= len(offset_mapping) or e >= len(offset_mapping)
              or offset_mapping[s] is None or offset_mapping[e] is None):
            continue
          if e < s or e - s + 1 > max_answer_length:
            continue
          prelim.append({"offsets": (offset_mapping[s][0], offset_mapping[e][1]),
                         "score": start_logits[s] + end_logits[e]})
    predictions = sorted(prelim, key=lambda x: x["score"], reverse=True)[:n_best_size]
    context = windows[indices[0]]["context"]
    out[example_id] = context[predictions[0]["offsets"][0]:predictions[0]["offsets"][1]] \
        if predictions else ""
  return out


def random_windows(rng, num_examples=6):
  windows = []
  for k in range(num_examples):
    words = [f"w{k}x{i}" for i in range(int(rng.integers(5, 40)))]
    context = " ".join(words)
    spans, position = [], 0
    for word in words:
      spans.append((position, position + len(word)))
      position += len(word) + 1
    room, step = 10, 6
    for start in range(0, max(1, len(spans) - room + step), step):
      chunk = spans[start:start + room]
      offsets = [(-1, -1)] * 4 + chunk + [(-1, -1)]
      windows.append({"example_id": f"e{k}", "context": context, "offsets": np.array(offsets),
                      "start_logits": rng.normal(size=len(offsets)).astype(np.float32),
                      "end_logits": rng.normal(size=len(offsets)).astype(np.float32)})
  order = rng.permutation(len(windows))  # windows of an example need not be adjacent
  return [windows[i] for i in order]


def test_matches_hf_on_random_logits():
  rng = np.random.default_rng(0)
  for n_best, max_len in ((20, 30), (3, 4), (5, 1)):
    windows = random_windows(rng)
    ours, _ = qa.postprocess_qa_predictions(windows, n_best, max_len)
    assert ours == hf_postprocess(windows, n_best, max_len)
    assert list(ours) == list(dict.fromkeys(w["example_id"] for w in windows))


def test_squad_head_metric_groups_windows():
  start = np.array([9, 8, 0, 0, 5, 1, 0, 2, 0], np.float32)
  end = np.array([9, 0, 0, 0, 4, 6, 0, 3, 0], np.float32)
  logits = np.stack([start, end], -1)
  example = {"example_id": "a", "offsets": np.array(OFFSETS), "context": CONTEXT,
             "answers": ["Bo", "Bo won"]}
  weak = {**example, "offsets": np.array([(-1, -1)] * 4 + [(11, 14)] + [(-1, -1)] * 4)}
  other = {**example, "example_id": "b", "answers": ["the cup"]}
  examples = [example, weak, other]  # "a" has two windows; the weak one scores lower
  targets = [qa.qa_head_postprocess(None, example=ex, is_target=True) for ex in examples]
  predictions = [qa.qa_head_postprocess(logits, example=ex) for ex in examples]
  assert targets[0] == {"example_id": "a", "answers": ["Bo", "Bo won"]}
  result = qa.squad_head_metric()(targets, predictions)
  assert result == {"em": 50.0, "f1": pytest.approx(50.0)}  # a: "Bo won" right; b: wrong
