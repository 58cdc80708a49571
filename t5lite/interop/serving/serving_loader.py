"""Runs a t5lite serving artifact (what `t5lite export serving` writes) without t5lite.

  python ARTIFACT/serving_loader.py ARTIFACT --text "some input" [--text ...] [--method beam]

prints one output text per input (read from stdin, one per line, when no --text is given).
From Python, with ARTIFACT on sys.path:

  from serving_loader import ServingModel
  model = ServingModel.load(ARTIFACT)
  model.generate(tokens, method="greedy")      # (B, L <= input_length) int32 -> (B, T) int32
  model.generate_text(["some input"], method="beam")
  model.generate(tokens, adapters=["sum", "base"])  # an artifact of several adapters: per row

This file is copied into every artifact and must work there alone: it imports only the
standard library, numpy, jax, safetensors and (for sentencepiece vocabularies) sentencepiece;
jax needs the flatbuffers package to read the exported functions.
Outputs follow `t5lite.generate`: ids without the start token, EOS (1) included, 0 after EOS.
Text is encoded as t5lite's vocabularies do, with EOS appended (as `t5lite infer` does), and
decoded like their `decode`. An input longer than the artifact's input_length is refused.
The model runs on jax's default device when the artifact was lowered for its platform
(serving.json's "platforms"), else on the cpu: an artifact exported for cpu alone still runs
on a machine whose default backend is a GPU.

Nothing in an artifact is trusted whole: every file serving.json names must stay inside the
artifact's folder and match the size and SHA-256 that serving.json lists for it; the
vocabulary may not be larger than the model's embedding; every param must have the shape and
dtype the exported functions take, and be finite. Otherwise loading stops with a
ServingError naming the file and the fix; the command line prints it in one line and exits 2.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import struct
import sys
from typing import Sequence

import jax
import numpy as np
import safetensors.numpy

MANIFEST_FILE = "serving.json"
FORMAT = "t5lite-serving"
# XLA:CPU options of the decoding programs (t5lite.models.decoding.search.CPU_COMPILER_OPTIONS: this
# file runs without t5lite, so it keeps its own copy).
CPU_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
PAD_ID, EOS_ID = 0, 1


class ServingError(ValueError):
  """An artifact that is damaged, altered or unsafe to load, or an input it cannot take: no
  bug, so the command line says it in one line (exit 2)."""


class ServingModel:
  """An artifact's exported decode functions, its params (on `device`, see run_device) and
  its vocabulary (None when the artifact has none: ids only)."""

  def __init__(self, directory: pathlib.Path, manifest: dict, params, functions: dict,
               vocabulary, device=None):
    self.directory = directory
    self.manifest = manifest
    self.params = params
    self.functions = functions  # method -> jitted Exported.call(params, tokens)
    self.vocabulary = vocabulary
    self.device = device  # None: jax's default device

  @classmethod
  def load(cls, directory) -> "ServingModel":
    directory = pathlib.Path(directory)
    manifest = read_manifest(directory)
    files = ArtifactFiles(directory, manifest)
    exports = {}
    for method, file_name in manifest["exports"].items():
      try:
        exports[method] = jax.export.deserialize(bytearray(files.read(file_name, "export")))
      except ServingError:
        raise
      except Exception as error:  # a cut or foreign file: flatbuffers raises many kinds
        raise ServingError(f"{directory / file_name} is not a readable jax.export function "
                           f"({type(error).__name__}); export the artifact again") from error
    params = load_params(files.path(manifest["params"], "params"))
    if exports:
      check_params(params, next(iter(exports.values())), files.path(manifest["params"]))
    device = run_device(manifest.get("platforms") or ["cpu"])
    params = jax.device_put(params, device)
    # Compiled once per batch size. On the CPU with XLA's memory-optimized scheduler, as
    # t5lite decodes: a scanned model's layer slices are then made one at a time, where they
    # are read, instead of all at once (a second copy of the layers).
    cpu = (device.platform if device is not None else jax.default_backend()) == "cpu"
    functions = {method: jax.jit(exported.call, compiler_options=CPU_OPTIONS if cpu else None)
                 for method, exported in exports.items()}
    vocabulary = None
    if manifest.get("vocabulary"):
      vocabulary = load_vocabulary(files, manifest["vocabulary"],
                                   int(manifest["model_config"]["vocab_size"]))
    return cls(directory, manifest, params, functions, vocabulary, device)

  @property
  def input_length(self) -> int:
    return int(self.manifest["input_length"])

  @property
  def max_decode_length(self) -> int:
    return int(self.manifest["max_decode_length"])

  @property
  def adapters(self) -> list[str] | None:
    """The adapters an artifact of several serves per row (index 0: the base alone), else
    None."""
    return self.manifest.get("adapters")

  def generate(self, tokens, method: str = "greedy", adapters=None) -> np.ndarray:
    """(B, L) ids, 0-padded, L <= input_length (or longer with only padding past it) ->
    (B, max_decode_length) int32 output ids. Each new batch size compiles once.
    adapters (an artifact of several adapters): each row's adapter name, or one name for all
    rows; None: the artifact's default_adapter."""
    if method not in self.functions:
      raise ServingError(f"method {method!r} was not exported; this artifact has "
                         f"{sorted(self.functions)}")
    tokens = self._padded(tokens)
    if tokens.shape[0] == 0:
      return np.zeros((0, self.max_decode_length), np.int32)
    args = (self.params, tokens)
    if self.adapters is not None:
      args = (self.params, self._adapter_ids(adapters, tokens.shape[0]), tokens)
    elif adapters is not None:
      raise ServingError(f"{self.directory} serves one model, not several adapters: call "
                         "generate without adapters")
    if self.device is None:
      return np.asarray(self.functions[method](*args))
    with jax.default_device(self.device):  # the tokens go where the params are
      return np.asarray(self.functions[method](*args))

  def _adapter_ids(self, adapters, rows: int) -> np.ndarray:
    """(rows,) int32 indices into the artifact's adapters, from names."""
    if adapters is None:
      adapters = self.manifest.get("default_adapter")
      if adapters is None:  # soft prompts, prefixes or saved modules: no row of the base
        raise ServingError(f"name each row's adapter, one of {self.adapters[1:]}")
    names = [adapters] * rows if isinstance(adapters, str) else list(adapters)
    if len(names) != rows:
      raise ServingError(f"{len(names)} adapter names for {rows} rows")
    if not self.manifest.get("base_rows", True) and self.adapters[0] in names:
      raise ServingError(f"this artifact serves no row of the base alone (its adapters are soft "
                         f"prompts, prefixes or train whole modules); name one of "
                         f"{self.adapters[1:]}")
    unknown = sorted({n for n in names if n not in self.adapters})
    if unknown:
      raise ServingError(f"adapters {unknown} are not in this artifact; it serves "
                         f"{self.adapters} ({self.adapters[0]!r}: the base alone)")
    return np.asarray([self.adapters.index(n) for n in names], np.int32)

  def generate_text(self, texts: Sequence[str], method: str = "greedy",
                    adapters=None) -> list[str]:
    """Encodes each text (EOS appended), decodes the batch, and returns the output texts
    (adapters: as generate's)."""
    if self.vocabulary is None:
      raise ServingError(f"{self.directory} holds no vocabulary: use generate() on token ids")
    rows = [list(self.vocabulary.encode(text)) + [EOS_ID] for text in texts]
    for text, row in zip(texts, rows):
      if len(row) > self.input_length:
        raise ServingError(self._too_long(len(row), f"the text {_preview(text)!r} encodes to"))
    tokens = np.zeros((len(rows), self.input_length), np.int32)
    for i, row in enumerate(rows):
      tokens[i, :len(row)] = row
    return [self.vocabulary.decode(ids) for ids in self.generate(tokens, method, adapters)]

  def _padded(self, tokens) -> np.ndarray:
    """tokens as (B, input_length) int32, padded with 0 on the right; longer rows refused."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
      raise ServingError(f"tokens must be a (batch, length) integer array, got {tokens.dtype} "
                         f"{tokens.shape}")
    length = tokens.shape[1]
    if length > self.input_length:
      # Only trailing padding may go: cutting real tokens would change the answer.
      lengths = np.max(np.where(tokens != PAD_ID, np.arange(1, length + 1), 0), axis=1,
                       initial=0)
      if lengths.max(initial=0) > self.input_length:
        raise ServingError(self._too_long(int(lengths.max()), "an input row has"))
      tokens = tokens[:, :self.input_length]
    return np.pad(tokens.astype(np.int32), ((0, 0), (0, self.input_length - tokens.shape[1])))

  def _too_long(self, length: int, what: str) -> str:
    return (f"{what} {length} tokens (EOS included), more than this artifact's input_length "
            f"{self.input_length}; shorten the input or export again with a larger "
            "--input_length (inputs are never truncated)")


def run_device(platforms: Sequence[str], default_platform: str | None = None):
  """None (run on jax's default device) when the artifact's functions were lowered for the
  default platform, else the first cpu device: every artifact holds a cpu lowering, and a
  function lowered for cpu alone cannot run on a GPU. default_platform: jax.export's name of
  the default backend ('cpu', 'cuda', 'rocm', 'tpu'; jax.default_backend() says 'gpu')."""
  if default_platform is None:
    default_platform = jax.export.default_export_platform()
  return None if default_platform in platforms else jax.devices("cpu")[0]


def read_manifest(directory: pathlib.Path) -> dict:
  path = directory / MANIFEST_FILE
  if not path.is_file():
    raise ServingError(f"no {MANIFEST_FILE} in {directory}: not a t5lite serving artifact")
  try:
    manifest = json.loads(path.read_text(encoding="utf-8"))
  except (OSError, ValueError) as error:
    raise ServingError(f"{path} cannot be read ({error}); export the artifact again") from None
  if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    raise ServingError(f"{path}: format {found!r}, expected {FORMAT!r}")
  missing = [k for k in ("params", "exports", "model_config") if k not in manifest]
  config = manifest.get("model_config")
  problems = missing or [name for name, ok in (
      ("exports", isinstance(manifest["exports"], dict)),
      ("model_config", isinstance(config, dict) and isinstance(config.get("vocab_size"), int)
       and not isinstance(config.get("vocab_size"), bool) and config["vocab_size"] > 0),
      ("files", isinstance(manifest.get("files", {}), dict))) if not ok]
  if problems:
    raise ServingError(f"{path}: {', '.join(problems)} missing or malformed; export the "
                       "artifact again")
  return manifest


class ArtifactFiles:
  """The files serving.json names: plain names of files in the artifact's folder, of the size
  and SHA-256 its "files" lists (an artifact of format_version 2 on), checked when first read.
  A listed file may be a symlink (a model hub's cache links its files): its checksum vouches
  for it; an unlisted one (an older artifact) must resolve inside the folder."""

  def __init__(self, directory: pathlib.Path, manifest: dict):
    self.directory = directory.resolve()
    self.listed = manifest.get("files")
    if self.listed is None:  # format_version 1: written before artifacts carried checksums
      print(f"serving_loader: warning: {directory / MANIFEST_FILE} lists no checksums (an "
            "artifact of an older t5lite); its files are read unverified", file=sys.stderr)
    self.checked: set[str] = set()

  def path(self, name, what: str = "file") -> pathlib.Path:
    """The verified path of a file serving.json (or vocabulary.json) names."""
    plain = (isinstance(name, str) and name not in ("", ".", "..")
             and pathlib.PurePath(name).name == name and "\\" not in name)
    inside = plain and (self.listed is not None
                        or (self.directory / name).resolve().parent == self.directory)
    if not inside:
      raise ServingError(f"{self.directory / MANIFEST_FILE}: {what} file {name!r} is outside "
                         "the artifact's folder; an artifact reads only its own files")
    path = self.directory / name
    if name not in self.checked:
      self._verify(name, path)
      self.checked.add(name)
    return path

  def read(self, name, what: str = "file") -> bytes:
    return self.path(name, what).read_bytes()

  def _verify(self, name: str, path: pathlib.Path) -> None:
    if not path.is_file():
      raise ServingError(f"{path} is missing; copy the whole artifact folder")
    if self.listed is None:
      return
    want = self.listed.get(name)
    if not isinstance(want, dict):
      raise ServingError(f"{path} is not among the files {MANIFEST_FILE} lists checksums for; "
                         "export the artifact again")
    size = path.stat().st_size
    if size != want.get("size"):
      raise ServingError(f"{path} has {size} bytes, {want.get('size')} were written; copy the "
                         "artifact again")
    with open(path, "rb") as f:
      digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != want.get("sha256"):
      raise ServingError(f"{path} fails its SHA-256 check (damaged or changed since export); "
                         "copy or export the artifact again")


def check_params(params: dict, exported, path: pathlib.Path) -> None:
  """params must be what the exported functions take, leaf for leaf, and finite."""
  try:
    treedef = exported.in_tree.children()[0].children()[0]  # ((params, ...), {}) -> params
    wanted = _flat(jax.tree_util.tree_unflatten(treedef,
                                                exported.in_avals[:treedef.num_leaves]))
  except (IndexError, ValueError, TypeError) as error:
    raise ServingError(f"{path}: the exported functions do not take (params, tokens) "
                       f"({error}); export the artifact again") from None
  have = _flat(params)
  missing, extra = sorted(set(wanted) - set(have)), sorted(set(have) - set(wanted))
  if missing or extra:
    raise ServingError(f"{path}: params missing {missing[:3]}, unexpected {extra[:3]}; the "
                       "params do not belong to this artifact's functions")
  for key, aval in wanted.items():
    value = have[key]
    if value.shape != tuple(aval.shape) or value.dtype != aval.dtype:
      raise ServingError(f"{path}: {key} is {value.dtype}{list(value.shape)}, the functions "
                         f"take {aval.dtype}{list(aval.shape)}; export the artifact again")
    if np.issubdtype(value.dtype, np.inexact) or value.dtype.name == "bfloat16":
      if not np.isfinite(value).all():
        raise ServingError(f"{path}: {key} holds NaN or inf values; export the artifact again "
                           "from a healthy checkpoint")


def _flat(tree: dict) -> dict:
  return {"/".join(str(getattr(k, "key", k)) for k in key_path): leaf
          for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def load_params(path: pathlib.Path) -> dict:
  """The nested params dict from params.safetensors' flat 'a/b/c' keys, dtypes as saved."""
  params: dict = {}
  try:
    flat = safetensors.numpy.load_file(str(path))
  except Exception as error:  # a cut header, a foreign file, an unknown dtype
    raise ServingError(f"{path} is not a readable safetensors file ({error}); export the "
                       "artifact again") from error
  for key, value in flat.items():
    *parents, leaf = key.split("/")
    node = params
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = value
  return params


# --- vocabularies: the id layout of t5lite.data.vocab.vocabularies, without t5lite ----------------

class _Vocabulary:
  """Ids <-> text with T5's layout: pad 0, eos 1, unk 2, extra ids at the top."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size  # extra ids included

  def decode(self, ids) -> str:
    """Stops at the first EOS; drops pad and ids outside the vocabulary (a model's padded
    embedding rows), as t5lite's Vocabulary.decode does."""
    ids = np.asarray(ids).reshape(-1).tolist()
    if EOS_ID in ids:
      ids = ids[:ids.index(EOS_ID)]
    return self._decode([i for i in ids if i != PAD_ID and 0 <= i < self.vocab_size])

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def _decode(self, ids: list[int]) -> str:
    raise NotImplementedError


class _SentencePieceVocabulary(_Vocabulary):
  """A sentencepiece model with `extra_ids` sentinels appended (`<extra_id_0>` the highest
  id), as user-defined pieces: they encode from and decode to their text."""

  def __init__(self, model: bytes, extra_ids: int):
    import sentencepiece  # only artifacts with a sentencepiece vocabulary need it
    self._sp = sentencepiece.SentencePieceProcessor(
        model_proto=_with_extra_ids(model, extra_ids))
    super().__init__(self._sp.get_piece_size())

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text, out_type=int)

  def _decode(self, ids: list[int]) -> str:
    return self._sp.decode(ids)


class _ByteVocabulary(_Vocabulary):
  """ByT5: byte b is id b + 3; extra ids above 258 decode to nothing."""

  OFFSET = 3

  def encode(self, text: str) -> list[int]:
    return [b + self.OFFSET for b in text.encode("utf-8")]

  def _decode(self, ids: list[int]) -> str:
    top = 256 + self.OFFSET
    return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < top).decode(
        "utf-8", errors="ignore")


def load_vocabulary(files: ArtifactFiles, config_file: str, model_rows: int) -> _Vocabulary:
  """Reads what t5lite's Vocabulary.save wrote (vocabulary.json, spiece.model); its ids must
  fit the model's `model_rows` embedding rows."""
  where = files.directory / str(config_file)
  try:
    config = json.loads(files.read(config_file, "vocabulary").decode("utf-8"))
    kind, extra_ids, size = config.get("kind"), config["extra_ids"], config["vocab_size"]
  except (ValueError, KeyError, AttributeError) as error:
    raise ServingError(f"{where} is not a t5lite vocabulary.json ({error!r})") from None
  for name, value in (("extra_ids", extra_ids), ("vocab_size", size)):
    if not isinstance(value, int) or not 0 <= value <= model_rows:
      raise ServingError(f"{where}: {name} {value!r} does not fit the model's {model_rows} "
                         "embedding rows; export the artifact again")
  if kind == "byte":
    vocabulary = _ByteVocabulary(256 + _ByteVocabulary.OFFSET + extra_ids)
  elif kind == "sentencepiece":
    model = files.read(config.get("model_file", "spiece.model"), "sentencepiece model")
    try:
      vocabulary = _SentencePieceVocabulary(model, extra_ids)
    except RuntimeError as error:  # sentencepiece's parse error
      raise ServingError(f"{where}: its sentencepiece model cannot be read ({error})") from None
  else:
    raise ServingError(f"{where}: vocabulary kind {kind!r} is not 'sentencepiece' or 'byte'")
  if vocabulary.vocab_size != size:
    raise ServingError(f"{where} says vocab_size {size}, the files give "
                       f"{vocabulary.vocab_size}")
  return vocabulary


def _with_extra_ids(model: bytes, extra_ids: int) -> bytes:
  """The serialized ModelProto with `<extra_id_{extra_ids-1}>` .. `<extra_id_0>` appended
  as USER_DEFINED pieces, as t5lite adds them.

  Written in protobuf's wire format by hand, so that no protobuf package is needed: entries of
  a repeated field (ModelProto.pieces, field 1) may follow the message's other fields, and a
  parser appends them in order. A piece is {piece: 1 (string), score: 2 (float), type: 3
  (enum; USER_DEFINED = 4)}.
  """
  out = bytearray(model)
  for i in reversed(range(extra_ids)):
    text = f"<extra_id_{i}>".encode("utf-8")
    piece = b"\x0a" + _varint(len(text)) + text + b"\x15" + struct.pack("<f", 0.0) + b"\x18\x04"
    out += b"\x0a" + _varint(len(piece)) + piece
  return bytes(out)


def _varint(value: int) -> bytes:
  out = bytearray()
  while value >= 0x80:
    out.append(value & 0x7F | 0x80)
    value >>= 7
  out.append(value)
  return bytes(out)


def _preview(text: str, limit: int = 40) -> str:
  return text if len(text) <= limit else text[:limit] + "..."


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description="Decode text with a t5lite serving artifact.")
  parser.add_argument("artifact", help="the artifact's folder (holds serving.json)")
  parser.add_argument("--text", action="append",
                      help="an input (repeatable); without it, one input per stdin line")
  parser.add_argument("--method", default="greedy", help="greedy or beam (as exported)")
  parser.add_argument("--adapter", default=None,
                      help="an artifact of several adapters: the one every input uses")
  args = parser.parse_args(argv)
  texts = args.text if args.text is not None else [line.rstrip("\n") for line in sys.stdin]
  try:
    model = ServingModel.load(args.artifact)
    outputs = model.generate_text(texts, method=args.method, adapters=args.adapter)
  except ServingError as error:
    print(f"serving_loader: error: {error}", file=sys.stderr)
    return 2
  for output in outputs:
    print(output)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
