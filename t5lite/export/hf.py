"""HF transformers T5 checkpoints <-> t5lite (config, params): load_hf and save_hf.

Layout facts: torch Linear weights are (out, in), so kernels are transposed;
attention kernels (D, H, K) flatten to (H*K, D). The relative bias table sits in block 0 of
each stack. transformers 5.x always says `tie_word_embeddings: true` and records logit
scaling as `scale_decoder_outputs`; 4.x-era configs use `tie_word_embeddings` for both, so an
export needs tie_output_embedding == scale_logits (the combinations both read alike).
A model is untied when its checkpoint has an `lm_head.weight` that differs from `shared.weight`.
"""
from __future__ import annotations

import json
import os
from typing import Mapping

import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import traverse_util

from t5lite.errors import ConfigError, ConfigFileNotFoundError, ConfigKeyError
from t5lite.families import family_of
from t5lite.models.config import ModelConfig
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


def config_from_hf(hf: Mapping, *, tied: bool, **overrides) -> ModelConfig:
  """ModelConfig from HF config.json contents; `tied` comes from the weights (see module doc)."""
  if hf.get("model_type", "t5") not in ("t5", "mt5"):  # mT5 shares T5's layout
    raise ConfigError(f"model_type={hf.get('model_type')!r}: only HF T5 checkpoints can be read")
  proj = hf.get("feed_forward_proj", "relu")
  if proj not in FROM_HF_ACTIVATION:
    raise ConfigError(f"feed_forward_proj={proj!r} has no t5lite equivalent; "
                      f"supported: {sorted(FROM_HF_ACTIVATION)}")
  # 5.x: scale_decoder_outputs; 4.x-era: tie_word_embeddings also meant "scale" (default True).
  scale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))
  values = dict(  # ModelConfig's default architecture: T5's encoder-decoder
      vocab_size=hf["vocab_size"],
      d_model=hf["d_model"],
      d_ff=hf["d_ff"],
      num_heads=hf["num_heads"],
      d_kv=hf["d_kv"],
      num_encoder_layers=hf["num_layers"],
      num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
      mlp_activation=FROM_HF_ACTIVATION[proj],
      norm="rms",
      layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-6),
      position_encoding="relative_bias",
      relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
      relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
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
  """The shard files an index names; each must be a plain file name beside the index, so an
  untrusted index cannot point reads outside its directory."""
  try:
    with open(index_path, encoding="utf-8") as f:
      weight_map = json.load(f)["weight_map"]
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"{index_path}: not a valid weight index ({type(e).__name__}: {e})") from e
  directory = os.path.dirname(os.path.abspath(index_path))
  shards = []
  for shard in sorted(set(weight_map.values())):
    path = os.path.join(directory, str(shard))
    if (os.path.basename(str(shard)) != shard or
        os.path.dirname(os.path.realpath(path)) != os.path.realpath(directory)):
      raise ConfigError(f"{index_path} names shard {shard!r} outside its directory; refused")
    if not os.path.isfile(path):
      raise ConfigFileNotFoundError(f"{index_path} names shard {shard}, which is missing")
    shards.append(path)
  return shards


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


def read_hf_tensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of an HF directory: model.safetensors or its sharded index, else (through
  torch.load(weights_only=True), never a plain unpickle) pytorch_model.bin or its index."""
  candidates = {name: os.path.join(path, name) for name in
                (WEIGHTS_FILE, INDEX_FILE, TORCH_FILE, TORCH_INDEX_FILE)}
  if os.path.exists(candidates[WEIGHTS_FILE]):
    return _read_safetensors(candidates[WEIGHTS_FILE])
  if os.path.exists(candidates[INDEX_FILE]):
    tensors = {}
    for shard in _index_shards(candidates[INDEX_FILE]):
      tensors.update(_read_safetensors(shard))
    return tensors
  if os.path.exists(candidates[TORCH_FILE]):
    return _read_torch_files([candidates[TORCH_FILE]])
  if os.path.exists(candidates[TORCH_INDEX_FILE]):
    return _read_torch_files(_index_shards(candidates[TORCH_INDEX_FILE]))
  raise ConfigFileNotFoundError(f"no weights in {path}: looked for {', '.join(candidates)}")


def load_hf(path: str, **config_overrides) -> tuple[ModelConfig, Params]:
  """Reads an HF T5 directory (config.json + weights) into (ModelConfig, params).

  Works for transformers 4.x-era and 5.x checkpoints. config_overrides (e.g.
  scan_layers=True, dtype='bfloat16') change how the model runs, not what it is.
  """
  bad = sorted(set(config_overrides) - set(RUNTIME_FIELDS))
  if bad:
    raise ConfigError(f"load_hf overrides {bad} would change the checkpoint's architecture; "
                      f"only {RUNTIME_FIELDS} may be overridden")
  config_file = os.path.join(path, "config.json")
  if not os.path.exists(config_file):
    raise ConfigFileNotFoundError(f"{config_file} not found: is {path} an HF model directory?")
  with open(config_file) as f:
    hf_config = json.load(f)
  tensors = read_hf_tensors(path)
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
