"""Many adapters, one base: a batch whose rows use different adapters, in one program.

    bank = adapter_batch.load_bank(BASE, {"sum": "/runs/lora_sum", "qa": "/runs/lora_qa"})
    ids = bank.row_ids(["sum", "qa", None, "sum"])      # None: the base alone
    tokens = t5lite.generate(bank.config, bank.params_for(ids), inputs, max_decode_length=64)

The base is loaded once (a t5lite MODEL_DIR or an HF directory, as PeftConfig.base names it);
each adapter is a PEFT run's RUN_DIR (t5lite.interop.peft.record), whose peft.json must name
this base by fingerprint. The bank stacks the adapters' leaves on an adapter axis, index 0
being the base alone (zeros: LoRA's branch then adds exactly 0), and `params_for(ids)` gathers
one adapter per row: every adapter leaf gets a leading row axis, which the model reads as one
adapter per row of its input, or per `copies` consecutive rows (beam search's beams):
Dense._lora (t5lite.models.layers) and adapters.rows_of (soft prompts, prefixes). With
scan_layers the layer stack keeps its leading layer axis and the row axis comes second, so
that decoding's layer slicing (decoding.layer_params) leaves (rows, ...) per layer.

Mixable adapters: runs of one base and one model, of one method, whose params have the same
paths and shapes: LoRA with the same rank and target modules (lora_alpha and rsLoRA may
differ: each adapter's scale over the first's is folded into its B), prompt or prefix tuning
(no prefix MLP) with the same num_virtual_tokens; without saved modules (a whole head per row
is not supported). A row of the base alone is LoRA's only: a zero soft prompt or prefix is
not no prompt. Anything else is refused by name.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from t5lite.errors import ConfigError
from t5lite.models import adapters
from t5lite.models.config import ModelConfig
from t5lite.runtime import model_dir
from t5lite.interop.peft import record as peft_record

Tree = Any
BASE = "base"
"""The name of the base alone (no adapter) in a bank and in a row's adapter field."""
MIXABLE = ("lora", "prompt_tuning", "prefix_tuning")
"""Adapter methods whose runs a bank mixes (one method per bank)."""
# Model config fields that adapters of one base may set differently: they change computation,
# not the weights (model_dir.RUNTIME_FIELDS), and the adapter itself, checked on its own.
_FREE = model_dir.RUNTIME_FIELDS | {"adapter"}
_STACKS = ("encoder", "decoder")


@dataclasses.dataclass(frozen=True)
class AdapterRun:
  """A PEFT run's RUN_DIR as a bank reads it: `name` (what rows call it), its absolute `path`,
  its adapted model config and its peft.json record."""
  name: str
  path: str
  config: ModelConfig
  record: dict


def read_run(name: str, path: str | os.PathLike) -> AdapterRun:
  """The run at `path`, refused unless it is a PEFT run's RUN_DIR."""
  if not name or name == BASE or "," in name or "=" in name:
    raise ConfigError(f"adapter name {name!r}: use a plain word other than {BASE!r} (which "
                      "means the base alone)")
  home = model_dir.model_dir_of(path)
  record = peft_record.read(home)
  if record is None:
    raise ConfigError(f"adapter {name}={path} is not a PEFT run (no {peft_record.RECORD_FILE} "
                      "there): name the RUN_DIR of a run trained with TrainConfig.peft, or one "
                      "made by `t5lite import peft`")
  return AdapterRun(name, os.path.abspath(os.fspath(path)), model_dir.load_model_config(home),
                    record)


def check_mixable(runs: Sequence[AdapterRun]) -> ModelConfig:
  """The model config a batch mixing `runs` decodes with (the first run's); refuses runs that
  do not share one base, one model, one method, rank and target modules, by name."""
  if not runs:
    raise ConfigError("no adapters given: name at least one RUN_DIR")
  first = runs[0]
  names = [r.name for r in runs]
  if len(set(names)) != len(names):
    raise ConfigError(f"adapter names {names} repeat: give each RUN_DIR its own name")
  for run in runs:
    adapter = run.config.adapter
    if adapter is None or adapter.method not in MIXABLE:
      method = None if adapter is None else adapter.method
      raise ConfigError(f"adapter {run.name} ({run.path}) is a {method} run: a batch mixes "
                        f"only {', '.join(MIXABLE)} adapters")
    if adapter.method == "prefix_tuning" and adapter.prefix_projection:
      raise ConfigError(f"adapter {run.name} ({run.path}) trains its prefixes through an MLP "
                        "(prefix_projection): a batch mixes stored prefixes only")
    if run.record.get("base_fingerprint") != first.record.get("base_fingerprint"):
      raise ConfigError(
          f"adapters {first.name} and {run.name} adapt different bases: {first.name}'s is "
          f"{first.record.get('base')} (fingerprint {first.record['base_fingerprint'][:16]}...), "
          f"{run.name}'s {run.record.get('base')} (fingerprint "
          f"{run.record['base_fingerprint'][:16]}...): mix only adapters trained on one base")
    a, b = first.config.to_dict(), run.config.to_dict()
    differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in _FREE)
    if differ:
      raise ConfigError(f"adapters {first.name} and {run.name} adapt different models ("
                        + ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in differ)
                        + "): mix only adapters of one base model")
    mine, theirs = first.config.adapter, adapter
    fields = ((("method", "methods"),) + ((("r", "rank r"), ("target_modules", "target_modules"))
               if mine.method == "lora" == theirs.method else
               (("num_virtual_tokens", "num_virtual_tokens"),)))
    for field, what in fields:
      if getattr(mine, field) != getattr(theirs, field):
        raise ConfigError(
            f"adapters {first.name} and {run.name} have different {what} "
            f"({getattr(mine, field)!r} vs {getattr(theirs, field)!r}): a mixed batch stacks "
            "their params, so every adapter needs the same method and shapes (LoRA: r and "
            "target_modules; prompt and prefix tuning: num_virtual_tokens); decode them in "
            "separate batches (one --adapter each)")
    if run.record.get("saved_modules") and len(runs) > 1:
      raise ConfigError(
          f"adapter {run.name} ({run.path}) also trained whole modules "
          f"({', '.join(run.record['saved_modules'])}): a mixed batch holds one copy of the "
          "base's modules; decode it alone (--adapter)")
  return first.config.replace(adapter=dataclasses.replace(first.config.adapter,
                                                          lora_dropout=0.0))


def row_axis(path: tuple[str, ...], config: ModelConfig) -> int:
  """Where a param's per-row (or per-adapter) axis goes: after the layer axis of a scanned
  stack (encoder/layers/..., decoder/layers/...), else first."""
  scanned = config.scan_layers and len(path) > 2 and path[0] in _STACKS and path[1] == "layers"
  return 1 if scanned else 0


@dataclasses.dataclass(frozen=True)
class AdapterBank:
  """One base and several adapters of it (module docstring).

  config: the adapted model config every row decodes with; names: index -> adapter name
  (0 is BASE); base: the base half of the params (with a lone adapter's saved modules);
  stacked: the adapters' own leaves (adapters.ADAPTER_LEAVES), each with an adapter axis
  (len(names)) at row_axis; singles: name -> that adapter's half, as its run stores it;
  steps, paths, configs: name -> its checkpoint step, RUN_DIR and model config."""
  config: ModelConfig
  names: tuple[str, ...]
  base: Tree
  stacked: Tree
  singles: Mapping[str, Tree]
  steps: Mapping[str, int]
  paths: Mapping[str, str]
  configs: Mapping[str, ModelConfig]
  saved: tuple[str, ...] = ()
  """A lone adapter's saved modules (path prefixes joined with '/'), held in `base`."""

  def index(self, name: str | None) -> int:
    """The bank index of an adapter name (None or BASE: 0, the base alone: LoRA only)."""
    if name is None or name == BASE:
      if self.config.adapter.method != "lora":
        raise ConfigError(f"a row of the base alone cannot share a batch with "
                          f"{self.config.adapter.method} adapters (a zero soft prompt or prefix "
                          f"is not none): name one of {', '.join(self.names[1:])} for every "
                          "row, or decode the base's rows on their own")
      if self.saved:
        raise ConfigError(f"adapter {self.names[1]} ({self.paths[self.names[1]]}) also trained "
                          f"whole modules ({', '.join(self.saved)}) that the base lacks or "
                          "holds otherwise: a row of the base alone cannot share its batch; "
                          "decode the base's rows on their own")
      return 0
    if name not in self.names:
      raise ConfigError(f"adapter {name!r} is not one of the adapters given "
                        f"({', '.join(self.names[1:])}; {BASE!r} is the base alone): add it, "
                        f"e.g. --adapters {name}=RUN_DIR")
    return self.names.index(name)

  def row_ids(self, names: Sequence[str | None]) -> np.ndarray:
    """(B,) int32 bank indices of each row's adapter name (None: the base alone)."""
    return np.asarray([self.index(n) for n in names], np.int32)

  def params_for(self, ids) -> Tree:
    """The whole params tree for a batch whose row b uses adapter ids[b]: the base as it is,
    every adapter leaf gathered to a per-row axis (at row_axis). Traceable (serving)."""
    return adapters.combine(self.base, gather(self.stacked, ids, self.config))

  def config_of(self, name: str | None) -> ModelConfig:
    """The model config of one adapter alone (its run's: its own lora_alpha), or the bank's
    for the base alone (None / BASE)."""
    return self.config if self.index(name) == 0 else self.configs[name]

  def params_of(self, name: str | None) -> Tree:
    """The whole params tree of one adapter for every row, for config_of(name) (as
    `peft_record.load_run` of its RUN_DIR joins it), or of the base with zero LoRA adapters
    (None / BASE)."""
    if self.index(name) == 0:  # the stacks' first entry: zeros
      return adapters.combine(self.base, traverse_util.unflatten_dict({
          path: jnp.take(leaf, 0, axis=row_axis(path, self.config))
          for path, leaf in traverse_util.flatten_dict(self.stacked).items()}))
    return adapters.combine(self.base, self.singles[name])


def gather(stacked: Tree, ids, config: ModelConfig) -> Tree:
  """The adapter half with leaf[..., ids[b], ...] at each leaf's row axis: one adapter per row."""
  flat = traverse_util.flatten_dict(stacked)
  ids = jnp.asarray(ids, jnp.int32)
  return traverse_util.unflatten_dict({
      path: jnp.take(leaf, ids, axis=row_axis(path, config)) for path, leaf in flat.items()})


def stack(halves: Sequence[Tree], scales: Sequence[float], config: ModelConfig) -> Tree:
  """The adapters' own leaves of `halves` stacked on an adapter axis at each leaf's row axis,
  a zero adapter first (the base alone); each adapter's B multiplied by its entry of `scales`
  (its LoRA scale over the config's). Host arrays."""
  flats = [traverse_util.flatten_dict(jax.device_get(h)) for h in halves]
  paths = sorted(p for p in flats[0] if adapters.is_adapter_path(p))
  out = {}
  for path in paths:
    leaves = [np.asarray(f[path], np.float32) for f in flats]
    if path[-1] == adapters.LORA_B:  # scales are 1 but for LoRA
      leaves = [x if s == 1.0 else x * np.float32(s) for x, s in zip(leaves, scales)]
    out[path] = np.stack([np.zeros_like(leaves[0])] + leaves, axis=row_axis(path, config))
  return traverse_util.unflatten_dict(out)


def load_bank(base: str | os.PathLike, runs: Mapping[str, str | os.PathLike], mesh=None,
              rules=None) -> AdapterBank:
  """The bank of one base and named adapter RUN_DIRs: the base read once and checked against
  every run's fingerprint, each run's adapter half read from its newest checkpoint (or the
  step folder given)."""
  from t5lite.families import family_of
  from t5lite.runtime import checkpoint_reader, partitioning
  from t5lite.interop import frozen_model
  mesh = mesh if mesh is not None else partitioning.make_mesh(partitioning.MeshConfig())
  rules = rules if rules is not None else partitioning.logical_axis_rules()
  read = [read_run(name, path) for name, path in runs.items()]
  config = check_mixable(read)
  where, base_config, host = frozen_model.read(base, role="base")
  if base_config.adapter is not None:
    record = peft_record.read(where.home) or {}
    raise ConfigError(f"the base {base} is itself an adapted model (a PEFT run of "
                      f"{record.get('base', 'another model')}): give the plain base it adapts "
                      "as CHECKPOINT_PATH / --checkpoint, and its adapters as --adapter(s)")
  base_params = frozen_model.load(where, base_config, host, mesh, rules)
  fingerprint = frozen_model.fingerprint(base_params)
  for run in read:
    if run.record["base_fingerprint"] != fingerprint:
      raise ConfigError(
          f"adapter {run.name} ({run.path}) was trained on the base {run.record['base']} "
          f"(fingerprint {run.record['base_fingerprint'][:16]}...), not on {where.path} "
          f"(fingerprint {fingerprint[:16]}...): give the base it was trained on")
  shardings = partitioning.param_shardings(read[0].config, mesh, rules)
  abstract = partitioning.abstract_sharded(family_of(read[0].config).abstract_params(),
                                           shardings)
  saved = peft_record.saved_prefixes(read[0].record)
  wanted_base, wanted_adapter = adapters.split(abstract, saved)
  base_half = peft_record.base_part(base_params, wanted_base, where.path)
  base_half = jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), base_half, wanted_base)
  singles, steps = {}, {}
  for run in read:
    singles[run.name], steps[run.name] = checkpoint_reader.restore_params(run.path,
                                                                          wanted_adapter)
  lora = config.adapter.method == "lora"
  scales = [run.config.adapter.scale / config.adapter.scale if lora else 1.0 for run in read]
  # Small: replicated on every device of the mesh (each process holds the same values).
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  stacked = jax.tree.map(lambda x: jax.device_put(x, replicated),
                         stack([singles[r.name] for r in read], scales, config))
  if saved:  # one run's whole modules (check_mixable: never several): part of the base
    base_half = adapters.combine(base_half, adapters.split(singles[read[0].name])[0])
  return AdapterBank(config, (BASE,) + tuple(runs), base_half, stacked, singles, steps,
                     {r.name: r.path for r in read}, {r.name: r.config for r in read},
                     tuple(read[0].record.get("saved_modules", ())))


DEFAULT_ADAPTER = "default"
"""The bank name of `--adapter` when it is a RUN_DIR beside `--adapters`."""


def load_model(checkpoint_path: str, adapter: str | None, named, mesh, rules,
               per_row: bool = False):
  """(model_config, params, step, bank, default) of a checkpoint and its adapters.

  Neither adapter nor named: the checkpoint alone (peft_record.load_run), bank None. An
  adapter alone: that RUN_DIR's adapters on the base checkpoint_path, for every row. named
  adapters ({name: RUN_DIR}): params is None and `bank` (an AdapterBank)
  gives each batch's per-row params; `default` is the bank name of rows that name none
  (adapter's; else 'base' for LoRA, None otherwise: each row must name one). per_row: a bank
  even for one adapter (rows that say 'base')."""
  named = parse_adapters(named)
  if not adapter and not named:
    return (*peft_record.load_run(checkpoint_path, mesh, rules), None, None)
  runs, default = dict(named), None
  if adapter in runs:
    default = adapter
  elif adapter:
    if DEFAULT_ADAPTER in runs:
      raise ConfigError(f"--adapters names an adapter {DEFAULT_ADAPTER!r}, the name --adapter "
                        f"{adapter} takes beside them: rename it, or give --adapter as one of "
                        "the --adapters names")
    default = DEFAULT_ADAPTER
    runs[default] = adapter
  bank = load_bank(checkpoint_path, runs, mesh, rules)
  if default is None and bank.config.adapter.method == "lora" and not bank.saved:
    default = BASE  # rows that name no adapter: the base alone (LoRA: zero A and B)
  if not named and not per_row:  # one adapter for every row: its run's own config and params
    return bank.config_of(default), bank.params_of(default), bank.steps[default], None, default
  return bank.config, None, max(bank.steps.values()), bank, default


def parse_adapters(text: str | Mapping[str, str] | None, what: str = "--adapters"
                   ) -> dict[str, str]:
  """'a=/runs/a,b=/runs/b' (or a mapping, as gin binds one) -> {'a': '/runs/a', ...}."""
  if not text:
    return {}
  if isinstance(text, Mapping):
    return {str(k): str(v) for k, v in text.items()}
  out = {}
  for part in str(text).split(","):
    if not part.strip():
      continue
    name, sep, path = part.partition("=")
    if not sep or not name.strip() or not path.strip():
      raise ConfigError(f"{what}={text!r}: expected NAME=RUN_DIR,NAME=RUN_DIR,...")
    if name.strip() in out:
      raise ConfigError(f"{what}: the name {name.strip()!r} is given twice")
    out[name.strip()] = path.strip()
  return out
