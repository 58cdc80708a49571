"""SQuAD v1.1 in T5's format: "question: <q> context: <c>" -> the first answer; EM / F1
taken as the max over all reference answers (T5's squad_v010_allanswers).

From the TFDS array_record dataset squad/v1.1:3.0.0, or local JSONL files
$T5LITE_LOCAL_DATA_DIR/squad/v1.1/<split>.jsonl with TFDS's fields: "id", "question",
"context", "answers": {"text": [...], "answer_start": [...]} (see tasks/glue.py).
"""
from __future__ import annotations

import re

from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, add_task
from t5lite.eval import metrics

from . import vocab
from .glue import as_text, split_sources

TFDS_NAME = "squad/v1.1:3.0.0"


def pad_punctuation(text: str) -> str:
  """T5's `_pad_punctuation`: spaces around each non-word character, whitespace runs
  collapsed. Word characters are ASCII [0-9A-Za-z_] and whitespace is [\\t\\n\\f\\r ], as in
  the RE2 regexes T5 runs, so "é" is padded too; ends are not stripped.

  Example: "Who's the U.S. ruler?" -> "Who ' s the U . S . ruler ? "
  """
  text = re.sub(r"([^0-9A-Za-z_])", r" \1 ", text)
  return re.sub(r"[\t\n\f\r ]+", " ", text)


def squad(ex: dict) -> dict:
  """T5's `squad`: padded question and context as inputs, the first padded answer as targets;
  id, question, context and all answers pass through for evaluation.

  Example: {"id": "a1", "question": "Who won?", "context": "Bo won.",
            "answers": {"text": ["Bo", "Bo."]}}
    -> {"inputs": "question: Who won ? context: Bo won . ", "targets": "Bo", "id": "a1",
        "question": "Who won ? ", "context": "Bo won . ", "answers": ["Bo", "Bo . "]}
  """
  question, context = pad_punctuation(as_text(ex["question"])), pad_punctuation(
      as_text(ex["context"]))
  answers = [pad_punctuation(as_text(a)) for a in ex["answers"]["text"]]
  inputs = re.sub(r"[\t\n\f\r ]+", " ", f"question: {question} context: {context}")
  return {"inputs": inputs, "targets": answers[0], "id": as_text(ex["id"]),
          "question": question, "context": context, "answers": answers}


def qa_postprocess(answer: str, example=None, is_target: bool = False):
  """Predictions: the text; targets: every reference answer of the example."""
  return list(example["answers"]) if is_target else answer


def register(vocabulary=None) -> None:
  """Registers squad_v010_allanswers (at import, with T5's vocabulary)."""
  add_task("squad_v010_allanswers", split_sources(TFDS_NAME, ("train", "validation"),
                                                              ("question", "context")),
           vocab.default_output_features(vocabulary),
           (squad, pp.tokenize, CACHE_POINT, pp.append_eos_after_trim),
           postprocess_fn=qa_postprocess, metric_fns=(metrics.squad,))


register()
