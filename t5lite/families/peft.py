"""Parameter-efficient finetuning: a frozen base model, and small adapters that train.

    TrainConfig.peft = @PeftConfig()
    PeftConfig.base = '/runs/t5_small'         # a t5lite MODEL_DIR or an HF directory
    PeftConfig.adapter = @AdapterConfig()
    AdapterConfig.r = 8
    AdapterConfig.lora_alpha = 16
    AdapterConfig.target_modules = ('query', 'value')

The run's model is its MODEL_CONFIG with `adapter` set (t5lite.models.adapters: LoRA branches
on the targeted kernels). The base's params are loaded by the PEFT recipe
(t5lite.train.recipes.peft), optionally in bfloat16, and the trainer passes them to every step
beside the train state (loss_fn's fixed_params), as a distillation teacher is: no gradient, no
optimizer state, never donated or checkpointed, so they are bitwise the same after training.
The train state holds the adapters alone: the optimizer keeps state for them only, and
checkpoints hold them only (t5lite.interop.peft.record: RUN_DIR/peft.json names the base and
its fingerprint; eval, infer and export join the two).

Params the adapted model has and the base lacks (a new finetuning head on a pretrained
encoder) train whole beside the adapters and are stored with them (peft's modules_to_save);
PeftConfig.modules_to_save adds more (path prefixes such as 'encoder/encoder_norm').
The base's params the model does not read (an MLM head under a classifier) are left out.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from t5lite.errors import ConfigError
from t5lite.families.base import Family
from t5lite.models import adapters
from t5lite.models.adapters import AdapterConfig
from t5lite.models.config import ModelConfig

Tree = Any
# Fields a PEFT run may set otherwise than its base: they change computation, not the
# weights the adapters were fitted to (a finetuning head is new params, see the docstring).
FREE_FIELDS = frozenset({"dropout_rate", "classifier_dropout", "dtype", "param_dtype",
                         "remat_policy", "adapter", "head", "num_labels", "problem_type",
                         "classifier_activation", "sentence_classes"})


@dataclasses.dataclass(frozen=True)
class PeftConfig:
  """A PEFT run's base and adapter (module docstring); gin binds it as
  TrainConfig.peft = @PeftConfig()."""

  base: str = ""
  """The frozen base: a t5lite MODEL_DIR (its newest checkpoint) or an HF model directory."""
  base_dtype: str = ""
  """'bfloat16' stores and runs the base in bf16 (half its memory; the adapters stay float32);
  '' keeps the base's own dtype."""
  adapter: AdapterConfig = AdapterConfig()
  """The adapter's method, rank, scale and target modules."""
  modules_to_save: tuple[str, ...] = ()
  """More param path prefixes ('encoder/encoder_norm') that train whole with the adapter."""

  def __post_init__(self):
    object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
    if not self.base:
      raise ConfigError("PeftConfig.base is not set: name the base model's MODEL_DIR or HF "
                        "directory (with gin/runs/lora.gin: --gin.BASE=\"'DIR'\")")
    if self.base_dtype not in ("", "float32", "bfloat16"):
      raise ConfigError(f"PeftConfig.base_dtype={self.base_dtype!r} is not one of '', "
                        "'float32', 'bfloat16'")
    if not isinstance(self.adapter, AdapterConfig):
      raise ConfigError("PeftConfig.adapter must be an AdapterConfig (gin: "
                        "PeftConfig.adapter = @AdapterConfig())")


def adapted_config(run: ModelConfig, base: ModelConfig, options: PeftConfig) -> ModelConfig:
  """The run's model config with the adapter; refused when the run's model is not the base's
  (other than in FREE_FIELDS), since the base's weights would be read as another model."""
  a, b = base.to_dict(), run.to_dict()
  differ = sorted(k for k in a if a[k] != b.get(k) and k not in FREE_FIELDS)
  if differ:
    changes = ", ".join(f"{k}: base {a[k]!r}, run {b.get(k)!r}" for k in differ)
    raise ConfigError(f"the PEFT base {options.base} is another model than the run's "
                      f"MODEL_CONFIG ({changes}): use the model gin file the base was trained "
                      "with")
  return run.replace(adapter=options.adapter)


def saved_modules(full: Tree, base: Tree, options: PeftConfig) -> tuple[tuple[str, ...], ...]:
  """The param path prefixes that train whole: what the adapted model has and the base lacks
  (a new head: its top-level module), plus PeftConfig.modules_to_save."""
  have = traverse_util.flatten_dict(base)
  prefixes = {tuple(p.split("/")) for p in options.modules_to_save}
  for path in traverse_util.flatten_dict(full):
    if not adapters.is_adapter_path(path) and path not in have:
      prefixes.add(_new_module(path, have))
  return tuple(sorted(prefixes))


def _new_module(path: tuple[str, ...], have) -> tuple[str, ...]:
  """The shortest prefix of `path` that the base has nothing under (the new module)."""
  for n in range(1, len(path) + 1):
    if not any(k[:n] == path[:n] for k in have):
      return path[:n]
  return path


def check_targets(config: ModelConfig, abstract: Tree) -> None:
  """A target pattern that matches no kernel, or a rank past a kernel's smaller side, is
  refused with the names and numbers."""
  adapter = config.adapter
  if adapter.method != "lora":
    return
  flat = traverse_util.flatten_dict(abstract)
  kernels = sorted("/".join(k[:-1]) for k in flat if k[-1] == "kernel")
  lora = [k[:-1] for k in flat if k[-1] == adapters.LORA_A]
  for pattern in adapter.target_modules:
    if not any(AdapterConfig(target_modules=(pattern,)).targets(module) for module in lora):
      raise ConfigError(f"AdapterConfig.target_modules pattern {pattern!r} matches no kernel "
                        f"of this model; its kernels are e.g. {', '.join(kernels[:8])}")
  for module in sorted(lora):
    a, b = flat[module + (adapters.LORA_A,)].shape, flat[module + (adapters.LORA_B,)].shape
    stacked = config.scan_layers and "layers" in module  # a leading layer axis on both
    fan_in = math.prod(a[int(stacked):-1])
    fan_out = math.prod(b[int(stacked) + 1:])
    if adapter.r > min(fan_in, fan_out):
      raise ConfigError(f"AdapterConfig.r={adapter.r} is larger than {'/'.join(module)}'s "
                        f"smaller side ({fan_in} x {fan_out}): choose r <= "
                        f"{min(fan_in, fan_out)}")


@dataclasses.dataclass(frozen=True)
class Peft(Family):
  """The adapted model's family, training its adapter half; see the module docstring.

  loss_fn takes the adapter half as `params` and the base as `fixed_params`; the network
  methods (logits, generate, score, networks) take whole trees (adapters.combine)."""

  inner: Family | None = None
  options: PeftConfig | None = None
  saved: tuple[tuple[str, ...], ...] = ()
  name: ClassVar[str] = "peft"

  @classmethod
  def wrap(cls, inner: Family, options: PeftConfig,
           saved: tuple[tuple[str, ...], ...] = ()) -> "Peft":
    if inner.config.adapter is None:
      raise ValueError("Peft.wrap needs a family whose config has an adapter "
                       "(t5lite.families.peft.adapted_config)")
    check_targets(inner.config, inner.abstract_params())
    return cls(inner.config, inner.loss, inner=inner, options=options, saved=tuple(saved))

  target_features = property(lambda self: self.inner.target_features)
  token_features = property(lambda self: self.inner.token_features)
  decodes = property(lambda self: self.inner.decodes)
  continues_prompts = property(lambda self: self.inner.continues_prompts)
  hf_model_type = property(lambda self: self.inner.hf_model_type)

  def converter(self, pack=True):
    # A soft prompt before a bidirectional encoder sees every token of its row: the examples
    # of a packed row would see each other through it, so those rows are padded instead.
    # (A decoder's prompt is causal, and prefixes are constants: both pack exactly.)
    prompted_encoder = self.config.has_encoder and adapters.prompt_tokens(self.config)
    return self.inner.converter(pack and not prompted_encoder)

  def pretraining_preprocessors(self, vocabulary):
    return self.inner.pretraining_preprocessors(vocabulary)

  def make_model(self, **kwargs):
    return self.inner.make_model(**kwargs)

  def dummy_inputs(self):
    return self.inner.dummy_inputs()

  def model_inputs(self, batch):
    return self.inner.model_inputs(batch)

  def _boxed_params(self, rng):
    # Under jit only the adapter half is an output: the base's initializers are dead code.
    half = adapters.split(self.inner._boxed_params(rng), self.saved)[1]
    if not adapters.projects_prefixes(self.config):
      return half
    # Li and Liang: the MLP trains, the prefixes are what it gives (whole()).
    flat = traverse_util.flatten_dict(half)
    half = traverse_util.unflatten_dict({k: v for k, v in flat.items()
                                         if k[-1] not in (adapters.PREFIX_KEY,
                                                          adapters.PREFIX_VALUE)})
    encoder = adapters.init_prefix_encoder(self.config, self.inner.abstract_params(),
                                           jax.random.fold_in(rng, 1))
    return {**half, adapters.PREFIX_ENCODER: encoder}

  def split(self, params: Tree) -> tuple[Tree, Tree]:
    """(base, adapter) halves of a whole params tree."""
    return adapters.split(params, self.saved)

  def whole(self, base: Tree, adapter: Tree) -> Tree:
    """The adapted model's params: the halves joined, a prefix MLP turned into its prefixes."""
    whole = adapters.combine(base, adapter)
    if adapters.PREFIX_ENCODER not in whole:
      return whole
    return adapters.materialize(self.config, whole, self.inner.abstract_params())

  def with_initial_prompt(self, adapter: Tree, base: Tree, ids: tuple[int, ...]) -> Tree:
    """A fresh adapter half whose soft prompt starts as the base's embeddings of `ids`
    (prompt_init_ids); unchanged for no ids."""
    if not ids:
      return adapter
    stack = "encoder" if self.config.has_encoder else "decoder"
    table = base["token_embedder"]["embedding"]  # (V, E)
    rows = table[jnp.asarray(ids)].astype(jnp.float32)  # (n, E)
    return {**adapter, stack: {**adapter[stack], adapters.PROMPT: rows}}

  def networks(self, params):
    return self.inner.networks(params)

  def logits(self, params, batch, rng=None):
    return self.inner.logits(params, batch, rng)  # whole params, as whole() gives them

  def generate(self, params, inputs, **settings):
    return self.inner.generate(params, inputs, **settings)

  def score(self, params, inputs, targets):
    return self.inner.score(params, inputs, targets)

  def loss_fn(self, params, batch, rng, fixed_params=None):
    if fixed_params is None:
      raise ValueError("a PEFT loss needs the base's params (fixed_params): the trainer "
                       "passes them; so must a caller of loss_fn")
    return self.inner.loss_fn(self.whole(fixed_params, params), batch, rng)

  def metrics(self, sums, normalizer):
    return self.inner.metrics(sums, normalizer)

  def tokens_per_example(self, lengths):
    return self.inner.tokens_per_example(lengths)

  def flops_per_example(self, lengths):
    """The base's forward and its activations' backward: 2/3 of full training (no weight
    gradients for frozen kernels; the adapters' own are a rounding error)."""
    return self.inner.flops_per_example(lengths) * 2 / 3


def prompt_init_ids(adapter: AdapterConfig, vocabulary, vocab_size: int, seed: int
                    ) -> tuple[int, ...]:
  """The token ids whose embeddings start a soft prompt: n drawn uniformly from the
  vocabulary ('sample_vocab'), or the text's tokens repeated to n ('text', as peft's TEXT
  init); () for 'random' (normal(0, 1), the params' own init) and other methods."""
  n = adapter.num_virtual_tokens
  if adapter.method != "prompt_tuning" or adapter.prompt_init == "random":
    return ()
  if adapter.prompt_init == "sample_vocab":
    return tuple(int(i) for i in np.random.RandomState(seed).randint(0, vocab_size, n))
  if vocabulary is None:
    raise ConfigError("AdapterConfig.prompt_init='text' needs the base's vocabulary, and the "
                      "base has none saved: use prompt_init='sample_vocab'")
  ids = list(vocabulary.encode(adapter.prompt_init_text))
  if not ids:
    raise ConfigError(f"AdapterConfig.prompt_init_text={adapter.prompt_init_text!r} has no "
                      "tokens")
  return tuple((ids * (n // len(ids) + 1))[:n])


def trainable_leaves(params: Tree) -> int:
  """Scalars in a params tree (what a PEFT run trains)."""
  return int(sum(x.size for x in jax.tree.leaves(params)))
