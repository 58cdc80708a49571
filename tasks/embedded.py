"""The embedded default tasks: the Python standard library's own prose, nothing downloaded.

On first use, the docstrings and reference topics of t5lite.data.stdlib_corpus become a
local TFDS array_record dataset `t5lite_stdlib_docs` (train / validation, 1 in 20 documents
held out by a hash of its name), and a SentencePiece vocabulary is trained on the train
split and cached beside it (`spiece.model`). Both live in $T5LITE_DATA_DIR (default
~/.cache/t5lite/data), under the Python version, since docstrings change between versions.

  stdlib_span_corruption    T5 span corruption pretraining on every document
  stdlib_docstring_summary  a docstring's body -> its first line, scored by ROUGE
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys

from t5lite.data import atomic
from t5lite.data import preprocessors as pp
from t5lite.data.pretraining import span_corruption_preprocessors
from t5lite.data.registry import CACHE_POINT, Feature, TaskRegistry, add_task
from t5lite.data.sources import TfdsSource, prepare_tfds_dataset
from t5lite.data.tfds_source import is_prepared_dir
from t5lite.data.stdlib_corpus import stdlib_documents
from t5lite.data.vocabularies import SentencePieceVocabulary, train_sentencepiece
from t5lite.errors import ConfigError
from t5lite.eval import metrics

from .vocab import LazyVocabulary

DATASET = "t5lite_stdlib_docs"
VERSION = "1.0.0"
VOCAB_PIECES = 2000  # small: a CPU demo spends less time in the softmax
EXTRA_IDS = 100
HOLDOUT = 20  # 1 in 20 documents goes to validation


def data_dir() -> str:
  root = os.environ.get("T5LITE_DATA_DIR") or os.path.expanduser("~/.cache/t5lite/data")
  return os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}")


@contextlib.contextmanager
def _lock(directory: str):
  """One preparer at a time (several test or host processes may start together)."""
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, ".lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _is_validation(name: str) -> bool:
  return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HOLDOUT == 0


@functools.lru_cache(maxsize=1)
def prepare() -> str:
  """Builds the dataset and vocabulary once (a no-op when present); returns data_dir().

  Both are written under temporary names and renamed into place (t5lite.data.atomic), so a
  build killed halfway is rebuilt by the next call instead of breaking every later run."""
  directory = data_dir()
  with _lock(directory):
    _remove_leftovers(directory)
    documents = None
    if not is_prepared_dir(os.path.join(directory, DATASET, VERSION)):
      documents = stdlib_documents()
      prepare_tfds_dataset(
          DATASET, {"train": [d for d in documents if not _is_validation(d["name"])],
                    "validation": [d for d in documents if _is_validation(d["name"])]},
          directory, {"name": "text", "text": "text"}, VERSION,
          description="Docstrings and reference topics of the Python standard library.")
    model_path = os.path.join(directory, "spiece.model")
    if not _is_model(model_path):
      documents = documents or stdlib_documents()
      model = train_sentencepiece([d["text"] for d in documents if not _is_validation(d["name"])],
                                  VOCAB_PIECES)
      atomic.write_file(model_path, model)
  return directory


def _remove_leftovers(directory: str) -> None:
  """Temporaries of killed builds: ours (t5lite.data.atomic), and the `incomplete.*` folders
  that tfds left in the dataset folder when it built there directly (before this module
  built through atomic). Under the lock, no build of this dataset is running."""
  atomic.remove_stale(directory)
  dataset_dir = os.path.join(directory, DATASET)
  atomic.remove_stale(dataset_dir)
  for name in os.listdir(dataset_dir) if os.path.isdir(dataset_dir) else ():
    if name.startswith("incomplete."):
      atomic.discard(os.path.join(dataset_dir, name))
  stale_tmp = os.path.join(directory, "spiece.model.tmp")  # older code's fixed temp name
  if os.path.exists(stale_tmp):
    os.remove(stale_tmp)


def _is_model(path: str) -> bool:
  """Whether path holds a loadable sentencepiece model (not empty, not cut short)."""
  try:
    SentencePieceVocabulary(path, extra_ids=0)
  except (ConfigError, OSError):
    return False
  return True


def load_vocabulary() -> SentencePieceVocabulary:
  return SentencePieceVocabulary(os.path.join(prepare(), "spiece.model"), extra_ids=EXTRA_IDS)


def source(split: str) -> TfdsSource:
  return TfdsSource(DATASET, split, data_dir=prepare())


VOCABULARY = LazyVocabulary(load=load_vocabulary, description="the embedded stdlib vocabulary")
FEATURES = {"inputs": Feature(VOCABULARY), "targets": Feature(VOCABULARY)}
SOURCES = {split: functools.partial(source, split) for split in ("train", "validation")}


def docstring_summary(ex):
  """A docstring whose first line is a sentence -> (body, first line); others are dropped.

  Example: {"name": "json.dumps", "text": "Serialize obj to a JSON formatted str.\\n\\n
    If skipkeys is true then ..."} -> {"inputs": "summarize: If skipkeys is true then ...",
    "targets": "Serialize obj to a JSON formatted str."}
  """
  first, _, body = ex["text"].partition("\n")
  first, body = first.strip(), body.strip()
  if ex["name"].startswith("pydoc_topics.") or not first.endswith("."):
    return None
  if len(first.split()) < 4 or len(body.split()) < 10:
    return None
  return {"inputs": "summarize: " + " ".join(body.split()), "targets": first}


def strip(text: str, example=None, is_target: bool = False) -> str:
  """T5's postprocess_fn signature: the same cleanup for predictions and targets."""
  return text.strip()


def register() -> None:
  """Registers the embedded tasks (idempotent)."""
  if "stdlib_span_corruption" in TaskRegistry.names():
    return
  add_task("stdlib_span_corruption", SOURCES, FEATURES,
           [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT,
            *span_corruption_preprocessors()])
  add_task("stdlib_docstring_summary", SOURCES, FEATURES,
           [docstring_summary, pp.tokenize, CACHE_POINT, pp.append_eos_after_trim],
           postprocess_fn=strip, metric_fns=[metrics.rouge])


register()
