"""Finetuning examples in head form: what BERT-style heads read (HF's run_glue, run_ner,
run_qa and run_swag preprocessing), instead of text-to-text targets.

A head task tokenizes once, before CACHE_POINT (no sequence length needed there), and builds
BERT's template `[CLS] A [SEP] B [SEP]` after it, cut to the `inputs` length. Worked example
(sentence pair, inputs length 8, word pieces shown as text):

  {"sentence1": "He left.", "sentence2": "She stayed home.", "label": 1, "idx": 7}
    encode_pair("glue_rte_head", ("sentence1", "sentence2"), num_labels=2)
    -> {"tokens_a": [he left .], "tokens_b": [she stayed home .], "label": 1, "idx": 7}
    pair_inputs("glue_rte_head")
    -> {"inputs": [CLS he left . SEP she stayed SEP], "token_type_ids": [0 0 0 0 0 1 1 1],
        "label": 1, "idx": 7, "truncated_tokens": 2}

Truncation is HF's default, longest first (a token off the longer side, B on a tie), and is
never a drop: each example says how many tokens it lost, and truncation_stats(task) counts
them (per process: grain workers keep their own counts), with one warning per task.

Token classification (encode_words, then tagging_inputs) labels the first piece of each word
and gives -100 to the other pieces and to [CLS] / [SEP] (HF run_ner's convention):
  {"tokens": ["EU", "rejects"], "ner_tags": [3, 0]} -> [CLS eu reject ##s SEP],
    token_labels [-100 3 0 -100 -100]

Question answering (encode_qa, then the stream step qa_windows) is HF's prepare_*_features:
`[CLS] question [SEP] context window [SEP]`, one example per window of the context, windows
overlapping by doc_stride tokens; start/end_position index the answer's tokens in the window
(both 0, [CLS], when the answer is not wholly inside it), `offsets` map each context token to
its characters ((-1, -1) elsewhere) for t5lite.eval.qa_postprocess.
"""
from __future__ import annotations

import collections
import logging
import math
from typing import Callable, Sequence

import grain
import numpy as np

from t5lite.data import preprocessors as pp
from t5lite.data.registry import Feature
from t5lite.errors import ConfigError

IGNORE_INDEX = -100  # HF's ignored label: later pieces of a word, and special tokens
MAX_WINDOWS = 4096  # QA windows of one example, at most (grain's flat-map fan-out)

_TRUNCATED: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
_WARNED: set[str] = set()
_LOG = logging.getLogger(__name__)


# ---------------------------------------------------------------- truncation bookkeeping

def truncation_stats(task: str) -> dict[str, int]:
  """{"examples": examples truncated, "tokens": tokens cut} for a task in this process."""
  examples, tokens = _TRUNCATED.get(task, (0, 0))
  return {"examples": examples, "tokens": tokens}


def reset_truncation_stats() -> None:
  _TRUNCATED.clear()
  _WARNED.clear()


def count_truncation(task: str, cut: int, length: int) -> None:
  if cut <= 0:
    return
  stats = _TRUNCATED[task]
  stats[0] += 1
  stats[1] += cut
  if task not in _WARNED:  # once per task: a long data set would otherwise flood the log
    _WARNED.add(task)
    _LOG.warning("task %r: an example is longer than the inputs length %d and was "
                 "truncated (%d tokens cut); truncation_stats(%r) counts them all",
                 task, length, cut, task)


def truncate_longest_first(a: np.ndarray, b: np.ndarray | None, room: int):
  """Cuts (a, b) to `room` tokens in all, a token at a time from the longer (b on a tie):
  HF's 'longest_first', in closed form. Returns (a, b, tokens cut).

  Example: lengths 5 and 2, room 4 -> 3 cut from a first: lengths 2 and 2; room 3 -> 2, 1.
  """
  la, lb = len(a), 0 if b is None else len(b)
  cut = max(0, la + lb - max(room, 0))
  if not cut:
    return a, b, 0
  if b is None:
    return a[:la - cut], b, cut
  gap = min(cut, abs(la - lb))  # first the longer one shrinks to the other's length
  na, nb = (la - gap, lb) if la > lb else (la, lb - gap)
  rest = cut - gap  # then both alternately, B first
  na, nb = na - rest // 2, nb - (rest + 1) // 2
  return a[:na], b[:nb], cut


# ---------------------------------------------------------------- shared checks

def head_output_features(vocabulary) -> dict:
  """A head task's output features: inputs alone, without EOS ([SEP] ends it). Its labels
  are no vocabulary's tokens, and a head task has no text targets."""
  return {"inputs": Feature(vocabulary, add_eos=False)}


def special_ids(vocabulary, task: str) -> tuple[int, int]:
  """(cls_id, sep_id) of the vocabulary; a ConfigError when it has no [CLS] / [SEP]."""
  cls, sep = getattr(vocabulary, "cls_id", None), getattr(vocabulary, "sep_id", None)
  if cls is None or sep is None:
    raise ConfigError(f"task {task!r}: a head task builds BERT's [CLS] A [SEP] B [SEP], but "
                      f"its vocabulary {vocabulary!r} has no cls_id / sep_id. Register it with "
                      "a WordPiece vocabulary "
                      "(t5lite.data.vocab.hf_vocabularies.WordPieceVocabulary)")
  return int(cls), int(sep)


def _inputs_vocabulary(output_features, task: str):
  if "inputs" not in output_features:
    raise ConfigError(f"task {task!r}: a head task needs an 'inputs' output feature")
  return output_features["inputs"].vocabulary


def inputs_length(sequence_length, task: str) -> int:
  length = (sequence_length or {}).get("inputs")
  if not length:
    raise ConfigError(f"task {task!r}: head examples are cut to the 'inputs' feature length; "
                      f"set task_feature_lengths['inputs'] (got {sequence_length})")
  if length < 4:
    raise ConfigError(f"task {task!r}: an inputs length of {length} leaves no room for "
                      "[CLS] A [SEP] B [SEP]; use at least 4")
  return int(length)


def _text(value, task: str, field: str, ex_id) -> str:
  if value is None:
    raise ConfigError(f"task {task!r}: example {ex_id!r} has a null {field!r}; fix or drop it")
  return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


def check_label(value, task: str, ex_id, num_labels: int, kind: str = "single"):
  """A label as the head reads it: 'single' an int32 class in [0, num_labels), 'regression'
  a float32, 'multi' a float32 multi-hot (num_labels,) from a list of class indices."""
  def bad(why: str):
    return ConfigError(f"task {task!r}: example {ex_id!r} has label {value!r}: {why} (an "
                       "unlabeled test split gives -1; head tasks read labeled splits only)")
  values = list(np.atleast_1d(np.asarray(value))) if kind == "multi" else [value]
  try:
    numbers = [float(v) for v in values]
  except (TypeError, ValueError):
    raise bad("not a number") from None
  if not all(math.isfinite(x) for x in numbers):
    raise bad("not a finite number")
  if kind == "regression":
    return np.float32(numbers[0])
  if any(x != int(x) or not 0 <= x < num_labels for x in numbers):
    raise bad(f"outside the head's {num_labels} classes 0..{num_labels - 1}")
  ids = [int(x) for x in numbers]
  if kind == "multi":
    hot = np.zeros(num_labels, np.float32)
    hot[ids] = 1.0
    return hot
  return np.int32(ids[0])


# ---------------------------------------------------------------- sequence classification

def encode_pair(task: str, fields: Sequence[str], num_labels: int, *, label_field="label",
                id_field="idx", kind: str = "single") -> Callable:
  """Before CACHE_POINT: one or two text fields -> tokens_a (and tokens_b), the label
  checked (see check_label), the id kept. Runs pair_inputs after the cache point."""
  if not 1 <= len(fields) <= 2:
    raise ConfigError(f"task {task!r}: encode_pair reads one or two text fields, got {fields}")

  def apply(ex: dict, output_features) -> dict:
    vocabulary = _inputs_vocabulary(output_features, task)
    ex_id = ex.get(id_field)
    out = {"label": check_label(ex.get(label_field), task, ex_id, num_labels, kind)}
    for key, field in zip(("tokens_a", "tokens_b"), fields):
      text = _text(ex.get(field), task, field, ex_id)
      out[key] = np.asarray(vocabulary.encode(text), np.int32)
    if ex_id is not None:
      out[id_field] = ex_id
    return out
  apply.__name__ = f"encode_pair({task})"
  return apply


def build_pair(a, b, length: int, cls: int, sep: int):
  """[CLS] a [SEP] (b [SEP]) cut to `length` -> (inputs, token_type_ids, tokens cut)."""
  a, b, cut = truncate_longest_first(a, b, length - (2 if b is None else 3))
  first = np.concatenate([[cls], a, [sep]]).astype(np.int32)
  second = np.zeros(0, np.int32) if b is None else np.concatenate([b, [sep]]).astype(np.int32)
  types = np.concatenate([np.zeros(len(first), np.int32), np.ones(len(second), np.int32)])
  return np.concatenate([first, second]), types, cut


def pair_inputs(task: str) -> Callable:
  """After CACHE_POINT: tokens_a / tokens_b -> inputs, token_type_ids, truncated_tokens."""
  def apply(ex: dict, output_features, sequence_length) -> dict:
    length = inputs_length(sequence_length, task)
    cls, sep = special_ids(_inputs_vocabulary(output_features, task), task)
    out = {k: v for k, v in ex.items() if k not in ("tokens_a", "tokens_b")}
    inputs, types, cut = build_pair(ex["tokens_a"], ex.get("tokens_b"), length, cls, sep)
    count_truncation(task, cut, length)
    return {**out, "inputs": inputs, "token_type_ids": types, "truncated_tokens": np.int32(cut)}
  apply.__name__ = f"pair_inputs({task})"
  return apply


# ---------------------------------------------------------------- token classification

def _word_pieces(vocabulary, words: list[str]) -> tuple[list[int], list[int]]:
  """Piece ids and each piece's word index. With a `tokenizers` tokenizer the words are
  encoded together as pre-split text (HF's is_split_into_words), else one by one."""
  tokenizer = getattr(vocabulary, "tokenizer", None)
  if tokenizer is not None:
    encoding = tokenizer.encode(words, is_pretokenized=True, add_special_tokens=False)
    return list(encoding.ids), list(encoding.word_ids)
  ids, word_ids = [], []
  for i, word in enumerate(words):
    pieces = [int(t) for t in vocabulary.encode(word)]
    ids += pieces
    word_ids += [i] * len(pieces)
  return ids, word_ids


def encode_words(task: str, label_names: Sequence[str], *, words_field="tokens",
                 tags_field="ner_tags", id_field="id") -> Callable:
  """Before CACHE_POINT: words and their tags (ids, or names from label_names) -> tokens_a
  and piece_labels (the word's tag on its first piece, IGNORE_INDEX on the others). A word
  the vocabulary turns into no piece loses its tag, as in HF."""
  index = {name: i for i, name in enumerate(label_names)}

  def apply(ex: dict, output_features) -> dict:
    vocabulary = _inputs_vocabulary(output_features, task)
    ex_id = ex.get(id_field)
    words = [_text(w, task, words_field, ex_id) for w in ex[words_field]]
    tags = [index.get(_text(t, task, tags_field, ex_id), t)
            if isinstance(t, (str, bytes)) else t for t in ex[tags_field]]
    if len(tags) != len(words):
      raise ConfigError(f"task {task!r}: example {ex_id!r} has {len(words)} words but "
                        f"{len(tags)} tags")
    tags = [check_label(t, task, ex_id, len(label_names)) for t in tags]
    ids, word_ids = _word_pieces(vocabulary, words)
    labels, previous = [], None
    for w in word_ids:
      labels.append(IGNORE_INDEX if w is None or w == previous else tags[w])
      previous = w
    out = {"tokens_a": np.asarray(ids, np.int32), "piece_labels": np.asarray(labels, np.int32)}
    if ex_id is not None:
      out[id_field] = ex_id
    return out
  apply.__name__ = f"encode_words({task})"
  return apply


def tagging_inputs(task: str) -> Callable:
  """After CACHE_POINT: [CLS] pieces [SEP] cut to the inputs length, token_labels beside."""
  def apply(ex: dict, output_features, sequence_length) -> dict:
    length = inputs_length(sequence_length, task)
    cls, sep = special_ids(_inputs_vocabulary(output_features, task), task)
    pieces, labels = ex["tokens_a"], ex["piece_labels"]
    cut = max(0, len(pieces) - (length - 2))
    keep = len(pieces) - cut
    count_truncation(task, cut, length)
    out = {k: v for k, v in ex.items() if k not in ("tokens_a", "piece_labels")}
    ignore = np.asarray([IGNORE_INDEX], np.int32)
    return {**out, "inputs": np.concatenate([[cls], pieces[:keep], [sep]]).astype(np.int32),
            "token_type_ids": np.zeros(keep + 2, np.int32),
            "token_labels": np.concatenate([ignore, labels[:keep], ignore]).astype(np.int32),
            "truncated_tokens": np.int32(cut)}
  apply.__name__ = f"tagging_inputs({task})"
  return apply


# ---------------------------------------------------------------- question answering

def encode_qa(task: str, *, id_field="id") -> Callable:
  """Before CACHE_POINT: SQuAD fields -> question_ids, context_ids and context_offsets
  (character spans), the answers checked against the context at answer_start."""
  def apply(ex: dict, output_features) -> dict:
    vocabulary = _inputs_vocabulary(output_features, task)
    tokenizer = getattr(vocabulary, "tokenizer", None)
    ex_id = _text(ex.get(id_field), task, id_field, None)
    if tokenizer is None:
      raise ConfigError(f"task {task!r}: question answering maps tokens back to characters, "
                        f"which needs a `tokenizers` vocabulary (WordPieceVocabulary); "
                        f"{vocabulary!r} has no .tokenizer")
    question = _text(ex["question"], task, "question", ex_id).lstrip()  # as HF's run_qa
    context = _text(ex["context"], task, "context", ex_id)
    answers = ex.get("answers") or {"text": [], "answer_start": []}
    texts = [_text(t, task, "answers/text", ex_id) for t in answers["text"]]
    starts = [int(s) for s in answers["answer_start"]]
    for text, start in zip(texts, starts):
      if context[start:start + len(text)] != text:
        raise ConfigError(f"task {task!r}: example {id_field}={ex_id!r}: answer {text!r} is not "
                          f"at answer_start {start} of its context (found "
                          f"{context[start:start + len(text)]!r}); fix answer_start")
    encoded = tokenizer.encode(context, add_special_tokens=False)
    offsets = np.asarray(encoded.offsets, np.int32).reshape(-1, 2)
    return {"question_ids": np.asarray(vocabulary.encode(question), np.int32),
            "context_ids": np.asarray(encoded.ids, np.int32), "context_offsets": offsets,
            "answer_starts": np.asarray(starts, np.int32), "answers": texts,
            "context": context, "example_id": ex_id}
  apply.__name__ = f"encode_qa({task})"
  return apply


def default_doc_stride(length: int) -> int:
  """HF's 128 at length 384, in proportion below it: 64 at 192, 21 at 64."""
  return min(128, length // 3)


def qa_window_examples(ex: dict, length: int, cls: int, sep: int, doc_stride: int | None,
                       task: str) -> list[dict]:
  """One encode_qa example -> its windows (see the module docstring). The question is cut
  to half the room when longer (counted in truncated_tokens); the context never is."""
  question = ex["question_ids"]
  q_cut = max(0, len(question) - (length - 3) // 2)
  question = question[:len(question) - q_cut]
  count_truncation(task, q_cut, length)
  room = length - 3 - len(question)
  stride = default_doc_stride(length) if doc_stride is None else doc_stride
  step = room - max(0, min(stride, room - 1))  # windows must advance
  context, offsets = ex["context_ids"], ex["context_offsets"]
  n = len(context)
  span = None
  if len(ex["answers"]):  # HF trains on the first answer
    start_char = int(ex["answer_starts"][0])
    span = (start_char, start_char + len(ex["answers"][0]))
  head = np.concatenate([[cls], question, [sep]]).astype(np.int32)
  windows, start = [], 0
  while True:
    end = min(start + room, n)
    inputs = np.concatenate([head, context[start:end], [sep]]).astype(np.int32)
    window_offsets = np.full((len(inputs), 2), -1, np.int32)
    window_offsets[len(head):len(head) + end - start] = offsets[start:end]
    positions = (0, 0)
    if span and end > start and offsets[start, 0] <= span[0] and offsets[end - 1, 1] >= span[1]:
      # Last token starting at or before the answer, first ending at or after it.
      first = start + int(np.nonzero(offsets[start:end, 0] <= span[0])[0][-1])
      last = start + int(np.nonzero(offsets[start:end, 1] >= span[1])[0][0])
      positions = (len(head) + first - start, len(head) + last - start)
    types = np.concatenate([np.zeros(len(head), np.int32),
                            np.ones(len(inputs) - len(head), np.int32)])
    windows.append({"inputs": inputs, "token_type_ids": types,
                    "start_position": np.int32(positions[0]),
                    "end_position": np.int32(positions[1]), "offsets": window_offsets,
                    "example_id": ex["example_id"], "context": ex["context"],
                    "answers": list(ex["answers"]), "truncated_tokens": np.int32(q_cut)})
    if end >= n:
      return windows
    start += step


class _QaWindows(grain.experimental.FlatMapTransform):
  max_fan_out = MAX_WINDOWS

  def __init__(self, task, length, cls, sep, doc_stride):
    self.args = (length, cls, sep, doc_stride, task)
    self.task = task

  def flat_map(self, ex):
    windows = qa_window_examples(ex, *self.args)
    if len(windows) > MAX_WINDOWS:
      raise ConfigError(f"task {self.task!r}: example {ex['example_id']!r} makes "
                        f"{len(windows)} windows (at most {MAX_WINDOWS}); use a longer inputs "
                        "length or a smaller doc_stride")
    return windows


def qa_windows(task: str, doc_stride: int | None = None) -> Callable:
  """After CACHE_POINT, a stream step: each encode_qa example -> its windows."""
  if doc_stride is not None and doc_stride < 0:
    raise ConfigError(f"task {task!r}: doc_stride must be >= 0, got {doc_stride}")

  @pp.stream_preprocessor
  def apply(ds: grain.IterDataset, output_features, sequence_length) -> grain.IterDataset:
    length = inputs_length(sequence_length, task)
    cls, sep = special_ids(_inputs_vocabulary(output_features, task), task)
    return grain.experimental.FlatMapIterDataset(ds, _QaWindows(task, length, cls, sep,
                                                                doc_stride))
  apply.__name__ = f"qa_windows({task})"
  return apply


# ---------------------------------------------------------------- multiple choice

def encode_multiple_choice(task: str, context_field: str, choices_field: str,
                           num_choices: int, *, question_field: str | None = None,
                           label_field="label", id_field="idx") -> Callable:
  """Each choice as the pair (context, [question] choice), as HF's run_swag: inputs and
  token_type_ids (C, L) padded with 0 to the inputs length, label the right choice."""
  def apply(ex: dict, output_features, sequence_length) -> dict:
    length = inputs_length(sequence_length, task)
    vocabulary = _inputs_vocabulary(output_features, task)
    cls, sep = special_ids(vocabulary, task)
    ex_id = ex.get(id_field)
    choices = [_text(c, task, choices_field, ex_id) for c in ex[choices_field]]
    if len(choices) != num_choices:
      raise ConfigError(f"task {task!r}: example {ex_id!r} has {len(choices)} choices, the "
                        f"head scores {num_choices}")
    context = np.asarray(vocabulary.encode(_text(ex[context_field], task, context_field,
                                                 ex_id)), np.int32)
    prefix = _text(ex[question_field], task, question_field, ex_id) + " " if question_field else ""
    inputs = np.zeros((num_choices, length), np.int32)
    types, total_cut = np.zeros_like(inputs), 0
    for i, choice in enumerate(choices):
      b = np.asarray(vocabulary.encode(prefix + choice), np.int32)
      row, row_types, cut = build_pair(context, b, length, cls, sep)
      inputs[i, :len(row)], types[i, :len(row)] = row, row_types
      total_cut += cut
    count_truncation(task, total_cut, length)
    out = {"inputs": inputs, "token_type_ids": types, "truncated_tokens": np.int32(total_cut),
           "label": check_label(ex.get(label_field), task, ex_id, num_choices)}
    return {**out, id_field: ex_id} if ex_id is not None else out
  apply.__name__ = f"encode_multiple_choice({task})"
  return apply


# ---------------------------------------------------------------- postprocessing

def class_postprocess(output, example=None, is_target: bool = False) -> int:
  """Targets: the label; predictions: the argmax of the logits (sequence classification,
  multiple choice)."""
  return int(example["label"]) if is_target else int(np.argmax(output))


def regression_postprocess(output, example=None, is_target: bool = False) -> float:
  """Targets: the score; predictions: the head's one output."""
  return float(example["label"]) if is_target else float(np.asarray(output).reshape(-1)[0])


def multi_label_postprocess(output, example=None, is_target: bool = False) -> tuple:
  """Multi-hot tuples: the label, or the logits above 0 (probability above 1/2)."""
  values = np.asarray(example["label"]) if is_target else np.asarray(output) > 0
  return tuple(int(v) for v in values)


def tagging_postprocess(label_names: Sequence[str]) -> Callable:
  """Tag names of the labeled pieces (first piece of each word): the labels, or the argmax
  of each piece's logits; ignored pieces are left out of both (as HF's run_ner)."""
  names = list(label_names)

  def postprocess(output, example=None, is_target: bool = False) -> list[str]:
    labels = np.asarray(example["token_labels"])
    keep = labels != IGNORE_INDEX
    ids = labels[keep] if is_target else np.argmax(np.asarray(output), -1)[keep]
    return [names[int(i)] for i in ids]
  postprocess.__name__ = "tagging_postprocess"
  return postprocess

