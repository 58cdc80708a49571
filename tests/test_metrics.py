"""Metric functions (t5lite.eval.metrics) against values computed by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from t5lite.eval import metrics


def test_accuracy_and_sequence_accuracy():
  assert metrics.accuracy([0, 1, 1, 0], [0, 1, 0, 0]) == {"accuracy": 75.0}
  assert metrics.sequence_accuracy(["a b", "c"], ["a b", "c "]) == {"sequence_accuracy": 50.0}
  with pytest.raises(ValueError, match="2 targets but 1 predictions"):
    metrics.accuracy([0, 1], [0])


def test_exact_match_is_all_or_nothing():
  assert metrics.exact_match([1, 0, 1], [1, 0, 1]) == {"exact_match": 100.0}
  assert metrics.exact_match([1, 0, 1], [1, 0, 0]) == {"exact_match": 0.0}
  assert metrics.all_match is metrics.exact_match


def test_f1_score_with_invalid():
  # -1 is invalid: counted wrong (a false negative here). tp 1, fp 1, fn 1 -> 2/4.
  assert metrics.f1_score_with_invalid([1, 1, 0, 0], [1, -1, 1, 0]) == {"f1": 50.0}
  # An invalid prediction on a negative becomes a false positive: tp 2, fp 1 -> 4/5.
  assert metrics.f1_score_with_invalid([1, 1, 0], [1, 1, 7]) == {"f1": pytest.approx(80.0)}
  assert metrics.f1_score_with_invalid([0, 0], [0, 0]) == {"f1": 0.0}  # no positives at all


def test_mean_multiclass_f1():
  fn = metrics.mean_multiclass_f1(num_classes=3)
  # class 0: F1 1; class 1: tp 1, fp 1 -> 2/3; class 2: tp 1, fn 1 -> 2/3.
  assert fn([0, 1, 2, 2], [0, 1, 2, 1]) == {"mean_3class_f1": pytest.approx(100 * 7 / 9)}
  # An invalid prediction is a miss of its true class: class 0 F1 2/3, class 1 1, class 2 0.
  assert fn([0, 0, 1], [0, -1, 1]) == {"mean_3class_f1": pytest.approx(100 * 5 / 9)}
  assert fn.__name__ == "mean_3class_f1"


def test_matthews_corrcoef():
  # TP 1, FN 1, TN 2, FP 0: (1*2 - 0*1) / sqrt(1 * 2 * 2 * 3).
  result = metrics.matthews_corrcoef([1, 1, 0, 0], [1, 0, 0, 0])
  assert result == {"matthews_corrcoef": pytest.approx(100 * 2 / math.sqrt(12))}
  assert metrics.matthews_corrcoef([1, 0, 1], [1, 0, 1])["matthews_corrcoef"] == pytest.approx(100)
  assert metrics.matthews_corrcoef([1, 0], [0, 1])["matthews_corrcoef"] == pytest.approx(-100)
  assert metrics.matthews_corrcoef([1, 0, 1], [1, 1, 1]) == {"matthews_corrcoef": 0.0}
  # An invalid prediction is a third class (sklearn's multiclass form). Over labels
  # (-1, 0, 1): s 4, c 3, true counts (0, 2, 2), predicted counts (1, 1, 2):
  # (3*4 - (0 + 2 + 4)) / sqrt((16 - 6) * (16 - 8)) = 6 / sqrt(80).
  result = metrics.matthews_corrcoef([1, 1, 0, 0], [1, 1, -1, 0])
  assert result["matthews_corrcoef"] == pytest.approx(100 * 6 / math.sqrt(80))


def test_correlations():
  targets, predictions = [1.0, 2.0, 3.0, 4.0], [1.2, 1.8, 3.4, 4.0]
  # Deviations (-1.5, -.5, .5, 1.5) and (-1.4, -.8, .8, 1.4): 5 / sqrt(5 * 5.2).
  assert metrics.pearson_corrcoef(targets, predictions) == {
      "pearson_corrcoef": pytest.approx(100 * 5 / math.sqrt(26))}
  assert metrics.spearman_corrcoef(targets, predictions) == {
      "spearman_corrcoef": pytest.approx(100.0)}
  # Ranks (1, 2, 3) vs (1, 3, 2): 1 - 6 * 2 / (3 * 8) = 0.5.
  assert metrics.spearman_corrcoef([1, 2, 3], [10, 30, 20]) == {
      "spearman_corrcoef": pytest.approx(50.0)}


def test_bleu():
  sentence = "the quick brown fox jumps over the lazy dog"
  assert metrics.bleu([sentence], [sentence]) == {"bleu": pytest.approx(100.0)}
  # Matches: 5/6 unigrams, 3/5 bigrams, 1/4 trigrams, 0/3 4-grams, which 'exp' smoothing
  # counts as 1 / (2 * 3); equal lengths -> no brevity penalty.
  reference, hypothesis = "a b c d e f", "a b c x e f"
  expected = 100 * (5 / 6 * 3 / 5 * 1 / 4 * 1 / 6) ** 0.25
  assert metrics.bleu([reference], [hypothesis])["bleu"] == pytest.approx(expected)
  # Several references per example: the closest one counts.
  assert metrics.bleu([["x y z w", reference]], [reference])["bleu"] == pytest.approx(100.0)
  # 'intl' tokenization splits punctuation off words.
  assert metrics.bleu(["a b c d."], ["a b c d ."])["bleu"] == pytest.approx(100.0)


def test_rouge():
  result = metrics.rouge(["rain closed roads"], ["rain closed the roads"])
  # rouge1: 3 common of 3 / 4 -> F 6/7; rouge2: 1 common of 2 / 3 -> F 0.4; rougeLsum: LCS 3.
  assert result == pytest.approx({"rouge1": 600 / 7, "rouge2": 40.0, "rougeLsum": 600 / 7})
  # A mean over examples; " . " starts a new sentence for rougeLsum.
  result = metrics.rouge(["a b . c d", "x"], ["c d . a b", "y"])
  assert result["rouge1"] == pytest.approx(50.0)
  assert result["rougeLsum"] == pytest.approx(50.0)  # each sentence is found: 100 and 0
  assert metrics.rouge(["a b"], ["a b"], score_keys=("rougeL",)) == {"rougeL": 100.0}


def test_squad():
  assert metrics.normalize_squad("The  Eiffel Tower!") == "eiffel tower"
  # Best F1 against "cat": P 1/2, R 1 -> 2/3 (against "dog sat": 1/2).
  result = metrics.squad([["the cat", "a dog sat"]], ["cat sat"])
  assert result == pytest.approx({"em": 0.0, "f1": 200 / 3})
  # Articles and punctuation do not count.
  assert metrics.squad([["dog", "A cat, sat."]], ["cat sat"]) == {"em": 100.0, "f1": 100.0}
  # One right, one half right: F1 of "cat" vs "black cat" is 2 * 1 * .5 / 1.5.
  result = metrics.squad([["Cat."], ["black cat"]], ["cat", "cat"])
  assert result == pytest.approx({"em": 50.0, "f1": 50 * (1 + 2 / 3)})
  assert metrics.squad(["Paris"], ["paris"]) == {"em": 100.0, "f1": 100.0}  # one string


def test_group_metrics():
  targets = [{"group": 0, "value": 1}, {"group": 0, "value": 0}, {"group": 1, "value": 1}]
  predictions = [{"value": 1}, {"value": 0}, {"value": 0}]
  assert metrics.mean_group_metric(metrics.exact_match)(targets, predictions) == {
      "exact_match": 50.0}
  # Only the first example of each group counts: values (1, 1) vs (1, 0).
  assert metrics.deduplicate_metric(metrics.accuracy)(targets, predictions) == {"accuracy": 50.0}
  assert metrics.multirc_f1_over_all_answers(targets, predictions) == {
      "f1": pytest.approx(200 / 3)}


def test_results_are_python_floats():
  for result in (metrics.accuracy([1], [1]), metrics.pearson_corrcoef([1, 2, 3], [1, 2, 4]),
                 metrics.rouge(["a"], ["a"]), metrics.squad([["a"]], ["a"])):
    assert all(type(v) is float for v in result.values()), result
  assert np.isfinite(metrics.bleu(["a b c d"], ["a b c e"])["bleu"])
