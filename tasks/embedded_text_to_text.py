"""The embedded classification tasks in T5's text-to-text form, for encoder-decoder and
decoder-only models (t5lite study t5_objectives scores them beside stdlib_docstring_summary):
the examples of tasks/embedded_heads.py, written as T5 writes GLUE (a task prefix and named
fields in, the label's word out), in the embedded SentencePiece vocabulary.

  stdlib_docstring_module   "docstring module: Return a logger with the specified name."
                            -> "logging"; accuracy (exact match), 8 balanced classes
  stdlib_sentence_pair      "sentence pair: sentence1: A sentence2: B" -> "next" (B follows A
                            in the same docstring) or "other" (B is another module's);
                            accuracy, balanced

The targets are words the SentencePiece vocabulary holds, so a model writes them in a token
or two; a prediction that is none of the labels counts as wrong.
"""
from __future__ import annotations

import functools

from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, TaskRegistry, add_task
from t5lite.eval import metrics

from . import embedded, embedded_heads

PAIR_LABELS = ("other", "next")


def module_example(ex: dict) -> dict:
  return {"inputs": f"docstring module: {ex['text']}",
          "targets": embedded_heads.MODULES[ex["label"]]}


def pair_example(ex: dict) -> dict:
  return {"inputs": f"sentence pair: sentence1: {ex['sentence1']} sentence2: {ex['sentence2']}",
          "targets": PAIR_LABELS[ex["label"]]}


def register() -> None:
  """Registers both tasks (idempotent)."""
  for name, examples, to_text in (
      ("stdlib_docstring_module", embedded_heads.module_examples, module_example),
      ("stdlib_sentence_pair", embedded_heads.pair_examples, pair_example)):
    if name not in TaskRegistry.names():
      add_task(name, {s: functools.partial(examples, s) for s in ("train", "validation")},
               embedded.FEATURES, [to_text, pp.tokenize, CACHE_POINT, pp.append_eos_after_trim],
               postprocess_fn=embedded.strip, metric_fns=[metrics.accuracy])


register()
