"""Embedded finetuning tasks for BERT-style heads: the stdlib corpus's sentences, labeled.

A pretrain -> finetune demo needs a labeled task that ships with Python, as stdlib_mlm ships
its pretraining text. Both tasks cut the docstrings of t5lite.data.sources.stdlib_corpus into
sentences (paragraphs holding `>>>` examples are skipped; a sentence has 6 words or more)
and are sequence_classification heads (t5lite.data.converters.head_features):

  stdlib_docstring_module_head  which of MODULES a sentence's docstring belongs to:
      {"text": "Return a logger with the specified name.", "label": 7, "idx": 3}
      -> [CLS] return a logger with the specified name . [SEP], label 7 (logging)
      8 classes, balanced (each cut to the smallest class's count in the split);
      accuracy and macro F1 (mean_8class_f1).
  stdlib_sentence_pair_head     is B the sentence that follows A in the same docstring (1),
      or a sentence of another module's docstring (0)?
      {"sentence1": "Return a logger with the specified name.", "sentence2": "If no name
       is specified, return the root logger.", "label": 1, "idx": 0}
      -> [CLS] A [SEP] B [SEP], labels alternating 1, 0, 1, ... (balanced); at most
      MAX_PAIRS training pairs; accuracy and F1.

Splits are deterministic: a sentence (a pair: its first sentence) goes to validation when the
hash of its text says so (1 in HOLDOUT), as tasks/embedded.py holds out documents by a hash of
their names; sentences, not documents, so that every class has validation examples, and by
text, so that a sentence repeated in several docstrings (inherited methods) stays on one side
(a validation sentence may still share its docstring with training ones).
Examples are built in
memory on first use (a second or two: the modules are imported then, not at registration).
Vocabulary: the embedded WordPiece (stdlib_mlm's), or yours through
tasks.glue_heads.register_head_tasks.
"""
from __future__ import annotations

import functools
import hashlib
import re

import numpy as np

from t5lite.data.converters import head_features as hf
from t5lite.data.registry import CACHE_POINT, add_task
from t5lite.data.sources.stdlib_corpus import stdlib_documents
from t5lite.eval import metrics

from . import embedded

# The 8 modules with the most sentences in the corpus (pydoc_topics is no module).
MODULES = ("typing", "doctest", "http", "pdb", "difflib", "urllib", "inspect", "logging")
HOLDOUT = 5  # 1 in 5 sentences goes to validation
MAX_PAIRS = 3000
MIN_WORDS = 6
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`\"'])")


def sentences(text: str) -> list[str]:
  """A docstring's prose sentences: paragraphs joined into lines, split after . ! ? before a
  capital; paragraphs with doctest examples skipped, short fragments dropped.

  Example: "Return x.  Raise ValueError if x is not positive at all.\\n\\n>>> f(1)\\n1"
    -> ["Raise ValueError if x is not positive at all."]  ("Return x." is too short)
  """
  out = []
  for paragraph in re.split(r"\n\s*\n", text):
    lines = [line.strip() for line in paragraph.splitlines()]
    if any(line.startswith((">>>", "...")) for line in lines):
      continue
    for sentence in _SENTENCE_END.split(" ".join(line for line in lines if line)):
      if len(sentence.split()) >= MIN_WORDS and sentence[-1] in ".!?:":
        out.append(sentence)
  return out


def _split_of(text: str) -> str:
  digest = hashlib.sha256(text.encode()).hexdigest()
  return "validation" if int(digest, 16) % HOLDOUT == 0 else "train"


@functools.lru_cache(maxsize=1)
def _documents() -> list[tuple[str, str, list[str]]]:
  """(module, document name, sentences) of every docstring outside pydoc_topics."""
  return [(d["name"].split(".")[0], d["name"], sentences(d["text"]))
          for d in stdlib_documents() if not d["name"].startswith("pydoc_topics.")]


@functools.lru_cache(maxsize=None)
def module_examples(split: str) -> list[dict]:
  """stdlib_docstring_module_head's examples of a split, balanced over MODULES."""
  by_class, seen = [[] for _ in MODULES], set()
  for module, _, doc_sentences in _documents():
    if module in MODULES:
      for s in doc_sentences:
        if s not in seen and _split_of(s) == split:  # each text once, under one module
          seen.add(s)
          by_class[MODULES.index(module)].append(s)
  size = min(len(c) for c in by_class)
  # Interleaved classes (0, 1, ..., 7, 0, ...): any prefix is balanced too.
  rows = [(text, label) for group in zip(*[c[:size] for c in by_class])
          for label, text in enumerate(group)]
  return [{"text": text, "label": label, "idx": i} for i, (text, label) in enumerate(rows)]


@functools.lru_cache(maxsize=None)
def pair_examples(split: str) -> list[dict]:
  """stdlib_sentence_pair_head's examples of a split: consecutive sentences, every other one
  with its second sentence replaced by one drawn (seeded) from another module."""
  documents = _documents()
  pool = [(module, s) for module, _, doc_sentences in documents for s in doc_sentences]
  pairs = [(module, name, i, doc_sentences[i], doc_sentences[i + 1])
           for module, name, doc_sentences in documents for i in range(len(doc_sentences) - 1)
           if _split_of(doc_sentences[i]) == split]
  pairs = pairs[:MAX_PAIRS]
  out = []
  for idx, (module, name, i, first, second) in enumerate(pairs):
    label = 1 - idx % 2
    if not label:
      rng = np.random.default_rng(int(hashlib.sha256(f"{name}#{i}".encode()).hexdigest()[:8], 16))
      while True:
        other_module, second = pool[int(rng.integers(len(pool)))]
        if other_module != module:
          break
    out.append({"sentence1": first, "sentence2": second, "label": label, "idx": idx})
  return out


def register(vocabulary=None, suffix: str = "") -> None:
  """Registers stdlib_docstring_module_head<suffix> and stdlib_sentence_pair_head<suffix>."""
  features = hf.head_output_features(vocabulary or embedded.MLM_VOCABULARY)
  name = f"stdlib_docstring_module_head{suffix}"
  add_task(name, {s: functools.partial(module_examples, s) for s in ("train", "validation")},
           features, (hf.encode_pair(name, ("text",), len(MODULES)), CACHE_POINT,
                      hf.pair_inputs(name)),
           postprocess_fn=hf.class_postprocess,
           metric_fns=(metrics.accuracy, metrics.mean_multiclass_f1(len(MODULES))),
           head="sequence_classification", num_labels=len(MODULES))
  name = f"stdlib_sentence_pair_head{suffix}"
  add_task(name, {s: functools.partial(pair_examples, s) for s in ("train", "validation")},
           features, (hf.encode_pair(name, ("sentence1", "sentence2"), 2), CACHE_POINT,
                      hf.pair_inputs(name)),
           postprocess_fn=hf.class_postprocess,
           metric_fns=(metrics.accuracy, metrics.f1_score_with_invalid),
           head="sequence_classification", num_labels=2)


register()
