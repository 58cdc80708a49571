"""C4 pretraining tasks: T5's span corruption (`c4_span_corruption`) and causal LM (`c4_lm`).

Both read C4's "text" field from one of three places, chosen when a split is first read
(never at import), first match wins:

1. The public JSON files (https://huggingface.co/datasets/allenai/c4, en/):
     export T5LITE_C4_JSON='/data/c4/en/c4-train.*-of-01024.json.gz'
   The validation split reads the same pattern with "c4-train" -> "c4-validation"; or write
   "{split}" in the pattern: '/data/c4/en/c4-{split}.*.json.gz'.
2. TFDS tfrecord files converted once with
   t5lite.data.sources.tfrecord.convert_tfrecord_to_array_record:
     export T5LITE_C4_ARRAY_RECORD='/data/c4_ar/c4-train.array_record-*'   (same split rule)
3. Otherwise the TFDS array_record dataset c4/en:3.1.0, in $T5LITE_TFDS_DATA_DIR or TFDS's
   default data_dir (a tfrecord build becomes readable with
   t5lite.data.sources.tfrecord.convert_tfds_dataset_to_array_record(".../c4/en/3.1.0")).

Or pass the places as arguments to register your own variant:
  add_c4_task("my_c4_span_corruption", span_corruption_preprocessors(),
              json="/data/c4/en/c4-{split}.*.json.gz")
"""
from __future__ import annotations

import functools
import os
from typing import Sequence

from t5lite.data import preprocessors as pp
from t5lite.data.registry import CACHE_POINT, Feature, add_task
from t5lite.data.sources.readers import TfdsSource
from t5lite.data.sources.streams import JsonlStream
from t5lite.data.sources.tfrecord import ArrayRecordSource

from . import vocab

JSON_ENV = "T5LITE_C4_JSON"
ARRAY_RECORD_ENV = "T5LITE_C4_ARRAY_RECORD"
TFDS_DATA_DIR_ENV = "T5LITE_TFDS_DATA_DIR"
TFDS_NAME = "c4/en:3.1.0"
SPLITS = ("train", "validation")


def split_pattern(pattern: str, split: str) -> str:
  """The files of `split` from a pattern naming the train files (or holding "{split}").

  Example: ("/c4/c4-train.*.json.gz", "validation") -> "/c4/c4-validation.*.json.gz"
  """
  if "{split}" in pattern:
    return pattern.replace("{split}", split)
  if split == "train":
    return pattern
  if "c4-train" not in pattern:
    raise ValueError(f"cannot find the {split!r} files from {pattern!r}: name the train files "
                     "c4-train* as C4 does, or write {split} in the pattern")
  return pattern.replace("c4-train", f"c4-{split}")


def c4_source(split: str, *, json: str | None = None, array_record: str | None = None,
              tfds_data_dir: str | None = None, tfds_name: str = TFDS_NAME):
  """C4's source for a split: JSON files, converted array_record files, or TFDS (in that
  order); unset arguments come from $T5LITE_C4_JSON, $T5LITE_C4_ARRAY_RECORD and
  $T5LITE_TFDS_DATA_DIR."""
  json = json or os.environ.get(JSON_ENV)
  if json:
    # Streamed: shard by shard with bounded memory (C4 is ~300 GB of text in 1,024 files).
    return JsonlStream(split_pattern(os.path.expanduser(json), split), text_fields=("text",))
  array_record = array_record or os.environ.get(ARRAY_RECORD_ENV)
  if array_record:
    return ArrayRecordSource(split_pattern(os.path.expanduser(array_record), split))
  return TfdsSource(tfds_name, split, data_dir=tfds_data_dir or os.environ.get(TFDS_DATA_DIR_ENV))


def add_c4_task(name: str, objective: Sequence, output_features=None, splits=SPLITS, **where):
  """Registers C4 text -> targets, tokenize, CACHE_POINT, then the objective's preprocessors.

  where: c4_source's json / array_record / tfds_data_dir / tfds_name (else the env vars).
  """
  source = {split: functools.partial(c4_source, split, **where) for split in splits}
  steps = (pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT, *objective)
  return add_task(name, source, output_features or vocab.default_output_features(), steps,
                  metric_fns=())


def register(vocabulary=None) -> None:
  """Registers c4_span_corruption and c4_lm (at import, with T5's vocabulary)."""
  # The objectives read sequence_length and the vocabulary at pipeline time, not here.
  from t5lite.data.objectives.chains import causal_lm_preprocessors, span_corruption_preprocessors
  add_c4_task("c4_span_corruption", span_corruption_preprocessors(),
              vocab.default_output_features(vocabulary))
  lm_vocabulary = vocabulary if vocabulary is not None else vocab.default_vocabulary()
  # Decoder-only: fixed-length pieces of the concatenated documents, no EOS (as T5's LM).
  add_c4_task("c4_lm", causal_lm_preprocessors(),
              {"targets": Feature(lm_vocabulary, add_eos=False)})


register()
