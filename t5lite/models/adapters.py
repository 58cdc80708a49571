"""Parameter-efficient adapters inside the network: LoRA, prompt tuning and prefix tuning.

    ModelConfig.adapter = AdapterConfig(method="lora", r=8, lora_alpha=16,
                                        target_modules=("query", "value"))

LoRA. A targeted Dense computes `W x + s * B(A(dropout(x)))` with `s = lora_alpha / r`
(rsLoRA: `lora_alpha / sqrt(r)`), as the peft library does. Its params sit beside the kernel:

    .../attention/query/kernel   (D, H, K)   the frozen base weight
    .../attention/query/lora_a   (D, r)      uniform(+-1/sqrt(fan_in)): peft's kaiming_uniform(a=sqrt(5))
    .../attention/query/lora_b   (r, H, K)   zeros, so an untrained adapter is the base model

A and B are stored in float32 whatever the base's param_dtype (a bf16 base trains fp32
adapters), carry the kernel's logical axes on their input and output sides (the rank axis is
replicated), and stack on the layer axis under nn.scan like any param.

Which kernels: `target_modules` holds patterns over Dense paths ('encoder/layers_0/attention/
query'); a pattern matches a path that ends with it at a '/' boundary, with fnmatch wildcards
('query' matches every query projection, 'self_attention/query' only the decoder's self-
attention, 'layers_[01]/*/query' two layers). 'all-linear' takes every Dense of the layers
(attention q/k/v/out and the MLP), as peft's does: not the output or finetuning heads.

Prompt tuning (Lester et al.): `<input stack>/prompt_embeddings` (n, E), n soft tokens before
the encoder's input (T5, BERT) or a decoder-only model's; positions 0..n-1, the tokens after
them (t5lite.models.transformer). Prefix tuning (Li and Liang): `.../attention/prefix_key`
and `prefix_value` (n, kv heads, K) before every attention's own keys and values, seen by
every query, the tokens' positions after them; with prefix_projection an MLP
(PrefixEncoder) gives them all, and `materialize` replaces it by what it gives.

Any adapter param may carry a leading row axis when applied: one adapter per batch row
(mixed-adapter batches; see rows_of and adapter_param). Training only the adapters (the
base frozen and left out of checkpoints), peft interchange and merging are the PEFT recipe's
(t5lite.families.peft, t5lite.interop.peft.adapters).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from t5lite.errors import ConfigError

Tree = Any

METHODS = ("lora", "prompt_tuning", "prefix_tuning")
PROMPT_INITS = ("sample_vocab", "text", "random")
ALL_LINEAR = "all-linear"
LAYER_MODULES = ("query", "key", "value", "out", "wi", "wi_0", "wi_1", "wo")
"""The Dense names of attention and MLP blocks: what 'all-linear' takes."""
LORA_A, LORA_B = "lora_a", "lora_b"
PROMPT = "prompt_embeddings"
PREFIX_KEY, PREFIX_VALUE = "prefix_key", "prefix_value"
ADAPTER_LEAVES = (LORA_A, LORA_B, PROMPT, PREFIX_KEY, PREFIX_VALUE)
"""Param names that belong to an adapter, not to the base model."""


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
  """An adapter's kind, shape and scaling (module docstring); peft's config names."""

  method: str = "lora"
  """'lora' (a low-rank update of chosen kernels), 'prompt_tuning' (soft tokens before the
  input) or 'prefix_tuning' (trained keys and values before every attention's own)."""
  r: int = 8
  """LoRA's rank."""
  lora_alpha: float = 8.0
  """LoRA's scale numerator: the update is scaled by lora_alpha / r (or / sqrt(r))."""
  lora_dropout: float = 0.0
  """Dropout on the LoRA branch's input (training only)."""
  use_rslora: bool = False
  """rsLoRA: scale by lora_alpha / sqrt(r), which keeps high ranks learning."""
  target_modules: tuple[str, ...] = ("query", "value")
  """LoRA: patterns over Dense paths (module docstring), or ('all-linear',)."""
  num_virtual_tokens: int = 20
  """Prompt and prefix tuning: soft tokens (prompt) or key/value slots (prefix)."""
  prefix_projection: bool = False
  """Prefix tuning: train the prefixes through an MLP over a small embedding (Li and Liang's
  reparameterization, peft's prefix_projection); the prefixes it gives are what is stored."""
  encoder_hidden_size: int = 0
  """The prefix MLP's hidden width (0: d_model)."""
  prompt_init: str = "sample_vocab"
  """Prompt tuning's initial soft tokens: 'sample_vocab' (the base's embeddings of token ids
  drawn uniformly from the vocabulary, Lester et al.'s best), 'text' (the embeddings of
  prompt_init_text's tokens, repeated to num_virtual_tokens, peft's TEXT) or 'random'
  (normal(0, 1), peft's RANDOM)."""
  prompt_init_text: str = ""
  """The text whose token embeddings start the prompt when prompt_init='text'."""

  def __post_init__(self):
    object.__setattr__(self, "target_modules", tuple(self.target_modules))
    if self.method not in METHODS:
      raise ConfigError(f"AdapterConfig.method={self.method!r} is not one of {METHODS}")
    if self.method == "lora":
      self._check_lora()
    elif self.num_virtual_tokens < 1:
      raise ConfigError(f"AdapterConfig.num_virtual_tokens must be >= 1 for {self.method}, got "
                        f"{self.num_virtual_tokens}")
    if self.prompt_init not in PROMPT_INITS:
      raise ConfigError(f"AdapterConfig.prompt_init={self.prompt_init!r} is not one of "
                        f"{PROMPT_INITS}")
    if self.prompt_init == "text" and self.method == "prompt_tuning" and not (
        self.prompt_init_text):
      raise ConfigError("AdapterConfig.prompt_init='text' needs prompt_init_text (e.g. "
                        "'Summarize the following article:')")
    if self.encoder_hidden_size < 0:
      raise ConfigError("AdapterConfig.encoder_hidden_size must be >= 0 (0: d_model), got "
                        f"{self.encoder_hidden_size}")

  def _check_lora(self):
    if self.r < 1:
      raise ConfigError(f"AdapterConfig.r (LoRA's rank) must be >= 1, got {self.r}")
    if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
      raise ConfigError(f"AdapterConfig.lora_alpha must be > 0, got {self.lora_alpha}")
    if not 0.0 <= self.lora_dropout < 1.0:
      raise ConfigError(f"AdapterConfig.lora_dropout must be in [0, 1), got {self.lora_dropout}")
    if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
      raise ConfigError("AdapterConfig.target_modules needs at least one module pattern, e.g. "
                        f"('query', 'value') or ('{ALL_LINEAR}',); got {self.target_modules!r}")

  @property
  def scale(self) -> float:
    """What B A x is multiplied by."""
    return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

  @property
  def virtual_tokens(self) -> int:
    """Positions the adapter puts before a stack's tokens (prompt or prefix); 0 for LoRA."""
    return 0 if self.method == "lora" else self.num_virtual_tokens

  def targets(self, path: tuple[str, ...]) -> bool:
    """Whether the Dense at `path` (module names from the model's root) gets a LoRA branch."""
    if self.method != "lora":
      return False
    joined = "/".join(path)
    for pattern in self.target_modules:
      if pattern == ALL_LINEAR:
        if path and path[-1] in LAYER_MODULES:
          return True
      elif fnmatch.fnmatchcase(joined, pattern) or fnmatch.fnmatchcase(joined, "*/" + pattern):
        return True
    return False

  def summary(self) -> dict:
    """The fields that describe this adapter's method, for a CLI's JSON line."""
    if self.method == "lora":
      return {"method": self.method, "r": self.r, "lora_alpha": self.lora_alpha,
              "use_rslora": self.use_rslora, "target_modules": list(self.target_modules)}
    return {"method": self.method, "num_virtual_tokens": self.num_virtual_tokens}

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, values: dict) -> "AdapterConfig":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ConfigError(f"unknown AdapterConfig fields {unknown}; known fields: {sorted(known)}")
    return cls(**values)


def virtual_tokens(config) -> int:
  """Positions a model config's adapter puts before each stack's tokens (0 without one)."""
  return config.adapter.virtual_tokens if config.adapter is not None else 0


def prompt_tokens(config, input_stack: bool = True) -> int:
  """Soft prompt positions before a stack's tokens: the input stack's (the encoder, or a
  decoder-only model's decoder) under prompt tuning, else 0."""
  adapter = config.adapter
  if adapter is None or adapter.method != "prompt_tuning" or not input_stack:
    return 0
  return adapter.num_virtual_tokens


def prefix_slots(config) -> int:
  """Trained key/value slots before every attention's own (prefix tuning), else 0."""
  adapter = config.adapter
  return adapter.num_virtual_tokens if adapter is not None and adapter.method == (
      "prefix_tuning") else 0


def position_shift(config, input_stack: bool = True) -> int:
  """How far a stack's token positions move: past its soft prompt or its prefix (HF and peft
  number a prompt's or a past's positions first, so learned and rotary positions shift)."""
  return prompt_tokens(config, input_stack) or prefix_slots(config)


def prompted_segments(segment_ids: jax.Array, length: int) -> jax.Array:
  """Encoder segment ids (B, S) for encoder states of `length` = n + S under prompt tuning:
  the soft prompt's n states take the row's first segment (cross-attention sees them, as
  peft's prepended attention mask ones); unchanged otherwise."""
  n = length - segment_ids.shape[1]
  if n <= 0:
    return segment_ids
  return jnp.concatenate([jnp.repeat(segment_ids[:, :1], n, axis=1), segment_ids], axis=1)


def rows_of(param: jax.Array, rows: int, unbatched_ndim: int) -> jax.Array:
  """An adapter param broadcast to `rows` rows: one adapter for all, or one per row (a leading
  axis) repeated for the `rows // per-row` consecutive copies of each (beam search)."""
  if param.ndim == unbatched_ndim:
    return jnp.broadcast_to(param, (rows,) + param.shape)
  return jnp.repeat(param, rows // param.shape[0], axis=0)


def adapter_param(module, name: str, init, shape: tuple[int, ...]):
  """An adapter's float32 param, created at init; when applied it may carry a leading batch
  axis (one adapter per row: t5lite.peft's mixed batches), which self.param's shape check
  would refuse, so it is read as it is given."""
  if module.is_initializing() or not module.has_variable("params", name):
    return module.param(name, init, shape, jnp.float32)
  return module.get_variable("params", name)


def is_adapter_path(path: tuple[str, ...]) -> bool:
  """Whether a param path (keys from the params root) is an adapter's."""
  return bool(path) and path[-1] in ADAPTER_LEAVES


def split(params: Tree, also: tuple[tuple[str, ...], ...] = ()) -> tuple[Tree, Tree]:
  """(base, adapter) halves of a params tree: the adapter's leaves, and whole subtrees under
  the path prefixes `also` (peft's modules_to_save: a finetuning head), go to the adapter."""
  flat = traverse_util.flatten_dict(params)
  mine = lambda path: is_adapter_path(path) or any(  # noqa: E731
      path[:len(prefix)] == prefix for prefix in also)
  return (traverse_util.unflatten_dict({k: v for k, v in flat.items() if not mine(k)}),
          traverse_util.unflatten_dict({k: v for k, v in flat.items() if mine(k)}))


def combine(base: Tree, adapter: Tree) -> Tree:
  """The whole params tree of split's halves."""
  return traverse_util.unflatten_dict({**traverse_util.flatten_dict(base),
                                       **traverse_util.flatten_dict(adapter)})


# --- prefix tuning through Li and Liang's MLP ------------------------------------------------

PREFIX_ENCODER = "prefix_encoder"
"""The params subtree of prefix tuning's reparameterization (AdapterConfig.prefix_projection)."""


def projects_prefixes(config) -> bool:
  adapter = config.adapter
  return bool(adapter and adapter.method == "prefix_tuning" and adapter.prefix_projection)


class PrefixEncoder(nn.Module):
  """Li and Liang's reparameterization of prefix tuning (peft's prefix_projection): n trained
  embeddings (n, D) through Linear + tanh + Linear give every attention's prefixes at once,
  (n, sites * 2 * kv heads * K). Training the MLP rather than the prefixes is steadier; after
  training only what it gives is needed (`materialize`)."""
  config: Any
  sites: int

  @nn.compact
  def __call__(self) -> jax.Array:
    cfg, adapter = self.config, self.config.adapter
    hidden = adapter.encoder_hidden_size or cfg.d_model
    embedding = self.param("embedding", nn.with_logical_partitioning(
        nn.initializers.normal(1.0), (None, None)), (adapter.num_virtual_tokens, cfg.d_model),
        jnp.float32)
    dense = lambda width, name: nn.Dense(  # noqa: E731
        width, dtype=jnp.float32, param_dtype=jnp.float32, name=name,
        kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None, None)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)))
    width = self.sites * 2 * cfg.kv_heads * cfg.d_kv
    return dense(width, "out")(jnp.tanh(dense(hidden, "hidden")(embedding)))


def prefix_sites(abstract: Tree) -> list[tuple[tuple[str, ...], int]]:
  """(attention path, layers it stacks: 1, or L under nn.scan) of every attention with
  prefixes in a model's (abstract) params, in stack and layer order."""
  def order(path):
    return tuple(int(p[7:]) if p.startswith("layers_") and p[7:].isdigit() else p for p in path)
  flat = traverse_util.flatten_dict(abstract)
  sites = sorted((k[:-1] for k in flat if k[-1] == PREFIX_KEY), key=lambda p: str(order(p)))
  return [(p, flat[p + (PREFIX_KEY,)].shape[0] if len(flat[p + (PREFIX_KEY,)].shape) == 4 else 1)
          for p in sites]


def init_prefix_encoder(config, abstract: Tree, rng: jax.Array) -> Tree:
  """Boxed params of the prefix MLP for a model whose full params are `abstract`."""
  sites = sum(count for _, count in prefix_sites(abstract))
  return PrefixEncoder(config, sites).init(rng)["params"]


def materialize(config, params: Tree, abstract: Tree) -> Tree:
  """params with the prefix MLP (PREFIX_ENCODER) replaced by the prefixes it gives, each at
  its attention; unchanged without one. abstract: the full model's params (where the
  prefixes go)."""
  if PREFIX_ENCODER not in params:
    return params
  sites = prefix_sites(abstract)
  rest = {k: v for k, v in params.items() if k != PREFIX_ENCODER}
  total = sum(count for _, count in sites)
  n, kvh, k = config.adapter.num_virtual_tokens, config.kv_heads, config.d_kv
  out = PrefixEncoder(config, total).apply({"params": params[PREFIX_ENCODER]})
  out = out.reshape(n, total, 2, kvh, k)
  flat, start = traverse_util.flatten_dict(rest), 0
  for path, count in sites:
    chunk = out[:, start:start + count]  # (n, count, 2, kvh, K)
    start += count
    for j, name in enumerate((PREFIX_KEY, PREFIX_VALUE)):
      prefixes = jnp.moveaxis(chunk[:, :, j], 1, 0)  # (count, n, kvh, K)
      flat[path + (name,)] = prefixes if len(abstract_shape(abstract, path)) == 4 else prefixes[0]
  return traverse_util.unflatten_dict(flat)


def abstract_shape(abstract: Tree, path: tuple[str, ...]) -> tuple[int, ...]:
  node = abstract
  for key in path + (PREFIX_KEY,):
    node = node[key]
  return tuple(node.shape)
