"""Reading a T5X checkpoint's files safely: the newest checkpoint_N, its msgpack and zarr
arrays, and the 'target' (params) tree of both T5X layouts, as {T5X key path: array}.

Layouts (from google-research/t5x):
- msgpack + tensorstore (t5x/checkpoints.py, `Checkpointer.save`): `checkpoint_N/checkpoint` is
  flax msgpack of {'version': 3, 'optimizer': {'target': params, 'state': {'step', 'param_states'}}}
  (version 0, a plain flax checkpoint, has no 'optimizer' level). A partitioned array is a dict
  zarr spec, {'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': 'target.encoder.layers_0...'},
  'metadata': {...}}, whose path is relative to checkpoint_N (`_get_spec`); an unpartitioned one
  is inlined as flax's msgpack ndarray extension (type 1: shape, dtype name, bytes).
- T5X's orbax layout (t5x/checkpoints.py, `OrbaxCheckpointManagerInterface`: item 'state',
  step_prefix 'checkpoint', `PyTreeCheckpointHandler(use_ocdbt=False)`): `checkpoint_N/state/`
  holds one zarr folder per array, named by its keys joined with '.', and the tree either in
  `_METADATA` (JSON, current orbax) or in the msgpack file `checkpoint`, whose array leaves are
  'PLACEHOLDER://<name>' (orbax utils.py of the T5X era). 'target' is at the top of that tree.

Untrusted input: msgpack is read with size limits and no hooks beyond the ndarray extension;
every array path must stay inside the checkpoint folder (no '..', absolute paths or symlinks
out); arrays are opened lazily (shape and dtype first, data only when read); a missing chunk
is an error, never zeros; read failures name the file. The size a .zarray claims is checked
before any data is read (tensorstore allocates the whole array first, so a 7 KB file claiming
2^20 x 2^16 floats would abort the process): against the chunk files' bytes (see
MAX_COMPRESSION_RATIO) and, for the whole 'target', against the import ceiling (limits.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from typing import Any, Iterator

import msgpack
import numpy as np
import tensorstore as ts

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.interop import limits
from t5lite.util import paths, staging

# zarr/flax dtype names -> numpy dtypes; nothing else is a T5 parameter.
DTYPES = {"<f4": "float32", "float32": "float32", "bfloat16": "bfloat16", "<f2": "float16",
          "float16": "float16"}
STEP_DTYPES = {"int32": "int32", "int64": "int64"}
# A tensorstore-backed index is small, but version 0 inlines every array: 4 GiB bounds the
# memory one untrusted file may take (it is read whole).
MAX_MSGPACK_BYTES = 4 << 30
MAX_JSON_BYTES = 64 << 20    # _METADATA of a huge tree is a few MB; .zarray is < 1 KB
MAX_CHUNKS = 1 << 20         # T5X writes 64 MiB chunks; a million tiny ones is an attack
MAX_DEPTH = 32
COMPRESSORS = (None, "gzip", "zlib", "zstd", "blosc", "bz2")
PLACEHOLDER = "PLACEHOLDER://"
# A claim must be backed by its chunk files: raw bytes <= ratio x the bytes on disk. Random
# (trained) weights barely compress, so real checkpoints sit near 1x; gzip/zlib cannot exceed
# ~1032x at all. zstd, bz2 and blosc can, but only on near-constant data (an all-ones norm
# scale), which is small: claims under UNCHECKED_BYTES (per array, and for the whole target,
# whose ratio stays near 1x) pass regardless. Uncompressed chunks must hold every raw byte.
# Decompressing each chunk to count its bytes would be exact but needs every codec here
# (tensorstore bundles them; Python has none for zstd or blosc) and a second full read.
MAX_COMPRESSION_RATIO = 1000
UNCHECKED_BYTES = 16 << 20
ZARR_META_FILES = (".zarray", ".zattrs", ".zgroup")


class T5XCheckpointError(ConfigError):
  """A T5X checkpoint that cannot be read safely: the message names the file or parameter."""


# --- finding the checkpoint -------------------------------------------------------------------

def _is_step_dir(path: str) -> bool:
  return (os.path.isfile(os.path.join(path, "checkpoint"))
          or os.path.isdir(os.path.join(path, "state")))


def find_checkpoint(path: str, step: int | None = None) -> tuple[str, int | None]:
  """(checkpoint_N folder, N) of a T5X model dir (newest step, or `step`) or of one
  checkpoint_N folder. N is None for a step folder not named checkpoint_N."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise ConfigFileNotFoundError(f"{path} is not a folder")
  if _is_step_dir(path):
    m = re.fullmatch(r"checkpoint_(\d+)", os.path.basename(path))
    if step is not None and m and int(m[1]) != step:
      raise ConfigError(f"--step {step} given, but {path} is the checkpoint of step {m[1]}")
    return path, int(m[1]) if m else step
  steps = {int(m[1]): os.path.join(path, name) for name in os.listdir(path)
           if (m := re.fullmatch(r"checkpoint_(\d+)", name))
           and _is_step_dir(os.path.join(path, name))}
  if not steps:
    raise ConfigFileNotFoundError(
        f"no T5X checkpoint in {path}: expected checkpoint_N folders holding a 'checkpoint' "
        "file (msgpack) or a 'state' folder (orbax)")
  if step is not None and step not in steps:
    raise ConfigFileNotFoundError(f"{path} has no checkpoint_{step}; steps there: {sorted(steps)}")
  step = max(steps) if step is None else step
  return steps[step], step


@contextlib.contextmanager
def staged(url: str, step: int | None = None) -> Iterator[str]:
  """A T5X model dir or checkpoint_N folder on a bucket, as a local folder of the same shape
  holding only what an import reads: the model dir's own files (config.gin, a vocabulary;
  for a checkpoint_N URL, those of the folder above it) and the one checkpoint_N folder
  find_checkpoint would pick, not every step saved. A local path is itself."""
  if not paths.is_url(url):
    yield url
    return
  url = url.rstrip("/")
  one_step = []

  def pick(names: list[str]) -> list[str]:
    if _lists_step_dir(names, ""):  # the URL is one step's folder
      one_step.append(True)
      return names
    steps = {int(m[1]) for n in names if (m := re.match(r"checkpoint_(\d+)/", n))}
    steps = {n for n in steps if _lists_step_dir(names, f"checkpoint_{n}/")}
    if not steps:
      raise ConfigFileNotFoundError(
          f"no T5X checkpoint in {url}: expected checkpoint_N folders holding a 'checkpoint' "
          "object (msgpack) or 'state/' objects (orbax)")
    if step is not None and step not in steps:
      raise ConfigFileNotFoundError(f"{url} has no checkpoint_{step}; steps there: "
                                    f"{sorted(steps)}")
    chosen = f"checkpoint_{max(steps) if step is None else step}/"
    return [n for n in names if "/" not in n or n.startswith(chosen)]

  with staging.download(url, keep=pick, keep_name=True) as local:
    if one_step:  # the model dir's own files too: config.gin and what it names are read there
      parent = paths.dirname(url)
      for name in paths.files_under(parent):
        if "/" not in name and name not in (".", ".."):
          with open(os.path.join(os.path.dirname(local), name), "wb") as f:
            f.write(paths.read_bytes(paths.join(parent, name)))
    yield local


def _lists_step_dir(names: list[str], prefix: str) -> bool:
  return f"{prefix}checkpoint" in names or any(n.startswith(f"{prefix}state/") for n in names)


# --- reading untrusted files ------------------------------------------------------------------

@dataclasses.dataclass
class _Inline:
  """A flax msgpack ndarray, decoded only if it is a parameter (moments never are)."""
  payload: bytes

  def decode(self, name: str, dtypes: dict[str, str] = DTYPES) -> np.ndarray:
    try:
      shape, dtype, buffer = msgpack.unpackb(self.payload, raw=True, max_array_len=64,
                                             max_map_len=0, max_str_len=64, max_ext_len=0)
      dtype = _np_dtype(dtypes[dtype.decode()])
      shape = tuple(int(n) for n in shape)
      size = len(buffer) if isinstance(buffer, bytes) else -1
    except (KeyError, ValueError, TypeError, AttributeError, UnicodeError) as e:
      raise T5XCheckpointError(f"{name}: not an array of {sorted(set(dtypes.values()))} "
                               f"({e!r})") from None
    if min(shape + (0,)) < 0 or math.prod(shape) * dtype.itemsize != size:
      raise T5XCheckpointError(f"{name}: {size} bytes do not make a {dtype} array of shape "
                               f"{shape} (truncated or corrupted)")
    return np.frombuffer(buffer, dtype).reshape(shape)


def _np_dtype(name: str) -> np.dtype:
  import ml_dtypes  # numpy has no bfloat16
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _ext_hook(code: int, data: bytes):
  # flax serialization: 1 = ndarray, 3 = numpy scalar; no other object is ever built.
  if code in (1, 3):
    return _Inline(data)
  raise ValueError(f"msgpack extension type {code} is not part of a T5X checkpoint")


def _read_msgpack(path: str, name: str):
  size = os.path.getsize(path)
  if size > MAX_MSGPACK_BYTES:
    raise T5XCheckpointError(
        f"{name}: {size} bytes, over the {MAX_MSGPACK_BYTES} byte ({MAX_MSGPACK_BYTES / 2**30:g} "
        "GiB) cap on a msgpack checkpoint file (it is read whole; T5X keeps big arrays in "
        "tensorstore, so only a version-0 checkpoint with every array inline gets this large)")
  with open(path, "rb") as f:
    data = f.read()
  try:
    # Strings are keys and paths; lists are shapes; only ndarray payloads are big.
    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_ext_hook,
                           max_str_len=1 << 16, max_array_len=1 << 16, max_map_len=1 << 24)
  except Exception as e:  # msgpack raises several types for bad input
    raise T5XCheckpointError(f"{name}: truncated or corrupted msgpack ({e})") from None


def _read_json(path: str, name: str):
  if os.path.getsize(path) > MAX_JSON_BYTES:
    raise T5XCheckpointError(f"{name}: too large for checkpoint metadata")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (ValueError, UnicodeError) as e:
    raise T5XCheckpointError(f"{name}: truncated or corrupted JSON ({e})") from None


def _inside(root: str, relpath: str, name: str) -> str:
  """root/relpath, refused unless it and everything under it stays inside root."""
  if (not relpath or os.path.isabs(relpath) or "://" in relpath or "\0" in relpath
      or ".." in relpath.replace("\\", "/").split("/")):
    raise T5XCheckpointError(f"{name}: array path {relpath!r} points outside the checkpoint "
                             "folder (absolute, '..' or a URL); refused")
  real_root = os.path.realpath(root)
  path = os.path.realpath(os.path.join(root, relpath))
  for dirpath, dirnames, filenames in os.walk(path):  # chunk files may be symlinks too
    for entry in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
      if os.path.commonpath([real_root, os.path.realpath(entry)]) != real_root:
        raise T5XCheckpointError(f"{name}: {relpath} resolves outside the checkpoint folder "
                                 f"({os.path.realpath(entry)}); refused")
  if os.path.commonpath([real_root, path]) != real_root:
    raise T5XCheckpointError(f"{name}: {relpath} resolves outside the checkpoint folder "
                             f"({path}); refused")
  return path


@dataclasses.dataclass
class _ZarrArray:
  """A validated zarr v2 array folder: shape and dtype known, data not read yet; `stored`:
  the bytes of its chunk files."""
  name: str
  path: str
  shape: tuple[int, ...]
  dtype: str
  stored: int = 0

  def read(self) -> np.ndarray:
    # T5X (and orbax) write no zarr fill_value, so tensorstore stores every chunk: a missing
    # one is a lost file, which tensorstore would otherwise read as zeros.
    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": self.path + "/"},
            "fill_missing_data_reads": False}
    try:
      store = ts.open(spec, open=True, read=True).result()
      if tuple(store.shape) != self.shape:
        raise ValueError(f"tensorstore sees shape {tuple(store.shape)}")
      return np.asarray(store.read().result())
    except Exception as e:  # tensorstore reports bad chunks as ValueError, others as well
      what = ("a chunk file is missing" if "NOT_FOUND" in str(e)
              else "truncated or corrupted array data")
      raise T5XCheckpointError(f"{self.name}: {what} ({e})") from None


def _zarr_array(root: str, relpath: str, name: str) -> _ZarrArray:
  path = _inside(root, relpath, name)
  zarray = os.path.join(path, ".zarray")
  if not os.path.isfile(zarray):
    raise T5XCheckpointError(f"{name}: no zarr array there (missing {relpath}/.zarray)")
  meta = _read_json(zarray, f"{name}/.zarray")
  try:
    shape = tuple(int(n) for n in meta["shape"])
    chunks = tuple(int(n) for n in meta["chunks"])
    dtype = DTYPES.get(meta["dtype"])
    compressor = (meta.get("compressor") or {}).get("id")
    ok = (meta.get("zarr_format") == 2 and len(chunks) == len(shape) and min(shape + (0,)) >= 0
          and min(chunks + (1,)) >= 1 and not meta.get("filters"))
  except (KeyError, TypeError, ValueError, AttributeError):
    ok = False
  if not ok:
    raise T5XCheckpointError(f"{name}/.zarray: not zarr v2 array metadata")
  if dtype is None:
    raise T5XCheckpointError(f"{name}: dtype {meta['dtype']!r}; a T5 parameter is float32, "
                             "bfloat16 or float16")
  n_chunks = math.prod(-(-n // c) for n, c in zip(shape, chunks))
  if compressor not in COMPRESSORS or n_chunks > MAX_CHUNKS:
    raise T5XCheckpointError(f"{name}/.zarray: compressor {compressor!r} or chunking {chunks} "
                             "is not one a T5X checkpoint uses; refused")
  itemsize = _np_dtype(dtype).itemsize
  stored = _chunk_bytes(path, name, math.prod(chunks) * itemsize)
  claimed = math.prod(shape) * itemsize
  ratio, free = (MAX_COMPRESSION_RATIO, UNCHECKED_BYTES) if compressor else (1, 0)
  if claimed > max(stored * ratio, free):
    raise T5XCheckpointError(
        f"{name}/.zarray: shape {shape} of {dtype} claims {claimed:,} bytes, but its chunk "
        f"files hold {stored:,} bytes ({'compressed ' if compressor else ''}data expands at "
        f"most {ratio}x); refused before reading")
  return _ZarrArray(name, path, shape, dtype, stored)


def _chunk_bytes(path: str, name: str, chunk_raw: int) -> int:
  """Bytes (apparent sizes) of an array folder's chunk files. tensorstore reads each whole,
  so one larger than its chunk could compress to (every codec adds under 1% + 4 KiB to data
  that does not compress) is refused, as padding that would back a claim it cannot fill."""
  total = 0
  for dirpath, _, filenames in os.walk(path):
    for filename in filenames:
      if dirpath == path and filename in ZARR_META_FILES:
        continue
      size = os.path.getsize(os.path.join(dirpath, filename))
      if size > chunk_raw + chunk_raw // 100 + 4096:
        raise T5XCheckpointError(
            f"{name}/{os.path.relpath(os.path.join(dirpath, filename), path)}: {size:,} "
            f"bytes, more than a chunk of {chunk_raw:,} raw bytes can take; refused")
      total += size
  return total


def check_size(target: dict, label: str, max_params: int | None = None) -> None:
  """The whole target against the import ceiling and (zarr arrays) its chunk files, before
  any data is read: each array passed alone, but many can add up."""
  counts = {key: math.prod(leaf.shape) for key, leaf in target.items()}
  if not counts:
    return
  largest = max(counts, key=counts.get)
  limits.check_ceiling(sum(counts.values()), f"{label}: the target ({len(counts)} arrays; the "
                       f"largest, {'/'.join(largest)}, of shape {tuple(target[largest].shape)})",
                       max_params)
  arrays = [leaf for leaf in target.values() if isinstance(leaf, _ZarrArray)]
  claimed = sum(math.prod(a.shape) * _np_dtype(a.dtype).itemsize for a in arrays)
  stored = sum(a.stored for a in arrays)
  if claimed > max(stored * MAX_COMPRESSION_RATIO, UNCHECKED_BYTES):
    raise T5XCheckpointError(
        f"{label}: its zarr arrays claim {claimed:,} bytes in all, but their chunk files hold "
        f"{stored:,} bytes (over {MAX_COMPRESSION_RATIO}x); refused before reading")


# --- the two layouts: a flat {T5X key path: array} of 'target' --------------------------------

def _flatten(tree, name: str, prefix=(), depth=0) -> dict[tuple[str, ...], Any]:
  if depth > MAX_DEPTH:
    raise T5XCheckpointError(f"{name}: tree nested deeper than {MAX_DEPTH} levels")
  if isinstance(tree, dict) and not {"driver", "kvstore"} <= set(tree):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, name, prefix + (str(key),), depth + 1))
    return out
  return {prefix: tree}


def _optimizer_of(tree, name: str) -> dict:
  """T5X's optimizer state dict ({'target', 'state'}): under 'optimizer' from version 1 on;
  version 0 (a plain flax checkpoint) is that dict itself."""
  if isinstance(tree, dict) and isinstance(tree.get("version"), int) and tree["version"] >= 1:
    tree = tree.get("optimizer")
  if not isinstance(tree, dict) or not isinstance(tree.get("target"), dict):
    keys = sorted(map(str, tree))[:10] if isinstance(tree, dict) else type(tree).__name__
    raise T5XCheckpointError(f"{name}: no 'target' params in it ({keys})")
  return tree


def _msgpack_leaf(ckpt_dir: str, key: tuple[str, ...], leaf, name: str):
  label = f"{name}/{'.'.join(key)}"
  if isinstance(leaf, _Inline):
    return leaf.decode(label)
  if isinstance(leaf, dict):
    kvstore = leaf.get("kvstore") if isinstance(leaf.get("kvstore"), dict) else {}
    relpath = kvstore.get("path", leaf.get("path"))  # tensorstore < 0.1.14 kept 'path' on top
    if leaf.get("driver") != "zarr" or kvstore.get("driver") not in ("file", "gfile", "gcs"):
      raise T5XCheckpointError(f"{label}: tensorstore spec {leaf.get('driver')!r}/"
                               f"{kvstore.get('driver')!r} is not T5X's zarr on file; refused")
    if not isinstance(relpath, str):
      raise T5XCheckpointError(f"{label}: tensorstore spec without a path")
    relpath = relpath.rstrip("/")
    array = _zarr_array(ckpt_dir, relpath, f"{os.path.basename(ckpt_dir)}/{relpath}")
    shape = (leaf.get("metadata") or {}).get("shape")
    if shape is not None and tuple(int(n) for n in shape) != array.shape:
      raise T5XCheckpointError(f"{array.name}: the msgpack spec says shape {tuple(shape)}, "
                               f".zarray says {array.shape}")
    return array
  raise T5XCheckpointError(f"{label}: {type(leaf).__name__} where a parameter array belongs")


def _read_msgpack_layout(ckpt_dir: str) -> tuple[dict, int | None]:
  name = f"{os.path.basename(ckpt_dir)}/checkpoint"
  tree = _read_msgpack(os.path.join(ckpt_dir, "checkpoint"), name)
  optimizer = _optimizer_of(tree, name)
  target = _flatten(optimizer["target"], name)
  state = optimizer.get("state")
  step = state.get("step") if isinstance(state, dict) else None
  step = int(step.decode(f"{name}: step", STEP_DTYPES)) if isinstance(step, _Inline) else None
  return {k: _msgpack_leaf(ckpt_dir, k, v, name) for k, v in target.items()}, step


def _orbax_tree(state_dir: str, label: str) -> dict[tuple[str, ...], Any]:
  """Flat tree of an orbax 'state' item: from _METADATA (current orbax), the aggregate
  msgpack `checkpoint` (T5X-era orbax), else the array folder names (orbax's own fallback,
  utils.pytree_structure)."""
  metadata, aggregate = (os.path.join(state_dir, n) for n in ("_METADATA", "checkpoint"))
  if os.path.isfile(metadata):
    meta = _read_json(metadata, f"{label}/_METADATA")
    if meta.get("use_ocdbt") or meta.get("use_zarr3"):
      raise T5XCheckpointError(f"{label}: OCDBT/zarr3 orbax checkpoint; T5X writes "
                               "use_ocdbt=False zarr arrays, and only those are read")
    keys = [tuple(str(k["key"]) for k in entry["key_metadata"])
            for entry in (meta.get("tree_metadata") or {}).values()]
    if any(key[:1] == ("target",) for key in keys):
      return {key: PLACEHOLDER + ".".join(key) for key in keys}
  if os.path.isfile(aggregate):
    return _flatten(_read_msgpack(aggregate, f"{label}/checkpoint"), f"{label}/checkpoint")
  return {tuple(name.split(".")): PLACEHOLDER + name for name in os.listdir(state_dir)
          if name.startswith("target.")}


def _read_orbax_layout(ckpt_dir: str) -> tuple[dict, int | None]:
  state_dir = os.path.join(ckpt_dir, "state")
  label = f"{os.path.basename(ckpt_dir)}/state"
  out = {}
  for key, leaf in _orbax_tree(state_dir, label).items():
    if not key or key[0] != "target":
      continue  # optimizer state, step: not imported
    if any(not k or "/" in k or k in (".", "..") for k in key):
      raise T5XCheckpointError(f"{label}: key {key!r} cannot name an array folder; refused")
    if isinstance(leaf, _Inline):
      out[key[1:]] = leaf.decode(f"{label}/{'.'.join(key)}")
    elif isinstance(leaf, str) and leaf.startswith(PLACEHOLDER):
      relpath = leaf[len(PLACEHOLDER):]
      out[key[1:]] = _zarr_array(state_dir, relpath, f"{label}/{relpath}")
    else:
      raise T5XCheckpointError(f"{label}/{'.'.join(key)}: {type(leaf).__name__} where a "
                               "parameter array belongs")
  if not out:
    raise T5XCheckpointError(f"{label}: no 'target' params in it")
  return out, None


def read_target(ckpt_dir: str, max_params: int | None = None
                ) -> tuple[dict[tuple[str, ...], Any], int | None]:
  """({T5X param path: inline ndarray or validated _ZarrArray}, step if recorded); sizes are
  checked (check_size), no zarr data is read. max_params: the import ceiling (limits.py)."""
  try:
    if os.path.isfile(os.path.join(ckpt_dir, "checkpoint")):
      target, step = _read_msgpack_layout(ckpt_dir)
    else:
      target, step = _read_orbax_layout(ckpt_dir)
  except (AttributeError, TypeError, KeyError) as e:  # a tree of the wrong shape somewhere
    raise T5XCheckpointError(f"{os.path.basename(ckpt_dir)}: malformed checkpoint tree "
                             f"({e!r})") from None
  check_size(target, os.path.basename(ckpt_dir), max_params)
  return target, step
