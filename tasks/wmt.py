"""WMT translation in T5's format: "translate English to German: <en>" -> <de> (BLEU).

Tasks (T5's names, "<src><tgt>"), from TFDS array_record datasets with one text field per
language code ({"de": ..., "en": ...}) or the same fields in local files
$T5LITE_LOCAL_DATA_DIR/<tfds name>/<split>.jsonl|.tsv (see tasks/glue.py for the file rules):
  wmt_t2t_ende_v003  wmt_t2t_translate/de-en:1.0.0   (T5's En-De benchmark)
  wmt14_ende_v003    wmt14_translate/de-en:1.0.0
  wmt16_ende_v003    wmt16_translate/de-en:1.0.0
  wmt14_enfr_v003    wmt14_translate/fr-en:1.0.0
  wmt15_enfr_v003    wmt15_translate/fr-en:1.0.0
  wmt16_enro_v003    wmt16_translate/ro-en:1.0.0
"""
from __future__ import annotations

from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, add_task
from t5lite.eval import metrics

from . import vocab
from .glue import as_text, split_sources

# English names of language codes, as babel.Locale(code).english_name gives them to T5.
LANGUAGES = {"cs": "Czech", "de": "German", "en": "English", "fi": "Finnish", "fr": "French",
             "ro": "Romanian", "ru": "Russian", "tr": "Turkish"}

# (task name, TFDS name, source language, target language)
TASKS = (
    ("wmt_t2t_ende_v003", "wmt_t2t_translate/de-en:1.0.0", "en", "de"),
    ("wmt14_ende_v003", "wmt14_translate/de-en:1.0.0", "en", "de"),
    ("wmt16_ende_v003", "wmt16_translate/de-en:1.0.0", "en", "de"),
    ("wmt14_enfr_v003", "wmt14_translate/fr-en:1.0.0", "en", "fr"),
    ("wmt15_enfr_v003", "wmt15_translate/fr-en:1.0.0", "en", "fr"),
    ("wmt16_enro_v003", "wmt16_translate/ro-en:1.0.0", "en", "ro"),
)


def translate(source_language: str, target_language: str):
  """T5's `translate` preprocessor for one direction.

  Example: translate("en", "de")({"en": "That is good.", "de": "Das ist gut."})
    -> {"inputs": "translate English to German: That is good.", "targets": "Das ist gut."}
  """
  prefix = f"translate {LANGUAGES[source_language]} to {LANGUAGES[target_language]}: "

  def apply(ex: dict) -> dict:
    return {"inputs": prefix + as_text(ex[source_language]),
            "targets": as_text(ex[target_language])}
  apply.__name__ = f"translate_{source_language}{target_language}"
  return apply


def register(vocabulary=None) -> None:
  """Registers the WMT tasks (at import, with T5's vocabulary)."""
  features = vocab.default_output_features(vocabulary)
  for name, tfds_name, source, target in TASKS:
    add_task(name, split_sources(tfds_name, ("train", "validation", "test"), (source, target)),
             features,
             (translate(source, target), pp.tokenize, CACHE_POINT, pp.append_eos_after_trim),
             metric_fns=(metrics.bleu,))


register()
