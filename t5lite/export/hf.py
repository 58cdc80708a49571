"""HF transformers T5 checkpoints <-> t5lite (config, params): load_hf and save_hf.

Layout facts: torch Linear weights are (out, in), so kernels are transposed;
attention kernels (D, H, K) flatten to (H*K, D). The relative bias table sits in block 0 of
each stack. transformers 5.x always says `tie_word_embeddings: true` and records logit
scaling as `scale_decoder_outputs`; 4.x-era configs use `tie_word_embeddings` for both, so an
export needs tie_output_embedding == scale_logits (the combinations both read alike).
A model is untied when its checkpoint has an `lm_head.weight` that differs from `shared.weight`.

Untrusted input (limits.py): load_hf checks config.json's sizes (integers, the parameters they
imply under the import ceiling) and then that the weight files hold that many values (the
safetensors headers' shapes, read before the data), before it reads weights or builds the
model. Every file it opens must lie inside the directory: a symlink out is refused.
"""
from __future__ import annotations

import json
import math
import os
from typing import Mapping

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
from flax import traverse_util

from t5lite.errors import ConfigError, ConfigFileNotFoundError, ConfigKeyError
from t5lite.export import limits
from t5lite.families import family_of
from t5lite.models.config import GATED_ACTIVATIONS, ModelConfig
from t5lite.models.params import Params, abstract_params, scan_params, unscan_params
from t5lite.models.transformer import CROSS_ATTENTION

# Our activation names <-> HF `feed_forward_proj` ("gated-X" = act(wi_0) * wi_1).
TO_HF_ACTIVATION = {"relu": "relu", "gated-gelu": "gated-gelu", "gelu": "gelu_new",
                    "swiglu": "gated-silu", "reglu": "gated-relu"}
FROM_HF_ACTIVATION = {v: k for k, v in TO_HF_ACTIVATION.items()}
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX_FILE = "pytorch_model.bin.index.json"
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# load_hf overrides may change how a model runs, never what it is.
RUNTIME_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat_policy", "dropout_rate")
# config.json sizes -> ModelConfig fields; each must be a positive integer.
SIZE_FIELDS = {"vocab_size": "vocab_size", "d_model": "d_model", "d_ff": "d_ff",
               "num_heads": "num_heads", "d_kv": "d_kv", "num_layers": "num_encoder_layers",
               "num_decoder_layers": "num_decoder_layers",
               "relative_attention_num_buckets": "relative_attention_num_buckets",
               "relative_attention_max_distance": "relative_attention_max_distance"}


# --- config ---------------------------------------------------------------------------------

def config_to_hf(config: ModelConfig) -> dict:
  """HF config.json contents; raises for variants that HF's T5 cannot express."""
  family = family_of(config)
  if family.hf_model_type != "t5":
    raise ConfigError(f"a {family.name!r} model has no HF T5 layout (HF mapping: "
                      f"{family.hf_model_type or 'none'}); it cannot be exported to it")
  unsupported = {
      "norm": (config.norm, "rms"),
      "position_encoding": (config.position_encoding, "relative_bias"),
  }
  for field, (value, needed) in unsupported.items():
    if value != needed:
      raise ConfigError(f"HF T5 has no equivalent of {field}={value!r} (it needs {needed!r}); "
                        "this model cannot be exported to the HF T5 layout")
  if config.tie_output_embedding != config.scale_logits:
    # transformers 4.x reads tie_word_embeddings as "tie and scale": such an export would
    # give it wrong logits (5.x alone reads scale_decoder_outputs).
    raise ConfigError(
        f"tie_output_embedding={config.tie_output_embedding} but scale_logits="
        f"{config.scale_logits}: HF's T5 layout (transformers 4.x semantics, where "
        "tie_word_embeddings means tied and scaled) needs them equal; this model cannot be "
        "exported to it")
  return {
      "architectures": ["T5ForConditionalGeneration"],
      "model_type": "t5",
      "d_model": config.d_model,
      "d_kv": config.d_kv,
      "d_ff": config.d_ff,
      "num_layers": config.num_encoder_layers,
      "num_decoder_layers": config.num_decoder_layers,
      "num_heads": config.num_heads,
      "feed_forward_proj": TO_HF_ACTIVATION[config.mlp_activation],
      "relative_attention_num_buckets": config.relative_attention_num_buckets,
      "relative_attention_max_distance": config.relative_attention_max_distance,
      "layer_norm_epsilon": config.layer_norm_epsilon,
      "dropout_rate": config.dropout_rate,
      "initializer_factor": 1.0,
      "is_encoder_decoder": True,
      "tie_word_embeddings": config.tie_output_embedding,
      "scale_decoder_outputs": config.scale_logits,
      "vocab_size": config.vocab_size,
      "pad_token_id": 0,
      "eos_token_id": 1,
      "decoder_start_token_id": 0,
      "use_cache": True,
  }


def hf_sizes(hf: Mapping, where: str = "config.json") -> dict[str, int]:
  """config.json's sizes by HF name, each checked to be a positive integer (a ConfigError
  names the field otherwise); num_decoder_layers defaults to num_layers, as in HF."""
  if not isinstance(hf, Mapping):
    raise ConfigError(f"{where}: a JSON {type(hf).__name__}, not an object of settings")
  defaults = {"num_decoder_layers": None, "relative_attention_num_buckets": 32,
              "relative_attention_max_distance": 128}
  sizes = {}
  for field in SIZE_FIELDS:
    if field not in hf and field not in defaults:
      raise ConfigError(f"{where} lacks {field!r}: not an HF T5 config")
    value = hf.get(field, defaults.get(field))
    if field == "num_decoder_layers" and (value is None or (value == 0 and value is not False)):
      value = sizes["num_layers"]  # HF's T5Config: None (or 0) means as many as the encoder
    sizes[field] = limits.size_field(value, field, where)
  return sizes


def implied_params(sizes: Mapping[str, int], gated: bool) -> int:
  """Parameters an HF T5 config implies (Python ints: no overflow), lm_head left out."""
  d, f, h, k = sizes["d_model"], sizes["d_ff"], sizes["num_heads"], sizes["d_kv"]
  attention, mlp = 4 * d * h * k, (3 if gated else 2) * d * f
  return (sizes["vocab_size"] * d + 2 * sizes["relative_attention_num_buckets"] * h + 2 * d
          + sizes["num_layers"] * (attention + mlp + 2 * d)
          + sizes["num_decoder_layers"] * (2 * attention + mlp + 3 * d))


def check_claim(hf: Mapping, where: str, max_params: int | None = None) -> tuple[int, str]:
  """The parameters config.json implies, refused over the import ceiling (a lone size over
  it is named alone), and what claims them: to be checked against the weight files."""
  sizes = hf_sizes(hf, where)
  ceiling = limits.max_import_params(max_params)
  for field, value in sizes.items():
    if value > ceiling:
      raise ConfigError(f"{where}: {field}={value:,} is over the import ceiling of "
                        f"{ceiling:,} parameters ({limits.HOW_TO_RAISE})")
  proj = hf.get("feed_forward_proj", "relu")
  gated = isinstance(proj, str) and FROM_HF_ACTIVATION.get(proj) in GATED_ACTIVATIONS
  claimed = implied_params(sizes, gated)
  named = ", ".join(f"{k}={v:,}" for k, v in sizes.items())
  limits.check_ceiling(claimed, f"{where} ({named})", ceiling)
  return claimed, f"{where} ({named})"


def config_from_hf(hf: Mapping, *, tied: bool, **overrides) -> ModelConfig:
  """ModelConfig from HF config.json contents; `tied` comes from the weights (see module doc)."""
  if hf.get("model_type", "t5") not in ("t5", "mt5"):  # mT5 shares T5's layout
    raise ConfigError(f"model_type={hf.get('model_type')!r}: only HF T5 checkpoints can be read")
  proj = hf.get("feed_forward_proj", "relu")
  if not isinstance(proj, str) or proj not in FROM_HF_ACTIVATION:
    raise ConfigError(f"feed_forward_proj={proj!r} has no t5lite equivalent; "
                      f"supported: {sorted(FROM_HF_ACTIVATION)}")
  # 5.x: scale_decoder_outputs; 4.x-era: tie_word_embeddings also meant "scale" (default True).
  scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
  sizes = {SIZE_FIELDS[field]: value for field, value in hf_sizes(hf).items()}
  values = dict(  # ModelConfig's default architecture: T5's encoder-decoder
      **sizes,
      mlp_activation=FROM_HF_ACTIVATION[proj],
      norm="rms",
      layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-6),
      position_encoding="relative_bias",
      tie_output_embedding=tied,
      scale_logits=bool(scale),
      dropout_rate=hf.get("dropout_rate", 0.1),  # HF's T5Config default
  )
  values.update(overrides)
  return ModelConfig(**values)


# --- weights --------------------------------------------------------------------------------

# Per-layer (our sub-path, HF sub-name, kind). kind says how the array is laid out in torch:
# 'q': (D, H, K) kernel -> (H*K, D); 'o': (H, K, D) -> (D, H*K); 'dense': transpose; 'vec': as is.
def _attention(ours: str, hf: str):
  return [((ours, n, "kernel"), f"{hf}.{h}.weight", "o" if n == "out" else "q")
          for n, h in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))]


def _mlp(config: ModelConfig, hf: str):
  wis = ("wi_0", "wi_1") if config.gated_mlp else ("wi",)
  return [(("mlp", w, "kernel"), f"{hf}.DenseReluDense.{w}.weight", "dense") for w in wis + ("wo",)]


def _layer_map(config: ModelConfig, stack: str):
  if stack == "encoder":
    return (_attention("attention", "layer.0.SelfAttention")
            + [(("pre_attention_layer_norm", "scale"), "layer.0.layer_norm.weight", "vec")]
            + _mlp(config, "layer.1")
            + [(("pre_mlp_layer_norm", "scale"), "layer.1.layer_norm.weight", "vec")])
  return (_attention("self_attention", "layer.0.SelfAttention")
          + [(("pre_self_attention_layer_norm", "scale"), "layer.0.layer_norm.weight", "vec")]
          + _attention(CROSS_ATTENTION, "layer.1.EncDecAttention")
          + [(("pre_cross_attention_layer_norm", "scale"), "layer.1.layer_norm.weight", "vec")]
          + _mlp(config, "layer.2")
          + [(("pre_mlp_layer_norm", "scale"), "layer.2.layer_norm.weight", "vec")])


def weight_map(config: ModelConfig) -> list[tuple[tuple[str, ...], str, str]]:
  """(our flattened param path in the unscanned layout, HF tensor name, kind) for every param."""
  entries = [(("token_embedder", "embedding"), "shared.weight", "vec")]
  if not config.tie_output_embedding:
    entries.append((("decoder", "logits_dense", "kernel"), "lm_head.weight", "dense"))
  for stack, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    entries.append(((stack, "relpos_bias", "rel_embedding"),
                    f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", "vec"))
    entries.append(((stack, f"{stack}_norm", "scale"), f"{stack}.final_layer_norm.weight", "vec"))
    for i in range(n):
      for path, hf, kind in _layer_map(config, stack):
        entries.append(((stack, f"layers_{i}") + path, f"{stack}.block.{i}.{hf}", kind))
  return entries


def _to_torch_layout(kind: str, x: np.ndarray) -> np.ndarray:
  if kind == "q":
    return x.reshape(x.shape[0], -1).T
  if kind == "o":
    return x.reshape(-1, x.shape[-1]).T
  return x.T if kind == "dense" else x


def _from_torch_layout(kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  return (w if kind == "vec" else w.T).reshape(shape)


def _torch_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  """The torch-layout shape of a param of `shape` (no array is built)."""
  if kind == "q":
    return (int(np.prod(shape[1:])), shape[0])
  if kind == "o":
    return (shape[-1], int(np.prod(shape[:-1])))
  return tuple(reversed(shape)) if kind == "dense" else tuple(shape)


def params_to_hf(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """HF state dict (numpy, torch layout) from t5lite params (scanned or not)."""
  flat = traverse_util.flatten_dict(unscan_params(params))
  return {hf: np.ascontiguousarray(_to_torch_layout(kind, np.asarray(flat[path])))
          for path, hf, kind in weight_map(config)}


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Params:
  """t5lite params (scanned iff config.scan_layers) from an HF state dict; checks every shape."""
  shapes = traverse_util.flatten_dict(abstract_params(config.replace(scan_layers=False)))
  flat = {}
  for path, hf, kind in weight_map(config):
    if hf not in tensors:
      raise ConfigKeyError(f"HF checkpoint lacks tensor {hf!r} needed for {'/'.join(path)}")
    w = np.asarray(tensors[hf])
    shape = tuple(shapes[path].shape)
    if w.shape != _torch_shape(kind, shape):
      raise ConfigError(f"HF tensor {hf!r} has shape {w.shape}, expected "
                        f"{_torch_shape(kind, shape)} for {'/'.join(path)} of this config")
    # One dtype for the whole tree (HF may keep `wo` in float32 inside a half checkpoint).
    flat[path] = _from_torch_layout(kind, w, shape).astype(config.storage_dtype, copy=False)
  params = traverse_util.unflatten_dict(flat)
  return scan_params(params, config) if config.scan_layers else params


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
    tensors.update(_check_dtypes({k: _torch_to_numpy(v) for k, v in state.items()}, path))
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
  return _check_dtypes(tensors, path)


def _check_dtypes(tensors: dict[str, np.ndarray], path: str) -> dict[str, np.ndarray]:
  bad = {k: str(v.dtype) for k, v in tensors.items() if str(v.dtype) not in FLOAT_DTYPES}
  if bad:
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise ConfigError(f"{path}: T5 weights are floating point; these are not: "
                      f"{dict(list(bad.items())[:5])}{more}")
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


def read_hf_tensors(path: str, claimed: int = 0, what: str = "config.json"
                    ) -> dict[str, np.ndarray]:
  """All tensors of an HF directory (see weight_files); .bin files only through
  torch.load(weights_only=True), never a plain unpickle. Refuses files that hold fewer values
  than the `claimed` parameters: safetensors before reading (their headers say), torch after
  (reading costs no more than the files' size) and before anything is built from them."""
  kind, files = weight_files(path)
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
  """Reads an HF T5 directory (config.json + weights) into (ModelConfig, params).

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
  # Before any weight is read or anything built: the claim under the ceiling, then (in
  # read_hf_tensors) backed by the files.
  claimed, what = check_claim(hf_config, config_file, max_params)
  tensors = read_hf_tensors(path, claimed, what)
  if "shared.weight" not in tensors:
    raise ConfigKeyError(f"{path} holds no 'shared.weight': not an HF T5 checkpoint")
  shared = tensors["shared.weight"]
  lm_head = tensors.get("lm_head.weight")
  tied = lm_head is None or np.array_equal(lm_head, shared)
  config_overrides.setdefault("param_dtype", str(shared.dtype) if str(shared.dtype) in
                              ("float32", "bfloat16", "float16") else "float32")
  config = config_from_hf(hf_config, tied=tied, **config_overrides)
  return config, params_from_hf(config, tensors)


def save_hf(config: ModelConfig, params: Params, path: str, *,
            max_shard_bytes: int | None = None) -> list[str]:
  """Writes config.json and model.safetensors that transformers loads with no missing,
  unexpected or mismatched weights; returns the file names written.

  Over max_shard_bytes (None: never) the weights go into model-0000i-of-0000n.safetensors
  shards with a model.safetensors.index.json, as transformers' save_pretrained shards them.
  """
  hf_config = config_to_hf(config)
  os.makedirs(path, exist_ok=True)
  tensors = params_to_hf(config, params)
  shards = _split(tensors, max_shard_bytes)
  names = ([WEIGHTS_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for name, shard in zip(names, shards):
    safetensors.numpy.save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
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
