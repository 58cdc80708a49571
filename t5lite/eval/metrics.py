"""Metric functions `(targets, predictions) -> {name: value}`, as T5 defines them.

Names, result keys and scales follow t5.evaluation.metrics: accuracy, F1, exact match,
BLEU, ROUGE and the correlations are percentages (0-100). Targets and predictions are what
a task's postprocess_fn returns: class ids, floats, strings, or (for targets) lists of
reference strings. BLEU is sacrebleu and ROUGE is rouge-score, with T5's settings; they and
scipy (the correlations) are imported on first use, so registering tasks does not load them.
"""
from __future__ import annotations

import collections
import re
import string
from typing import Callable, Sequence

import numpy as np

Metrics = dict[str, float]
MetricFn = Callable[[Sequence, Sequence], Metrics]


def _check(targets: Sequence, predictions: Sequence) -> None:
  if len(targets) != len(predictions):
    raise ValueError(f"{len(targets)} targets but {len(predictions)} predictions")


def _percent_equal(targets: Sequence, predictions: Sequence) -> float:
  _check(targets, predictions)
  return 100 * float(np.mean([t == p for t, p in zip(targets, predictions)]))


def accuracy(targets, predictions) -> Metrics:
  """Percent of predictions equal to their target: [0, 1, 1, 0] vs [0, 1, 0, 0] -> 75.0."""
  return {"accuracy": _percent_equal(targets, predictions)}


def sequence_accuracy(targets, predictions) -> Metrics:
  """Percent of predicted strings exactly equal to their target (per-example exact match)."""
  return {"sequence_accuracy": _percent_equal(targets, predictions)}


def exact_match(targets, predictions) -> Metrics:
  """100 if every prediction equals its target, else 0 (T5's `all_match`). Per group
  (mean_group_metric) it is MultiRC's EM; the per-example rate is sequence_accuracy."""
  _check(targets, predictions)
  return {"exact_match": 100 * float(all(t == p for t, p in zip(targets, predictions)))}


all_match = exact_match


def _f1(tp: int, fp: int, fn: int) -> float:
  # sklearn's convention: 0 when the class is neither present nor predicted.
  denominator = 2 * tp + fp + fn
  return 2 * tp / denominator if denominator else 0.0


def f1_score_with_invalid(targets, predictions) -> Metrics:
  """Binary F1 (positive class 1) where a prediction other than 0 or 1 counts as wrong.

  Example: targets [1, 1, 0, 0], predictions [1, -1, 1, 0] -> tp 1, fn 1, fp 1 -> 50.0
  """
  _check(targets, predictions)
  t, p = np.asarray(targets, int), np.asarray(predictions, int)
  # An invalid prediction becomes the opposite of its target, so it is always an error.
  p = np.where((p == 0) | (p == 1), p, 1 - t)
  tp, fp, fn = np.sum((t == 1) & (p == 1)), np.sum((t == 0) & (p == 1)), np.sum((t == 1) & (p == 0))
  return {"f1": 100 * _f1(tp, fp, fn)}


def mean_multiclass_f1(num_classes: int) -> MetricFn:
  """A metric: the unweighted mean over classes 0..num_classes-1 of each class's F1.

  Invalid predictions (-1) belong to no class: they are misses of the true class.
  Example (3 classes): targets [0, 1, 2, 2], predictions [0, 1, 2, 1] -> F1s 1, 2/3, 2/3
    -> {"mean_3class_f1": 77.78}
  """
  def fn(targets, predictions) -> Metrics:
    _check(targets, predictions)
    t, p = np.asarray(targets, int), np.asarray(predictions, int)
    f1s = [_f1(np.sum((t == c) & (p == c)), np.sum((t != c) & (p == c)),
               np.sum((t == c) & (p != c))) for c in range(num_classes)]
    return {f"mean_{num_classes}class_f1": 100 * float(np.mean(f1s))}
  fn.__name__ = f"mean_{num_classes}class_f1"
  return fn


def matthews_corrcoef(targets, predictions) -> Metrics:
  """Matthews correlation x 100, in the multiclass form sklearn uses (invalid predictions,
  e.g. -1, are one more class): with s examples, c correct, t_k / p_k the true / predicted
  counts of class k, MCC = (c s - sum p_k t_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2)),
  0 when the denominator is 0. For two classes it is (TP TN - FP FN) / sqrt(...).

  Example: targets [1, 1, 0, 0], predictions [1, 0, 0, 0] -> 2 / sqrt(12) -> 57.735
  """
  _check(targets, predictions)
  t, p = np.asarray(targets), np.asarray(predictions)
  labels = np.unique(np.concatenate([t, p]))
  t_counts = np.array([np.sum(t == k) for k in labels], np.float64)
  p_counts = np.array([np.sum(p == k) for k in labels], np.float64)
  s, c = float(len(t)), float(np.sum(t == p))
  covariance = c * s - p_counts @ t_counts
  denominator = np.sqrt((s * s - p_counts @ p_counts) * (s * s - t_counts @ t_counts))
  return {"matthews_corrcoef": 100 * float(covariance / denominator) if denominator else 0.0}


def pearson_corrcoef(targets, predictions) -> Metrics:
  """Pearson correlation x 100 (scipy)."""
  import scipy.stats  # 0.6 s to import: on first use
  return {"pearson_corrcoef": 100 * float(scipy.stats.pearsonr(targets, predictions)[0])}


def spearman_corrcoef(targets, predictions) -> Metrics:
  """Spearman rank correlation x 100 (scipy)."""
  import scipy.stats
  return {"spearman_corrcoef": 100 * float(scipy.stats.spearmanr(targets, predictions)[0])}


def bleu(targets, predictions, tokenizer: str = "intl") -> Metrics:
  """Corpus BLEU (sacrebleu) with T5's settings: 'intl' tokenization, 'exp' smoothing, case
  kept, no effective order. A target may be a list of references (the same number each)."""
  import sacrebleu  # An eval-time dependency: registration must not need it.
  _check(targets, predictions)
  if targets and isinstance(targets[0], (list, tuple)):
    # sacrebleu wants one stream per reference position, not one list per example.
    references = [list(stream) for stream in zip(*targets)]
  else:
    references = [list(targets)]
  score = sacrebleu.corpus_bleu(list(predictions), references, smooth_method="exp",
                                smooth_value=0.0, force=False, lowercase=False,
                                tokenize=tokenizer, use_effective_order=False)
  return {"bleu": float(score.score)}


def rouge(targets, predictions, score_keys=("rouge1", "rouge2", "rougeLsum")) -> Metrics:
  """Mean ROUGE F-measure x 100 (rouge-score, no stemming, its default tokenizer).

  As T5 does, " . " becomes " .\\n" so that rougeLsum sees one sentence per line. T5 reports
  the bootstrap median of the same per-example scores; their mean, which that median
  estimates, is reported here so that results do not depend on a random resampling.
  """
  from rouge_score import rouge_scorer  # An eval-time dependency, like sacrebleu.
  _check(targets, predictions)
  scorer = rouge_scorer.RougeScorer(list(score_keys))
  lines = lambda text: text.replace(" . ", " .\n")
  scores = [scorer.score(target=lines(t), prediction=lines(p))
            for t, p in zip(targets, predictions)]
  return {key: 100 * float(np.mean([s[key].fmeasure for s in scores])) for key in score_keys}


def normalize_squad(text: str) -> str:
  """SQuAD v1.1's answer normalization: lower case, no punctuation, no articles, single spaces.

  Example: "The  Eiffel Tower!" -> "eiffel tower"
  """
  text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
  text = re.sub(r"\b(a|an|the)\b", " ", text)
  return " ".join(text.split())


def _token_f1(target: str, prediction: str) -> float:
  common = collections.Counter(target.split()) & collections.Counter(prediction.split())
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(prediction.split()), same / len(target.split())
  return 2 * precision * recall / (precision + recall)


def squad(targets, predictions) -> Metrics:
  """SQuAD exact match and token F1 (x 100), each the max over an example's reference answers.

  Example: targets [["the cat", "a dog sat"]], predictions ["cat sat"]
    -> {"em": 0.0, "f1": 66.67}  (best: "cat" vs "cat sat", precision 1/2, recall 1)
  """
  _check(targets, predictions)
  em, f1 = [], []
  for answers, prediction in zip(targets, predictions):
    answers = [answers] if isinstance(answers, str) else list(answers)
    answers, prediction = [normalize_squad(a) for a in answers], normalize_squad(prediction)
    em.append(max(float(a == prediction) for a in answers))
    f1.append(max(_token_f1(a, prediction) for a in answers))
  return {"em": 100 * float(np.mean(em)), "f1": 100 * float(np.mean(f1))}


def mean_group_metric(metric_fn: MetricFn, group_key: str = "group",
                      value_key: str = "value") -> MetricFn:
  """A metric: metric_fn on each group of {group_key, value_key} targets, averaged over groups.

  Example: mean_group_metric(exact_match) on targets [{"group": 0, "value": 1},
    {"group": 0, "value": 0}, {"group": 1, "value": 1}], predictions values [1, 0, 0]
    -> groups 0: 100, 1: 0 -> {"exact_match": 50.0}
  """
  def fn(targets, predictions) -> Metrics:
    _check(targets, predictions)
    groups = collections.defaultdict(lambda: ([], []))
    for t, p in zip(targets, predictions):
      groups[t[group_key]][0].append(t[value_key])
      groups[t[group_key]][1].append(p[value_key])
    scores = collections.defaultdict(list)
    for group_targets, group_predictions in groups.values():
      for name, value in metric_fn(group_targets, group_predictions).items():
        scores[name].append(value)
    return {name: float(np.mean(values)) for name, values in scores.items()}
  fn.__name__ = f"mean_group_{getattr(metric_fn, '__name__', 'metric')}"
  return fn


def deduplicate_metric(metric_fn: MetricFn, group_key: str = "group",
                       value_key: str = "value") -> MetricFn:
  """A metric: metric_fn on the first example of each group (ReCoRD repeats an example once
  per answer in training data; eval scores each question once)."""
  def fn(targets, predictions) -> Metrics:
    _check(targets, predictions)
    first = {}  # group -> index of its first example
    for i, t in enumerate(targets):
      first.setdefault(t[group_key], i)
    return metric_fn([targets[i][value_key] for i in first.values()],
                     [predictions[i][value_key] for i in first.values()])
  fn.__name__ = f"deduplicate_{getattr(metric_fn, '__name__', 'metric')}"
  return fn


def multirc_f1_over_all_answers(targets, predictions) -> Metrics:
  """f1_score_with_invalid over the "value" of MultiRC's {group, value} dicts."""
  return f1_score_with_invalid([t["value"] for t in targets], [p["value"] for p in predictions])


def mean_log_likelihood(targets, scores) -> Metrics:
  """Mean over examples of the target's log-likelihood (a score metric: the model scores each
  target, nothing is decoded). [-1.5, -0.5] -> -1.0."""
  _check(targets, scores)
  return {"mean_log_likelihood": float(np.mean(scores))}


# ---------------------------------------------------------------- entity-level (NER) metrics
# seqeval's default mode (conlleval's chunk rules), for IOB1, IOB2, IOE and IOBES tags.

def _chunk_end(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
  """Whether an entity ends before this tag (conlleval's endOfChunk)."""
  return (prev_tag in ("E", "S") or (prev_tag in ("B", "I") and tag in ("B", "S", "O"))
          or (prev_tag not in ("O", ".") and prev_type != type_))


def _chunk_start(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
  """Whether an entity starts at this tag (conlleval's startOfChunk)."""
  return (tag in ("B", "S") or (prev_tag in ("E", "S", "O") and tag in ("E", "I"))
          or (tag not in ("O", ".") and prev_type != type_))


def entity_spans(sequences: Sequence[Sequence[str]]) -> set[tuple[str, int, int]]:
  """The entities of tag sequences as (type, first, last) over the sequences laid end to end
  with an "O" between them (as seqeval): an I- after O or another type starts an entity.

  Example: [["B-PER", "I-PER", "O", "I-LOC"]] -> {("PER", 0, 1), ("LOC", 3, 3)}
  """
  flat = [tag for sequence in sequences for tag in list(sequence) + ["O"]]
  spans, prev_tag, prev_type, begin = set(), "O", "", 0
  for i, chunk in enumerate(flat + ["O"]):
    tag, type_ = chunk[0], chunk[1:].split("-", maxsplit=1)[-1] or "_"
    if _chunk_end(prev_tag, tag, prev_type, type_):
      spans.add((prev_type, begin, i - 1))
    if _chunk_start(prev_tag, tag, prev_type, type_):
      begin = i
    prev_tag, prev_type = tag, type_
  return spans


def entity_f1(targets, predictions) -> Metrics:
  """Micro precision, recall and F1 (x 100) over entities, an entity right only when its
  type, first and last word all match (seqeval's default; HF run_ner's "overall_*").
  Targets and predictions are per-example lists of tags, each pair of the same length.

  Example: targets [["B-PER", "I-PER", "O", "B-LOC"]], predictions [["B-PER", "I-PER", "O",
    "O"]] -> 1 of 1 predicted right, 1 of 2 found -> precision 100, recall 50, f1 66.67
  """
  _check(targets, predictions)
  for t, p in zip(targets, predictions):
    if len(t) != len(p):
      raise ValueError(f"a target has {len(t)} tags but its prediction {len(p)}")
  true, predicted = entity_spans(targets), entity_spans(predictions)
  correct = len(true & predicted)
  precision = correct / len(predicted) if predicted else 0.0
  recall = correct / len(true) if true else 0.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  return {"entity_precision": 100 * precision, "entity_recall": 100 * recall,
          "entity_f1": 100 * f1}


def token_accuracy(targets, predictions) -> Metrics:
  """Percent of tags (over all examples' tags) equal to their target (seqeval's accuracy)."""
  _check(targets, predictions)
  pairs = [(t, p) for ts, ps in zip(targets, predictions) for t, p in zip(ts, ps)]
  return {"token_accuracy": 100 * float(np.mean([t == p for t, p in pairs])) if pairs else 0.0}
