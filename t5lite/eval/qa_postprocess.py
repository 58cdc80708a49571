"""Extractive QA post-processing: start / end logits of each window -> the answer text (HF's
`postprocess_qa_predictions` in examples/pytorch/question-answering/utils_qa.py, SQuAD v1).

For each window of an example, the n_best highest start and end logits are paired; a pair
is a candidate when both tokens are context tokens (offsets >= 0), end >= start and it spans
at most max_answer_length tokens; its score is start logit + end logit. The best candidate
over all windows of the example is the answer, its text cut from the context through the
offsets. Worked example (one window, context "Bo won the cup"):

  tokens   [CLS] who  won  [SEP]  bo     won    the     cup     [SEP]
  offsets  -1    -1   -1   -1     (0,2)  (3,6)  (7,10)  (11,14) -1
  start    9     8    0    0      5      1      0       2       0
  end      9     0    0    0      4      6      0       3       0
  -> best valid pair: start 4 (bo, 5) + end 5 (won, 6) = 11 -> "Bo won"
     ([CLS] scores 18 but is no context token; SQuAD v1.1 always has an answer)

squad_head_metric() is the task metric: it groups the windows (one evaluator example each)
by example_id and scores each example's answer with SQuAD's EM / F1 (metrics.squad).
"""
from __future__ import annotations

import collections
from typing import Mapping, Sequence

import numpy as np

from t5lite.eval import metrics

N_BEST_SIZE, MAX_ANSWER_LENGTH = 20, 30  # HF run_qa's defaults


def window_candidates(start_logits, end_logits, offsets, n_best_size: int = N_BEST_SIZE,
                      max_answer_length: int = MAX_ANSWER_LENGTH) -> list[dict]:
  """The valid (start, end) pairs among one window's n_best starts and ends, as
  {"score", "start_logit", "end_logit", "offsets": (first char, end char)}."""
  start_logits, end_logits = np.asarray(start_logits), np.asarray(end_logits)
  offsets = np.asarray(offsets).reshape(-1, 2)
  # The n_best largest, largest first (ties: the later index, as HF's argsort slice).
  starts = np.argsort(start_logits)[-1:-n_best_size - 1:-1]
  ends = np.argsort(end_logits)[-1:-n_best_size - 1:-1]
  out = []
  for s in starts:
    for e in ends:
      if s >= len(offsets) or e >= len(offsets) or offsets[s, 0] < 0 or offsets[e, 0] < 0:
        continue  # a question, special or padding token
      if e < s or e - s + 1 > max_answer_length:
        continue
      out.append({"score": float(start_logits[s] + end_logits[e]),
                  "start_logit": float(start_logits[s]), "end_logit": float(end_logits[e]),
                  "offsets": (int(offsets[s, 0]), int(offsets[e, 1]))})
  return out


def best_answers(windows: Sequence[Mapping], n_best_size: int = N_BEST_SIZE,
                 max_answer_length: int = MAX_ANSWER_LENGTH) -> list[dict]:
  """One example's n-best answers over its windows, best first: {"text", "score",
  "start_logit", "end_logit", "probability"} (softmax of the scores over the n best).

  windows: {"start_logits", "end_logits", "offsets", "context"} per window. No valid span
  anywhere gives [{"text": "", ...}] (HF writes "empty").
  """
  candidates = [c for w in windows for c in window_candidates(
      w["start_logits"], w["end_logits"], w["offsets"], n_best_size, max_answer_length)]
  # Stable: equal scores keep window order, as HF's sorted().
  candidates = sorted(candidates, key=lambda c: c["score"], reverse=True)[:n_best_size]
  context = windows[0]["context"] if windows else ""
  answers = [{"text": context[c["offsets"][0]:c["offsets"][1]], "score": c["score"],
              "start_logit": c["start_logit"], "end_logit": c["end_logit"]} for c in candidates]
  if not answers:
    answers = [{"text": "", "score": 0.0, "start_logit": 0.0, "end_logit": 0.0}]
  scores = np.array([a["score"] for a in answers])
  probabilities = np.exp(scores - scores.max())
  for answer, p in zip(answers, probabilities / probabilities.sum()):
    answer["probability"] = float(p)
  return answers


def postprocess_qa_predictions(windows: Sequence[Mapping], n_best_size: int = N_BEST_SIZE,
                               max_answer_length: int = MAX_ANSWER_LENGTH
                               ) -> tuple[dict[str, str], dict[str, list[dict]]]:
  """Windows of many examples ({"example_id", "start_logits", "end_logits", "offsets",
  "context"}) -> ({example_id: answer text}, {example_id: n-best list}), in the order the
  examples first appear."""
  groups = collections.defaultdict(list)
  for w in windows:
    groups[w["example_id"]].append(w)
  n_best = {i: best_answers(ws, n_best_size, max_answer_length) for i, ws in groups.items()}
  return {i: answers[0]["text"] for i, answers in n_best.items()}, n_best


def qa_head_postprocess(output, example=None, is_target: bool = False) -> dict:
  """A question-answering task's postprocess_fn. Targets: {"example_id", "answers"};
  predictions: the window's start / end logits (output (L, 2)) with its offsets and context,
  for squad_head_metric to combine with the example's other windows."""
  if is_target:
    return {"example_id": example["example_id"], "answers": list(example["answers"])}
  output = np.asarray(output, np.float32)
  return {"example_id": example["example_id"], "start_logits": output[:, 0],
          "end_logits": output[:, 1], "offsets": np.asarray(example["offsets"]),
          "context": example["context"]}


def squad_head_metric(n_best_size: int = N_BEST_SIZE,
                      max_answer_length: int = MAX_ANSWER_LENGTH):
  """A metric fn (targets, predictions) over windows: each example's best answer (over its
  windows) scored against all its reference answers -> {"em", "f1"} (SQuAD v1.1's)."""
  def squad_head(targets, predictions) -> metrics.Metrics:
    if len(targets) != len(predictions):
      raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")
    texts, _ = postprocess_qa_predictions(predictions, n_best_size, max_answer_length)
    references = {}
    for t in targets:
      references.setdefault(t["example_id"], t["answers"])
    ids = list(texts)
    return metrics.squad([references[i] for i in ids], [texts[i] for i in ids])
  squad_head.__name__ = "squad_head"
  return squad_head
