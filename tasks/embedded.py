"""The embedded default tasks: the Python standard library's own prose, nothing downloaded.

On first use, the docstrings and reference topics of t5lite.data.sources.stdlib_corpus become a
local TFDS array_record dataset `t5lite_stdlib_docs` (train / validation, 1 in 20 documents
held out by a hash of its name), and a SentencePiece vocabulary is trained on the train
split and cached beside it (`spiece.model`). Both live in $T5LITE_DATA_DIR (default
~/.cache/t5lite/data; a gs:// or s3:// URL is built once by the first host and copied to each
host's local disk), under the Python version, since docstrings change between versions.
The GPT-2 and BERT tasks train their own vocabularies on the same train split, on first use
of each, and cache them beside spiece.model as t5lite vocabulary folders
(`byte_level_bpe_4000/`, `wordpiece_4000/`; `t5lite.data.vocab.vocabularies.load_vocabulary`
reads them, and `t5lite export hf` writes them as HF tokenizer files).

  stdlib_span_corruption    T5 span corruption pretraining on every document
  stdlib_prefix_lm          T5's LM objective for an encoder-decoder: pieces of
                            min(inputs, targets) - 1 tokens, each split at a uniformly drawn
                            point into a prefix (inputs) and its continuation (targets)
  stdlib_docstring_summary  a docstring's body -> its first line, scored by ROUGE
  stdlib_lm                 GPT-2 style causal LM: byte-level BPE (LM_VOCAB_SIZE ids,
                            <|endoftext|> = 0 after each document), documents concatenated
                            and split into `targets`-length pieces (decoder-only models)
  stdlib_mlm                BERT MLM: WordPiece (MLM_VOCAB_SIZE ids, lower-cased; [PAD] 0,
                            [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4), documents concatenated and
                            split into `[CLS] piece [SEP]` of `inputs` tokens, 15% of the
                            other tokens chosen (80% [MASK], 10% random, 10% kept), new masks
                            every epoch (encoder-only models)
  stdlib_lm_wordpiece       stdlib_lm's causal LM in stdlib_mlm's WordPiece ([SEP] after each
                            document): a left-to-right model on the very tokens a BERT of
                            the same vocabulary reads (BERT's LTR ablation)
  stdlib_lm_sentencepiece   the same causal LM in the SentencePiece vocabulary of
                            stdlib_span_corruption (EOS after each document): T5's "LM"
                            objective for a decoder-only model, every token predicted
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys

from t5lite.util import atomic, paths, staging
from t5lite.data import preprocessors as pp
from t5lite.data.vocab.hf_training import train_byte_level_bpe, train_wordpiece
from t5lite.data.objectives.chains import (causal_lm_preprocessors, mlm_preprocessors,
                                           prefix_lm_preprocessors,
                                           span_corruption_preprocessors)
from t5lite.data.registry import CACHE_POINT, Feature, TaskRegistry, add_task
from t5lite.data.sources.readers import TfdsSource, prepare_tfds_dataset
from t5lite.data.sources.tfds import is_prepared_dir
from t5lite.data.sources.stdlib_corpus import stdlib_documents
from t5lite.data.vocab.vocabularies import (SentencePieceVocabulary, Vocabulary, load_vocabulary as
                                      load_vocabulary_dir, train_sentencepiece)
from t5lite.errors import ConfigError
from t5lite.eval import metrics

from .vocab import LazyVocabulary

DATASET = "t5lite_stdlib_docs"
VERSION = "1.0.0"
VOCAB_PIECES = 2000  # small: a CPU demo spends less time in the softmax
EXTRA_IDS = 100
HOLDOUT = 20  # 1 in 20 documents goes to validation
# Small, as VOCAB_PIECES: the CPU demos' softmax. A model's vocab_size must be >= these
# (gin/models/bert/tiny.gin and llama_style/tiny.gin have 4096, decoder_only/tiny.gin 32128).
LM_VOCAB_SIZE = 4000   # stdlib_lm's byte-level BPE: <|endoftext|>, 256 bytes, 3743 merges
MLM_VOCAB_SIZE = 4000  # stdlib_mlm's WordPiece: 5 specials, ##-symbols, alphabet, pieces


def data_dir() -> str:
  """$T5LITE_DATA_DIR (else ~/.cache/t5lite/data)/pyXY: a local folder or a bucket URL (gs://,
  s3://). In a bucket the first host to need the build publishes it and every host reads a
  local copy of it (t5lite.util.staging.built)."""
  root = os.environ.get("T5LITE_DATA_DIR") or os.path.expanduser("~/.cache/t5lite/data")
  return paths.join(root, f"py{sys.version_info.major}{sys.version_info.minor}")


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
  """Builds the dataset and vocabulary once (a no-op when present); returns the local folder
  that holds them: data_dir(), or the local copy of a build in a bucket.

  Both are written under temporary names and renamed into place (t5lite.util.atomic), so a
  build killed halfway is rebuilt by the next call instead of breaking every later run."""
  directory = data_dir()
  if paths.is_url(directory):
    return staging.built(directory, _build, "T5LITE_DATA_DIR")
  with _lock(directory):
    _remove_leftovers(directory)
    _build(directory)
  return directory


def _build(directory: str) -> None:
  """Writes what `directory` lacks of the dataset and spiece.model."""
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
    model = train_sentencepiece(_train_texts(documents), VOCAB_PIECES)
    atomic.write_file(model_path, model)


def _train_texts(documents=None) -> list[str]:
  return [d["text"] for d in documents or stdlib_documents() if not _is_validation(d["name"])]


def _is_vocabulary(path: str) -> bool:
  """Whether path holds a loadable vocabulary folder (vocabulary.json and its files)."""
  try:
    load_vocabulary_dir(path)
  except (ConfigError, OSError):
    return False
  return True


def _prepared_vocabulary(name: str, train) -> Vocabulary:
  """The vocabulary folder `name` beside spiece.model, trained by train(texts) on the train
  split once: built in a temporary folder and renamed into place (t5lite.util.atomic), so a
  build killed halfway is rebuilt by the next call, as spiece.model is (in a bucket: published
  beside the dataset's build, as it is)."""
  build = lambda tmp: train(_train_texts()).save(tmp)  # noqa: E731
  if paths.is_url(data_dir()):
    return load_vocabulary_dir(staging.built(paths.join(data_dir(), name), build,
                                             "T5LITE_DATA_DIR"))
  directory = prepare()
  target = os.path.join(directory, name)
  if not _is_vocabulary(target):
    with _lock(directory):
      atomic.build_dir(target, build, _is_vocabulary)
  return load_vocabulary_dir(target)


def load_lm_vocabulary() -> Vocabulary:
  """stdlib_lm's byte-level BPE (GPT-2's layout: <|endoftext|> is eos, bos and unk)."""
  return _prepared_vocabulary(f"byte_level_bpe_{LM_VOCAB_SIZE}",
                              lambda texts: train_byte_level_bpe(texts, LM_VOCAB_SIZE))


def load_mlm_vocabulary() -> Vocabulary:
  """stdlib_mlm's WordPiece (BERT's uncased layout)."""
  return _prepared_vocabulary(f"wordpiece_{MLM_VOCAB_SIZE}",
                              lambda texts: train_wordpiece(texts, MLM_VOCAB_SIZE))


def _remove_leftovers(directory: str) -> None:
  """Temporaries of killed builds: ours (t5lite.util.atomic), and the `incomplete.*` folders
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
LM_VOCABULARY = LazyVocabulary(load=load_lm_vocabulary,
                               description="the embedded stdlib byte-level BPE vocabulary")
MLM_VOCABULARY = LazyVocabulary(load=load_mlm_vocabulary,
                                description="the embedded stdlib WordPiece vocabulary")
# stdlib_lm: add_eos puts <|endoftext|> after each document before they are concatenated, as
# GPT-2's training text separates documents. stdlib_mlm: [CLS] / [SEP] instead of an EOS.
LM_FEATURES = {"targets": Feature(LM_VOCABULARY, add_eos=True)}
MLM_FEATURES = {"inputs": Feature(MLM_VOCABULARY, add_eos=False),
                "targets": Feature(MLM_VOCABULARY, add_eos=False)}
WORDPIECE_LM_FEATURES = {"targets": Feature(MLM_VOCABULARY, add_eos=True)}  # EOS is [SEP]
SENTENCEPIECE_LM_FEATURES = {"targets": Feature(VOCABULARY, add_eos=True)}
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
  names = TaskRegistry.names()
  if "stdlib_span_corruption" not in names:
    add_task("stdlib_span_corruption", SOURCES, FEATURES,
             [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT,
              *span_corruption_preprocessors()])
    # T5's LM objective for an encoder-decoder (Raffel et al. 2020, Table 2 and 4): each
    # piece split at a random point, the prefix into the encoder, the continuation out.
    add_task("stdlib_prefix_lm", SOURCES, FEATURES,
             [pp.rekey({"inputs": None, "targets": "text"}), pp.tokenize, CACHE_POINT,
              *prefix_lm_preprocessors()])
    add_task("stdlib_docstring_summary", SOURCES, FEATURES,
             [docstring_summary, pp.tokenize, CACHE_POINT, pp.append_eos_after_trim],
             postprocess_fn=strip, metric_fns=[metrics.rouge])
  if "stdlib_lm" not in names:
    add_task("stdlib_lm", SOURCES, LM_FEATURES,
             [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT, pp.append_eos,
              *causal_lm_preprocessors()])
    add_task("stdlib_mlm", SOURCES, MLM_FEATURES,
             [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT,
              *mlm_preprocessors(add_cls_sep=True, vocabulary_specials=True)])
  for name, features in (("stdlib_lm_wordpiece", WORDPIECE_LM_FEATURES),
                         ("stdlib_lm_sentencepiece", SENTENCEPIECE_LM_FEATURES)):
    if name not in names:
      add_task(name, SOURCES, features,
               [pp.rekey({"targets": "text"}), pp.tokenize, CACHE_POINT, pp.append_eos,
                *causal_lm_preprocessors()])


register()
