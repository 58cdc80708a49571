"""HF transformers checkpoints <-> t5lite (config, params): load_hf and save_hf.

The files (config.json, model.safetensors or its shards, legacy .bin) are read and written
here; what the names and shapes mean is the layout of each HF model_type (layout.py and
one module per type beside it: t5, switch, bert (BERT, RoBERTa), albert, electra, gpt2,
llama). Import dispatches on config.json's `model_type`; export on the config's family.
Finetuning heads (ModelConfig.head: BertForSequenceClassification,
GPT2ForSequenceClassification, ...) are heads.py's share of each layout: import reads the head
from `architectures[0]` (or from the tensors present), export names the head's class.

Untrusted input (limits.py): load_hf checks config.json's sizes (integers, the parameters they
imply under the import ceiling) and then that the weight files hold that many values (the
safetensors headers' shapes, read before the data), before it reads weights or builds the
model. Every file it opens must lie inside the directory: a symlink out is refused.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from t5lite.errors import ConfigError, ConfigFileNotFoundError
# Imported for their registrations: each layout module registers its HF model_type.
from t5lite.interop.hf import albert as hf_albert  # noqa: F401
from t5lite.interop.hf import bert as hf_bert  # noqa: F401
from t5lite.interop.hf import electra as hf_electra  # noqa: F401
from t5lite.interop.hf import gpt2 as hf_gpt2  # noqa: F401
from t5lite.interop.hf import llama as hf_llama  # noqa: F401
from t5lite.interop.hf import switch as hf_switch  # noqa: F401
from t5lite.interop.hf import t5 as hf_t5  # noqa: F401
from t5lite.interop.hf import layout as hf_layout
from t5lite.interop import limits
from t5lite.models.config import ModelConfig
from t5lite.models.params import Params
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX_FILE = "pytorch_model.bin.index.json"
# load_hf overrides may change how a model runs, never what it is.
RUNTIME_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat_policy", "dropout_rate")


# --- dispatch ---------------------------------------------------------------------------

def config_to_hf(config: ModelConfig) -> dict:
  """HF config.json contents of a config, in its family's HF layout; raises for options that
  layout cannot express."""
  return hf_layout.for_config(config).config_to_hf(config)


def config_from_hf(hf: Mapping, *, tied: bool | None = None, **overrides) -> ModelConfig:
  """ModelConfig of HF config.json contents (model_type picks the layout; T5 when absent).
  tied: T5 only, whether lm_head is the shared embedding (load_hf reads it from the weights)."""
  layout = hf_layout.for_model_type(hf.get("model_type", "t5"))
  if tied is not None:
    overrides["tie_output_embedding"] = tied
  return layout.config_from_hf(hf, None, **overrides)


def params_to_hf(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """HF state dict (numpy, torch layout) from t5lite params (scanned or not)."""
  return hf_layout.params_to_hf(hf_layout.for_config(config), config, params)


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Params:
  """t5lite params (scanned iff config.scan_layers) from an HF state dict; checks every shape."""
  return hf_layout.params_from_hf(hf_layout.for_config(config), config, tensors)


# --- files ----------------------------------------------------------------------------------

def _torch_to_numpy(tensor) -> np.ndarray:
  import torch
  if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
    return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return tensor.numpy()


def _read_torch_files(paths: list[str]) -> dict[str, np.ndarray]:
  import torch  # only needed for legacy .bin checkpoints
  tensors = {}
  for path in paths:
    # weights_only=True: tensors and plain containers only, never arbitrary unpickling.
    try:
      state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, or a pickle that needs more than tensors
      raise ConfigError(f"{path} cannot be read as a weights-only torch checkpoint: "
                        f"{type(e).__name__}: {e}") from e
    if not isinstance(state, dict):
      raise ConfigError(f"{path}: a {type(state).__name__}, not a state dict of tensors")
    for key, value in state.items():
      if not isinstance(value, torch.Tensor):  # weights_only still allows ints, lists, dicts
        raise ConfigError(f"{path}: entry {key!r} is not a tensor (a {type(value).__name__})")
    tensors.update({k: _torch_to_numpy(v) for k, v in state.items()})
  return tensors


def _index_shards(index_path: str) -> list[str]:
  """The shard files an index names; each must be a plain file name beside the index (and no
  symlink out of it), so an untrusted index cannot point reads outside its directory."""
  try:
    weight_map = limits.read_json(index_path)["weight_map"]
    names = sorted(set(map(str, weight_map.values())))
  except (KeyError, TypeError, AttributeError) as e:
    raise ConfigError(f"{index_path}: not a valid weight index ({type(e).__name__}: {e})") from e
  directory = os.path.dirname(os.path.abspath(index_path))
  shards = []
  for shard in names:
    if not shard or os.path.basename(shard) != shard or shard in (".", ".."):
      raise ConfigError(f"{index_path} names shard {shard!r} outside its directory; refused")
    path = limits.file_inside(directory, shard)
    if path is None or not os.path.isfile(path):
      raise ConfigFileNotFoundError(f"{index_path} names shard {shard}, which is missing")
    shards.append(path)
  return shards


def _safetensors_values(path: str) -> int:
  """How many values a safetensors file holds, from its header alone (exact shapes; the
  library checks them against the file's length) and before any data is read."""
  try:
    with safetensors.safe_open(path, framework="numpy") as f:
      return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
  except Exception as e:  # SafetensorError, OSError
    raise ConfigError(f"{path} cannot be read (truncated or corrupted?): "
                      f"{type(e).__name__}: {e}") from e


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  """One safetensors file; a truncated or corrupted one gives an error naming it. The format
  holds only a JSON header and raw arrays (no code), and the library checks every offset."""
  try:
    tensors = safetensors.numpy.load_file(path)
  except Exception as e:  # safetensors raises its own SafetensorError and OSErrors
    raise ConfigError(f"{path} cannot be read (truncated or corrupted?): "
                      f"{type(e).__name__}: {e}") from e
  return tensors


def weight_files(path: str) -> tuple[str, list[str]]:
  """('safetensors' or 'torch', the weight files) of an HF directory: model.safetensors or
  its sharded index, else pytorch_model.bin or its index; none may be a symlink out."""
  for name, kind in ((WEIGHTS_FILE, "safetensors"), (INDEX_FILE, "safetensors"),
                     (TORCH_FILE, "torch"), (TORCH_INDEX_FILE, "torch")):
    found = limits.file_inside(path, name)
    if found is not None and os.path.exists(found):
      return kind, _index_shards(found) if name.endswith(".json") else [found]
  raise ConfigFileNotFoundError(f"no weights in {path}: looked for {WEIGHTS_FILE}, "
                                f"{INDEX_FILE}, {TORCH_FILE}, {TORCH_INDEX_FILE}")


def read_hf_tensors(path: str, claimed: int = 0, what: str = "config.json", *,
                    torch_files: bool = True) -> dict[str, np.ndarray]:
  """All tensors of an HF directory (see weight_files); .bin files only through
  torch.load(weights_only=True), never a plain unpickle, and only with torch_files (legacy
  T5 checkpoints; every other model type is read from safetensors only). Refuses files that
  hold fewer values than the `claimed` parameters: safetensors before reading (their headers
  say), torch after (reading costs no more than the files' size) and before anything is
  built from them."""
  kind, files = weight_files(path)
  if kind == "torch" and not torch_files:
    raise ConfigError(f"{path} holds only {os.path.basename(files[0])}: t5lite reads this "
                      "model type from safetensors only (no pickles); convert it with "
                      "transformers: AutoModel.from_pretrained(DIR).save_pretrained(NEW_DIR)")
  if kind == "safetensors":
    _check_held(claimed, sum(_safetensors_values(f) for f in files), files, what)
    tensors = {}
    for f in files:
      tensors.update(_read_safetensors(f))
    return tensors
  tensors = _read_torch_files(files)
  _check_held(claimed, sum(int(v.size) for v in tensors.values()), files, what)
  return tensors


def _check_held(claimed: int, held: int, files: list[str], what: str) -> None:
  if claimed > held:
    where = f"{files[0]} holds" if len(files) == 1 else f"its {len(files)} shards hold"
    raise ConfigError(f"{what} claims {claimed:,} parameters, but {where} only "
                      f"{held:,} values: the config does not describe these weights")


def load_hf(path: str, *, max_params: int | None = None,
            **config_overrides) -> tuple[ModelConfig, Params]:
  """Reads an HF model directory (config.json + weights) into (ModelConfig, params), for
  every model_type with a layout (hf_layout.supported()); an unknown one names those.

  Works for transformers 4.x-era and 5.x checkpoints. config_overrides (e.g.
  scan_layers=True, dtype='bfloat16') change how the model runs, not what it is.
  max_params: the import ceiling (limits.py; default T5LITE_MAX_IMPORT_PARAMS, else 10**11).
  """
  bad = sorted(set(config_overrides) - set(RUNTIME_FIELDS))
  if bad:
    raise ConfigError(f"load_hf overrides {bad} would change the checkpoint's architecture; "
                      f"only {RUNTIME_FIELDS} may be overridden")
  config_file = limits.file_inside(path, "config.json")
  if config_file is None or not os.path.isfile(config_file):
    raise ConfigFileNotFoundError(f"{os.path.join(path, 'config.json')} not found: is {path} "
                                  "an HF model directory?")
  hf_config = limits.read_json(config_file)
  if not isinstance(hf_config, Mapping):
    raise ConfigError(f"{config_file}: a JSON {type(hf_config).__name__}, not an object of "
                      "settings")
  layout = hf_layout.for_model_type(hf_config.get("model_type", "t5"), config_file)
  # Before any weight is read or anything built: the claim under the ceiling, then (in
  # read_hf_tensors) backed by the files.
  claimed, what = layout.check_claim(hf_config, config_file, max_params)
  tensors = read_hf_tensors(path, claimed, what, torch_files=layout.reads_torch_files)
  tensors = layout.checkpoint_tensors(tensors)
  # The parameter dtype is the checkpoint's: that of its embedding table.
  probe = layout.config_from_hf(hf_config, tensors)
  embedding = tensors.get(layout.embedding_name(probe))
  if embedding is not None and str(embedding.dtype) in ("float32", "bfloat16", "float16"):
    config_overrides.setdefault("param_dtype", str(embedding.dtype))
  config = layout.config_from_hf(hf_config, tensors, **config_overrides)
  return config, hf_layout.params_from_hf(layout, config, tensors)


def save_hf(config: ModelConfig, params: Params, path: str, *,
            max_shard_bytes: int | None = None) -> list[str]:
  """Writes config.json and model.safetensors that transformers loads with no missing,
  unexpected or mismatched weights; returns the file names written.

  Over max_shard_bytes (None: never) the weights go into model-0000i-of-0000n.safetensors
  shards with a model.safetensors.index.json, as transformers' save_pretrained shards them.
  """
  return write_hf(config, params, path, max_shard_bytes=max_shard_bytes)


def write_hf(config: ModelConfig, params: Params, path: str, *,
             max_shard_bytes: int | None = None,
             progress: Callable[[int, int], Any] | None = None) -> list[str]:
  """save_hf, telling its progress: progress(shards written, shards) before the first shard
  and after each (`t5lite export hf` shows it)."""
  hf_config = config_to_hf(config)  # refuses options the HF model cannot express
  os.makedirs(path, exist_ok=True)
  tensors = params_to_hf(config, params)
  shards = _split(tensors, max_shard_bytes)
  names = ([WEIGHTS_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for i, (name, shard) in enumerate(zip(names, shards)):
    if progress is not None:
      progress(i, len(shards))
    safetensors.numpy.save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
  if progress is not None:
    progress(len(shards), len(shards))
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(int(v.nbytes) for v in tensors.values())},
             "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
    names.append(INDEX_FILE)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  return ["config.json"] + names


def _split(tensors: dict[str, np.ndarray], max_bytes: int | None) -> list[dict[str, np.ndarray]]:
  """Tensors in order, cut into groups of at most max_bytes (a bigger tensor goes alone)."""
  shards, size = [{}], 0
  for name, tensor in tensors.items():
    if max_bytes is not None and shards[-1] and size + tensor.nbytes > max_bytes:
      shards, size = shards + [{}], 0
    shards[-1][name] = tensor
    size += tensor.nbytes
  return shards
