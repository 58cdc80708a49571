"""Per-example preprocessors: small composable functions over example dicts.

A preprocessor takes an example (dict of str / numpy arrays) and returns the new example,
or None to drop it. It may ask for keyword arguments by name, which apply_preprocessors
passes (as seqio does): `output_features` (the task's Features), `sequence_length` (the task
feature lengths), `rng` (a numpy Generator seeded per example: deterministic and
resumable), `seed` (an int per preprocessor and batch row) and `text_limits` (text_limits
below). Functions marked with @stream_preprocessor instead take and return a whole grain
IterDataset (many-to-many steps such as concatenate-and-split).

Bounded work per example: `tokenize` encodes the first text_limits[name] characters of a
feature's text, so that one enormous row (a 200 MB line) costs what a long one does instead
of being tokenized whole and then trimmed. The limit is CHARS_PER_TOKEN characters per token
kept, where the tokens kept are the feature length when every later step keeps a prefix
(@keeps_prefix: trim, append_eos, append_eos_after_trim; the batcher trims too), else
DOCUMENT_TOKENS (T5's select_random_chunk keeps at most that many tokens of a document), or
the feature length when larger. When those characters give fewer than twice the tokens kept
(text the vocabulary mostly drops: runs of spaces, control characters), twice as many are
encoded, and so on: rows within the limit, and the kept tokens of any row a pipeline keeps a
prefix of, are those of the whole text. An enormous document under select_random_chunk has its
chunk drawn from its first DOCUMENT_TOKENS x CHARS_PER_TOKEN characters.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
from typing import Any, Callable, Mapping

import grain
import numpy as np

from t5lite.data.registry import CACHE_POINT, Task
from t5lite.errors import ConfigError, ConfigKeyError

Example = dict[str, Any]
INJECTABLE = ("output_features", "sequence_length", "rng", "seed", "text_limits")
# Natural text averages 3-5 characters per token; sentencepiece pieces are at most 16.
CHARS_PER_TOKEN = 32
DOCUMENT_TOKENS = 65536


def stream_preprocessor(fn: Callable) -> Callable:
  """Marks fn(ds: grain.IterDataset, **injected) -> grain.IterDataset."""
  fn.t5lite_stream = True
  return fn


def is_stream(fn: Callable) -> bool:
  return getattr(fn, "t5lite_stream", False)


def keeps_prefix(fn: Callable) -> Callable:
  """Marks a per-example step whose first n tokens of a feature depend only on the first n
  tokens it was given (it trims or appends): a text cut that leaves more tokens than the
  feature length then changes nothing downstream."""
  fn.t5lite_keeps_prefix = True
  return fn


def text_limits(later_steps, output_features, sequence_length: Mapping[str, int] | None
                ) -> dict[str, int]:
  """{feature: the most characters of its text worth tokenizing}, for a tokenizing step
  followed by `later_steps` (see the module docstring)."""
  lengths = dict(sequence_length or {})
  only_prefixes = sequence_length is not None and all(
      step is CACHE_POINT or getattr(step, "t5lite_keeps_prefix", False) for step in later_steps)
  return {name: CHARS_PER_TOKEN * (lengths[name] if only_prefixes and lengths.get(name)
                                   else max(DOCUMENT_TOKENS, lengths.get(name) or 0))
          for name in output_features}


def wanted_kwargs(fn: Callable) -> set[str]:
  """Which injectable keyword arguments fn declares."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return set()
  return {name for name in INJECTABLE if name in params}


def derive_seed(*parts: Any) -> int:
  """A stable 32-bit seed from any printable parts (hash() is salted per process)."""
  digest = hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).digest()
  return int.from_bytes(digest[:4], "little")


# Module-level callables (not lambdas) so pipelines pickle into grain worker processes.
def _call(fn, kwargs, ex):
  return fn(ex, **kwargs)


def _call_random(fn, kwargs, ex, rng):
  return fn(ex, rng=rng, **kwargs)


def _is_example(ex) -> bool:
  return ex is not None


def apply_preprocessors(ds: grain.IterDataset, task: Task, steps, *,
                        sequence_length: Mapping[str, int] | None, seed: int) -> grain.IterDataset:
  """Applies task preprocessors (a slice of task.preprocessors) to an IterDataset."""
  for index, fn in steps:
    if fn is CACHE_POINT:
      continue
    injected = {"output_features": task.output_features, "sequence_length": sequence_length,
                "seed": derive_seed(seed, index)}
    wanted = wanted_kwargs(fn)  # once per pipeline, not per example
    if "text_limits" in wanted:
      injected["text_limits"] = text_limits(task.preprocessors[index + 1:],
                                            task.output_features, sequence_length)
    kwargs = {k: v for k, v in injected.items() if k in wanted and k != "rng"}
    if is_stream(fn):
      ds = fn(ds, **kwargs)
      continue
    if "rng" in wanted:
      ds = ds.random_map(functools.partial(_call_random, fn, kwargs), seed=derive_seed(seed, index))
    else:
      ds = ds.map(functools.partial(_call, fn, kwargs))
    ds = ds.filter(_is_example)
  return ds


def rekey(key_map: Mapping[str, str | None]) -> Callable[[Example], Example]:
  """Renames features; a None source makes an empty string (seqio's convention).

  Example: rekey({"inputs": None, "targets": "text"})({"text": "hi", "id": 3})
    -> {"inputs": "", "targets": "hi"}
  """
  def apply(ex: Example) -> Example:
    missing = [src for src in key_map.values() if src is not None and src not in ex]
    if missing:  # a data file without the field (sources with text_fields say which row)
      raise ConfigKeyError(f"rekey: example has no {missing}; it has {sorted(ex)}")
    return {new: ("" if old is None else ex[old]) for new, old in key_map.items()}
  apply.__name__ = f"rekey({dict(key_map)})"
  return apply


def tokenize(ex: Example, output_features, copy_pretokenized: bool = True,
             text_limits: Mapping[str, int] | None = None) -> Example:
  """Encodes each output feature's text with its vocabulary (no EOS), keeping the text
  as `<name>_pretokenized` (whole). text_limits: {feature: characters encoded at most}
  (apply_preprocessors passes what the later steps can use; None: everything).

  Example (byte vocabulary): {"targets": "hi"} -> {"targets": [107, 108],
    "targets_pretokenized": "hi"}
  """
  out = dict(ex)
  for name, feature in output_features.items():
    if name in ex and isinstance(ex[name], (str, bytes)):
      text = ex[name].decode("utf-8") if isinstance(ex[name], bytes) else ex[name]
      limit = text_limits.get(name) if text_limits else None
      out[name] = np.asarray(_encode_bounded(feature.vocabulary, text, limit), np.int32)
      if copy_pretokenized:
        out[f"{name}_pretokenized"] = text
    elif name in ex and (ex[name] is None or isinstance(ex[name], (bool, int, float))):
      # Encoding str(None) would train on the text "None".
      raise ConfigError(f"tokenize: feature {name!r} is {ex[name]!r}, expected text (a null "
                        "or a number in a data file?)")
  return out


def _encode_bounded(vocabulary, text: str, limit: int | None):
  """The ids of text's first `limit` characters, or of more (see the module docstring): the
  cut is far past the tokens kept, so the vocabulary's view of the last, cut word cannot
  reach them."""
  if limit is not None:
    kept = max(1, limit // CHARS_PER_TOKEN)
    while limit < len(text):
      ids = vocabulary.encode(text[:limit])
      if len(ids) >= 2 * kept:
        return ids
      limit *= 2
  return vocabulary.encode(text)


def eos_id(feature, name: str) -> np.int32:
  """The EOS id of a feature's vocabulary (1 in T5's layout, [SEP] for BERT's WordPiece,
  <|endoftext|> for GPT-2's BPE); a ConfigError if it has none."""
  eos = feature.vocabulary.eos_id
  if eos is None:
    raise ConfigError(f"feature {name!r} has add_eos, but its vocabulary "
                      f"({feature.vocabulary!r}) has no EOS token: set add_eos=False")
  return np.int32(eos)


@keeps_prefix
def append_eos(ex: Example, output_features) -> Example:
  """Appends EOS (the vocabulary's eos_id: 1 in T5's layout) to features whose Feature has
  add_eos.

  Example: {"targets": [5, 6]} -> {"targets": [5, 6, 1]}
  """
  out = dict(ex)
  for name, feature in output_features.items():
    if feature.add_eos and name in ex:
      out[name] = np.append(np.asarray(ex[name], np.int32), eos_id(feature, name))
  return out


@keeps_prefix
def trim(ex: Example, sequence_length) -> Example:
  """Cuts token features to their sequence length.

  Example: sequence_length {"targets": 2}: {"targets": [5, 6, 7]} -> {"targets": [5, 6]}
  """
  out = dict(ex)
  for name, length in sequence_length.items():
    if name in ex and length is not None:
      out[name] = np.asarray(ex[name])[:length]
  return out


@keeps_prefix
def append_eos_after_trim(ex: Example, output_features, sequence_length) -> Example:
  """Trims to length - 1, then appends EOS (as append_eos), so EOS always survives (T5's
  choice).

  Example: lengths {"targets": 3}: {"targets": [5, 6, 7, 8]} -> {"targets": [5, 6, 1]}
  """
  out = dict(ex)
  for name, feature in output_features.items():
    if name not in ex or not feature.add_eos:
      continue
    tokens = np.asarray(ex[name], np.int32)
    length = sequence_length.get(name) if sequence_length else None
    if length is not None:
      tokens = tokens[:length - 1]
    out[name] = np.append(tokens, eos_id(feature, name))
  return out


def filter_empty(ex: Example, output_features) -> Example | None:
  """Drops examples whose output features are all empty (strings or token arrays).

  Example: {"inputs": "", "targets": ""} -> None; {"inputs": "", "targets": "a"} -> kept
  """
  present = [ex[name] for name in output_features if name in ex]
  return ex if any(len(v) for v in present) else None


def filter_by(predicate: Callable[[Example], bool]) -> Callable[[Example], Example | None]:
  """A preprocessor that keeps the examples for which predicate(example) is true."""
  def apply(ex: Example) -> Example | None:
    return ex if predicate(ex) else None
  apply.__name__ = f"filter_by({getattr(predicate, '__name__', 'predicate')})"
  return apply
