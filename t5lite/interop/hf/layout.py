"""HF layouts: how one HF `model_type` maps to t5lite (config fields and weight names).

A layout is one small module per model type (t5.py, bert.py, ... here) that subclasses
HFLayout and registers itself; t5lite.interop.hf.checkpoints reads and writes the files and
dispatches on `model_type` (import) or on the family's `hf_model_type` (export). A layout says:

  config_to_hf(config)               config.json contents; a ConfigError names any option of
                                     the config that the HF model cannot express
  config_from_hf(hf, tensors)        the ModelConfig of a config.json (tensors: the weights,
                                     when the config alone does not say, e.g. T5's tying)
  weight_map(config)                 one Entry per HF tensor: which of our params it holds
  check_claim(hf, where, max_params) the parameters config.json implies, under the ceiling

Entries convert between our kernels and torch's layouts. Our kernels are (in..., out...),
e.g. a query kernel (D, H, K) has one input axis; torch's Linear keeps (out, in) and GPT-2's
Conv1D (in, out). Several of our params can live in one HF tensor (GPT-2's fused q/k/v
`c_attn`): they are flattened to (in, out) and concatenated along `out`.

Example: Entry((("encoder", "layers_0", "attention", "out", "kernel"),),
"encoder.layer.0.attention.output.dense.weight", "linear", n_in=2) maps our (H, K, D) kernel
to torch's (D, H*K) weight.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import ClassVar, Mapping

import numpy as np
from flax import traverse_util

from t5lite.errors import ConfigError, ConfigKeyError
from t5lite.interop import limits
from t5lite.families import family_of
from t5lite.models import shared_stacks
from t5lite.models.config import ModelConfig
from t5lite.models.params import Params, abstract_params, scan_params, unscan_params

Path = tuple[str, ...]
KINDS = ("linear", "conv1d", "vector", "as_is")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One HF tensor and the param(s) of ours it holds.

  kind: 'linear' (torch Linear weight: (out, in)), 'conv1d' (GPT-2's Conv1D: (in, out)),
  'vector' (a bias: our (out...) flattened) or 'as_is' (same shape: embeddings, norm scales).
  n_in: leading axes of our kernel that are inputs (2 for an attention output (H, K, D)).
  index: the HF tensor holds ours[index], one slice of a stacked param (an expert of a
  Mixture-of-Experts kernel (E, D, F)); shapes below are then the slice's.
  """
  ours: tuple[Path, ...]
  hf: str
  kind: str = "as_is"
  n_in: int = 1
  index: int | None = None

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"Entry kind {self.kind!r} is not one of {KINDS}")
    if len(self.ours) > 1 and self.kind == "as_is":
      raise ValueError("several params fuse into one tensor only as kernels or vectors")
    if self.index is not None and len(self.ours) > 1:
      raise ValueError("a slice entry holds one param")

  def _flat(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "vector":
      return (math.prod(shape),)
    return (math.prod(shape[:self.n_in]), math.prod(shape[self.n_in:]))

  def hf_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The HF tensor's shape for our params of these shapes (nothing is built)."""
    if self.kind == "as_is":
      return tuple(shapes[0])
    flats = [self._flat(s) for s in shapes]
    if self.kind == "vector":
      return (sum(f[0] for f in flats),)
    fan_in, out = flats[0][0], sum(f[1] for f in flats)
    return (out, fan_in) if self.kind == "linear" else (fan_in, out)

  def to_hf(self, arrays: list[np.ndarray]) -> np.ndarray:
    if self.index is not None:
      arrays = [np.asarray(a)[self.index] for a in arrays]
    if self.kind == "as_is":
      return np.asarray(arrays[0])
    pieces = [np.asarray(a).reshape(self._flat(a.shape)) for a in arrays]
    joined = np.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]
    return joined.T if self.kind == "linear" else joined

  def from_hf(self, tensor: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    if self.kind == "as_is":
      return [tensor.reshape(shapes[0])]
    joined = tensor.T if self.kind == "linear" else tensor
    cuts = np.cumsum([self._flat(s)[-1] for s in shapes])[:-1]
    return [piece.reshape(s) for piece, s in zip(np.split(joined, cuts, axis=-1), shapes)]


class HFLayout:
  """How one HF model type maps to t5lite; see the module docstring. Subclass, set
  `model_types` (the first is what export writes) and `heads` (when it has finetuning heads),
  and decorate with @register."""

  model_types: ClassVar[tuple[str, ...]] = ()
  size_fields: ClassVar[tuple[str, ...]] = ()
  """config.json keys that must be positive integers (checked before anything is built)."""
  reads_torch_files: ClassVar[bool] = False
  """Whether legacy pytorch_model.bin weights are read (weights_only); else safetensors only."""
  heads: ClassVar[object] = None
  """The model type's finetuning heads (an hf_heads.HeadSpec), or None when it has none."""

  def config_to_hf(self, config: ModelConfig) -> dict:
    raise NotImplementedError

  def config_from_hf(self, hf: Mapping, tensors: Mapping[str, np.ndarray] | None,
                     **overrides) -> ModelConfig:
    raise NotImplementedError

  def weight_map(self, config: ModelConfig) -> list[Entry]:
    raise NotImplementedError

  def checkpoint_tensors(self, tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """The checkpoint's tensors under the names weight_map uses (a layout whose published
    checkpoints use other names renames them here)."""
    return tensors

  def embedding_name(self, config: ModelConfig) -> str:
    """The HF tensor whose dtype is the checkpoint's parameter dtype."""
    return self.weight_map(config)[0].hf

  def check_claim(self, hf: Mapping, where: str, max_params: int | None = None
                  ) -> tuple[int, str]:
    """(parameters config.json implies, what claims them), refused over the import ceiling.
    The count is a lower bound (the big matrices only), so that real checkpoints always hold
    at least that many values."""
    if not isinstance(hf, Mapping):
      raise ConfigError(f"{where}: a JSON {type(hf).__name__}, not an object of settings")
    ceiling = limits.max_import_params(max_params)
    for field in self.size_fields:
      if field in hf and limits.size_field(hf[field], field, where) > ceiling:
        raise ConfigError(f"{where}: {field}={hf[field]:,} is over the import ceiling of "
                          f"{ceiling:,} parameters ({limits.HOW_TO_RAISE})")
    config = self.config_from_hf(hf, None)
    # Every layer is built and traced by name, shared ones at every use: bound their number
    # (a shared layer's claim costs no parameters, and a million would trace for hours).
    depth = (config.num_encoder_layers * config.layer_repeats * config.has_encoder
             + config.num_decoder_layers * config.has_decoder)
    if depth > limits.MAX_LAYERS:
      raise ConfigError(f"{where}: {depth:,} layer applications, over t5lite's limit of "
                        f"{limits.MAX_LAYERS:,}")
    claimed = matrix_params(config)
    named = ", ".join(f"{k}={hf[k]:,}" for k in self.size_fields if k in hf)
    limits.check_ceiling(claimed, f"{where} ({named})", ceiling)
    return claimed, f"{where} ({named})"

  # --- shared helpers for subclasses -------------------------------------------------------

  @staticmethod
  def sizes(hf: Mapping, fields: Mapping[str, str], where: str = "config.json",
            defaults: Mapping[str, int] | None = None) -> dict[str, int]:
    """{our field: value} for {HF key: our field}, each a positive integer (a ConfigError
    names the key otherwise); keys absent from hf take `defaults` or are an error."""
    if not isinstance(hf, Mapping):
      raise ConfigError(f"{where}: a JSON {type(hf).__name__}, not an object of settings")
    defaults = defaults or {}
    out = {}
    for key, field in fields.items():
      if key not in hf and key not in defaults:
        raise ConfigError(f"{where} lacks {key!r}, which a {hf.get('model_type')!r} config "
                          "needs")
      out[field] = limits.size_field(hf.get(key, defaults.get(key)), key, where)
    return out

  @staticmethod
  def number(hf: Mapping, key: str, default: float, *, low: float = 0.0,
             high: float = float("inf"), low_open: bool = True) -> float:
    """config.json's float setting `key` (absent or null: default), a finite JSON number in
    (low, high) (low_open) or [low, high); a ConfigError names it otherwise."""
    value = hf.get(key)
    value = default if value is None else value
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value > low if low_open else value >= low)
          and value < high)
    if not ok:
      bound = "(" if low_open else "["
      raise ConfigError(f"config.json: {key}={hf.get(key)!r} is not a number in "
                        f"{bound}{low}, {high})")
    return float(value)

  @staticmethod
  def rate(hf: Mapping, key: str, default: float) -> float:
    """A dropout probability in [0, 1)."""
    return HFLayout.number(hf, key, default, high=1.0, low_open=False)

  @staticmethod
  def token_ids(hf: Mapping, vocab_size: int, bos_key: str, bos_default: int,
                eos_default: int) -> dict[str, int]:
    """{'bos_id', 'eos_id'} from config.json's `bos_key` and `eos_token_id` (absent or null:
    the defaults; a list of EOS ids, as LLaMA 3's: the first), each an id of the vocabulary."""
    out = {}
    for field, key, default in (("bos_id", bos_key, bos_default),
                                ("eos_id", "eos_token_id", eos_default)):
      value = hf.get(key)
      if isinstance(value, list) and value:
        value = value[0]
      value = default if value is None else value
      if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ConfigError(f"config.json: {key}={hf.get(key)!r} is not a token id below "
                          f"vocab_size={vocab_size}")
      out[field] = value
    return out

  @staticmethod
  def choice(hf: Mapping, key: str, table: Mapping[str, object], default: str) -> object:
    """table[hf[key]] with an error that names the key and the supported values."""
    value = hf.get(key, default)
    if not isinstance(value, str) or value not in table:
      raise ConfigError(f"{key}={value!r} has no t5lite equivalent; supported: {sorted(table)}")
    return table[value]


def legacy_norm_names(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """LayerNorm tensors under their current names: checkpoints of the original BERT release
  (bert-base-uncased's files among them) say `LayerNorm.gamma` / `.beta`, which transformers
  renames to `.weight` / `.bias` when it loads them."""
  out = {}
  for name, value in tensors.items():
    if name.endswith(".gamma"):
      name = name[:-len("gamma")] + "weight"
    elif name.endswith(".beta"):
      name = name[:-len("beta")] + "bias"
    out[name] = value
  return out


def refuse(config: ModelConfig, model_type: str, needed: Mapping[str, object]) -> None:
  """A ConfigError naming every option of config whose value the HF model cannot express
  (needed: {field: the value HF's model has})."""
  bad = {f: getattr(config, f) for f, v in needed.items() if getattr(config, f) != v}
  if bad:
    wants = ", ".join(f"{f}={needed[f]!r}" for f in bad)
    raise ConfigError(f"HF {model_type!r} has no equivalent of "
                      f"{', '.join(f'{f}={v!r}' for f, v in bad.items())} (it needs {wants}); "
                      "this model cannot be exported to that layout")


def matrix_params(config: ModelConfig) -> int:
  """The parameters of a config's big matrices (embedding, attention, MLP): a lower bound of
  its parameter count, computed without building anything (Python ints: no overflow)."""
  d, h, k, kv, f = (config.d_model, config.num_heads, config.d_kv, config.kv_heads,
                    config.d_ff)
  layer = 2 * d * h * k + 2 * d * kv * k + (3 if config.gated_mlp else 2) * d * f
  encoder = config.num_encoder_layers if config.has_encoder else 0
  if config.shared_layer_groups:
    encoder = config.shared_layer_groups * config.layers_per_group
  decoder = config.num_decoder_layers if config.has_decoder else 0
  cross = (2 * d * h * k + 2 * d * kv * k) * decoder * config.has_encoder  # cross-attention
  own = 0 if config.shared_encoder_decoder else decoder  # decoder layers with their own params
  return config.vocab_size * config.embedding_width + (encoder + own) * layer + cross


# --- params <-> tensors ---------------------------------------------------------------------

def params_to_hf(layout: HFLayout, config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """HF state dict (numpy, torch layout) from t5lite params (scanned or not; a shared
  encoder-decoder's as the plain model that computes the same function)."""
  flat = traverse_util.flatten_dict(unscan_params(shared_stacks.expand(params, config)))
  return {e.hf: np.ascontiguousarray(e.to_hf([np.asarray(flat[p]) for p in e.ours]))
          for e in layout.weight_map(config)}


def params_from_hf(layout: HFLayout, config: ModelConfig,
                   tensors: Mapping[str, np.ndarray]) -> Params:
  """t5lite params (scanned iff config.scan_layers) from an HF state dict. Every param of the
  config must come from a tensor of the expected shape; errors name the tensor and both
  shapes. Tensors the layout does not use (buffers, tied copies) are ignored."""
  shapes = traverse_util.flatten_dict(abstract_params(config.replace(scan_layers=False)))
  entries = layout.weight_map(config)
  covered = {p for e in entries for p in e.ours}
  missing = sorted("/".join(p) for p in set(shapes) - covered)
  if missing:  # a layout bug, not bad input: keep the traceback
    raise AssertionError(f"{type(layout).__name__} maps no HF tensor to {missing}")
  flat = {}
  for e in entries:
    if e.hf not in tensors:
      close = difflib.get_close_matches(e.hf, list(tensors), n=1)
      hint = f" (it has {close[0]!r})" if close else ""
      raise ConfigKeyError(f"HF checkpoint lacks tensor {e.hf!r} needed for "
                           f"{' + '.join('/'.join(p) for p in e.ours)}{hint}")
    w = np.asarray(tensors[e.hf])
    if str(w.dtype) not in FLOAT_DTYPES:  # buffers the layout does not read may be ints/bools
      raise ConfigError(f"HF tensor {e.hf!r} is {w.dtype}; model weights are floating point")
    want = [tuple(shapes[p].shape)[e.index is not None:] for p in e.ours]
    if w.shape != e.hf_shape(want):
      raise ConfigError(f"HF tensor {e.hf!r} has shape {w.shape}, expected {e.hf_shape(want)} "
                        f"for {' + '.join('/'.join(p) for p in e.ours)} of this config")
    for path, array in zip(e.ours, e.from_hf(w, want)):
      # One dtype for the whole tree (HF may keep `wo` in float32 inside a half checkpoint).
      array = array.astype(config.storage_dtype, copy=False)
      if e.index is None:
        flat[path] = array
      else:  # one slice of a stacked param: the entries of the others fill the rest
        flat.setdefault(path, np.zeros(shapes[path].shape, config.storage_dtype))[e.index] = array
  params = traverse_util.unflatten_dict(flat)
  return scan_params(params, config) if config.scan_layers else params


# --- registry -------------------------------------------------------------------------------

_LAYOUTS: dict[str, HFLayout] = {}


def register(cls: type[HFLayout]) -> type[HFLayout]:
  """Class decorator: the layout of each of cls.model_types."""
  for model_type in cls.model_types:
    _LAYOUTS[model_type] = cls()
  return cls


def supported() -> list[str]:
  return sorted(_LAYOUTS)


def for_model_type(model_type: object, where: str = "config.json") -> HFLayout:
  """The layout of an HF model_type; an unknown one names the supported ones."""
  if not isinstance(model_type, str) or model_type not in _LAYOUTS:
    raise ConfigError(f"{where}: model_type={model_type!r} is not supported; t5lite reads "
                      f"{', '.join(supported())}")
  return _LAYOUTS[model_type]


def for_config(config: ModelConfig) -> HFLayout:
  """The layout a config exports to: its family's hf_model_type."""
  family = family_of(config)
  if family.hf_model_type not in _LAYOUTS:
    raise ConfigError(f"a {family.name!r} model has no HF layout (its family maps to "
                      f"{family.hf_model_type or 'none'}); it cannot be exported to HF. "
                      f"Families with one: those of {', '.join(supported())}")
  return _LAYOUTS[family.hf_model_type]
