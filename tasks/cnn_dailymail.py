"""CNN/DailyMail summarization in T5's format: "summarize: <article>" -> highlights (ROUGE).

Task cnn_dailymail_v002, from the TFDS array_record dataset cnn_dailymail:3.4.0 (T5 read
3.1.0; the text is the same) or local files $T5LITE_LOCAL_DATA_DIR/cnn_dailymail/<split>.jsonl
with TFDS's fields "article" and "highlights" (see tasks/glue.py for the file rules).
"""
from __future__ import annotations

from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, add_task
from t5lite.eval import metrics

from . import vocab
from .glue import as_text, split_sources

TFDS_NAME = "cnn_dailymail:3.4.0"


def summarize(ex: dict, article_key: str = "article", summary_key: str = "highlights") -> dict:
  """T5's `summarize`: the article after "summarize:", the summary as targets.

  Example: {"article": "Rain fell. Roads closed.", "highlights": "Rain closed roads."}
    -> {"inputs": "summarize: Rain fell. Roads closed.", "targets": "Rain closed roads."}
  """
  return {"inputs": f"summarize: {as_text(ex[article_key])}",
          "targets": as_text(ex[summary_key])}


def register(vocabulary=None) -> None:
  """Registers cnn_dailymail_v002 (at import, with T5's vocabulary)."""
  add_task("cnn_dailymail_v002", split_sources(TFDS_NAME, ("train", "validation", "test"),
                                         ("article", "highlights")),
           vocab.default_output_features(vocabulary),
           (summarize, pp.tokenize, CACHE_POINT, pp.append_eos_after_trim),
           metric_fns=(metrics.rouge,))


register()
