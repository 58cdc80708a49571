"""LoRA adapters <-> the peft library's adapter directories (folding LoRA into the base:
t5lite.interop.peft.lora_merge).

    save_peft(config, params, out)        adapter_config.json + adapter_model.safetensors, as
                                          peft's PeftModel.save_pretrained writes them
    load_peft(adapter_dir, base_config)   (AdapterConfig, adapter params, saved modules)

Names come from the model's HF layout (hf_layout Entries): an HF Linear (or GPT-2 Conv1D)
tensor `<module>.weight` holding our kernel is where peft puts that kernel's LoRA, as
`base_model.model.<module>.lora_A.weight` (r, fan_in) and `.lora_B.weight` (fan_out, r): our
lora_a (in..., r) and lora_b (r, out...) flattened like the kernel and transposed. Both
orientations are the same for Conv1D (peft's A and B are Linear layers either way).

A fused tensor (GPT-2's c_attn = q|k|v) is one peft LoRA. Separate t5lite LoRAs on its parts
go out as one of rank (parts with LoRA) x r: A their rows stacked, B block-diagonal, and
rank_pattern / alpha_pattern keep the scale, so it is exact. Parts that share one A (an
import of a peft c_attn LoRA) go out as that LoRA again, rank r. Reading back, a
block-diagonal B splits into its blocks; any other B gives every part the whole A and its
rows of B.

Saved modules (peft's modules_to_save: a new head trained whole) travel as their HF tensors
under `base_model.model.`; peft keeps them there without its `modules_to_save.<name>` infix.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np
import safetensors.numpy
from flax import traverse_util

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.interop.hf import layout as hf_layout
from t5lite.interop import limits
from t5lite.interop.peft import settings as peft_settings
from t5lite.models import adapters
from t5lite.models.adapters import ALL_LINEAR, LAYER_MODULES, LORA_A, LORA_B, AdapterConfig
from t5lite.models.config import ModelConfig
from t5lite.models.params import abstract_params, scan_params, unscan_params

Tree = Any
Path = tuple[str, ...]
PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_TYPES = ("LORA", "PROMPT_TUNING", "PREFIX_TUNING")
LORA_KEY = re.compile(r"(.+)\.lora_([AB])\.weight")
LAYER = re.compile(r"layers_(\d+)")
HEAD_TASKS = {"sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
              "question_answering": "QUESTION_ANS"}
# Modules PeftModelFor<task> puts in modules_to_save by itself (peft_model.py).
TASK_MODULES = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"),
                "QUESTION_ANS": ("qa_outputs",)}
# LoraConfig options t5lite has no equivalent of, with the values that mean "not used".
UNSUPPORTED = {"use_dora": (False, None), "lora_bias": (False, None), "bias": ("none", None),
               "target_parameters": (None, []), "trainable_token_indices": (None, {}, []),
               "layer_replication": (None, []), "alora_invocation_tokens": (None, []),
               "use_qalora": (False, None), "use_bdlora": (None, False)}


@dataclasses.dataclass(frozen=True)
class Site:
  """One HF Linear / Conv1D that peft can adapt, and the Dense kernels of ours it holds."""
  module: str                         # 'transformer.h.0.attn.c_attn'
  parts: tuple[Path, ...]             # our Dense paths, unscanned ('decoder', 'layers_0', ...)
  in_shape: tuple[int, ...]           # the kernels' input axes (the same for every part)
  out_shapes: tuple[tuple[int, ...], ...]
  conv1d: bool

  @property
  def fan_in(self) -> int:
    return math.prod(self.in_shape)


def sites(config: ModelConfig) -> tuple[dict[str, Site], list[hf_layout.Entry], dict]:
  """({HF module: Site}, every Entry, our unscanned param shapes) of a config's HF layout."""
  plain = config.replace(scan_layers=False, adapter=None)
  entries = hf_layout.for_config(plain).weight_map(plain)
  shapes = {k: tuple(v.shape) for k, v in
            traverse_util.flatten_dict(abstract_params(plain)).items()}
  found = {}
  for e in entries:
    if (e.kind in ("linear", "conv1d") and e.hf.endswith(".weight")
        and all(p[-1] == "kernel" for p in e.ours)):
      kernels = [shapes[p] for p in e.ours]
      module = e.hf[:-len(".weight")]
      found[module] = Site(module, tuple(p[:-1] for p in e.ours), kernels[0][:e.n_in],
                           tuple(k[e.n_in:] for k in kernels), e.kind == "conv1d")
  return found, entries, shapes


def task_type(config: ModelConfig) -> str | None:
  """peft's TaskType of the model's HF class (None: a plain PeftModel, e.g. a BERT MLM)."""
  if config.head:
    return HEAD_TASKS.get(config.head)
  if config.has_decoder:  # an encoder and a decoder: seq2seq; a decoder alone: a causal LM
    return "SEQ_2_SEQ_LM" if config.has_encoder else "CAUSAL_LM"
  return None


def _adapter(config: ModelConfig) -> AdapterConfig:
  if config.adapter is None:
    raise ConfigError("this model has no adapter (ModelConfig.adapter is None): nothing to "
                      "write as a peft LoRA or to merge")
  return config.adapter


def _under(path: Path, prefixes, scan: bool) -> bool:
  """Whether an unscanned param path lies under one of the prefixes (given in the config's
  layout: 'encoder/layers/...' when scanned)."""
  scanned = tuple("layers" if i == 1 and LAYER.fullmatch(x) else x for i, x in enumerate(path))
  return any(p[:len(q)] == q for q in prefixes for p in ((path, scanned) if scan else (path,)))


# --- save -----------------------------------------------------------------------------------

def save_peft(config: ModelConfig, params: Tree, out: str, base_name_or_path: str = "", *,
              saved_modules: tuple[Path, ...] = ()) -> list[str]:
  """Writes the adapter of an adapted model as peft's save_pretrained does; returns the file
  names. params: the whole tree or the adapter half (with the saved modules' params);
  saved_modules: param path prefixes that go out as peft modules_to_save."""
  adapter = _adapter(config)
  if adapter.method != "lora":
    raise ConfigError(f"save_peft writes LoRA adapters; a {adapter.method} model's goes "
                      "through t5lite.interop.peft.adapters.save")
  flat = traverse_util.flatten_dict(unscan_params(params))
  found, entries, _ = sites(config)
  r, tensors, ranks, done = adapter.r, {}, {}, set()
  for site in found.values():
    have = [p for p in site.parts if p + (LORA_A,) in flat]
    if not have:
      continue
    a = {p: np.asarray(flat[p + (LORA_A,)], np.float32).reshape(site.fan_in, r) for p in have}
    b = {p: np.asarray(flat[p + (LORA_B,)], np.float32).reshape(r, -1) for p in have}
    shared = all(np.array_equal(a[p], a[have[0]]) for p in have)
    rank = r if shared else r * len(have)
    lora_b = np.zeros((sum(math.prod(s) for s in site.out_shapes), rank), np.float32)
    row = 0
    for part, shape in zip(site.parts, site.out_shapes):
      if part in b:
        col = 0 if shared else r * have.index(part)
        lora_b[row:row + math.prod(shape), col:col + r] = b[part].T
      row += math.prod(shape)
    lora_a = a[have[0]].T if shared else np.concatenate([a[p].T for p in have])
    tensors[f"{PREFIX}{site.module}.lora_A.weight"] = np.ascontiguousarray(lora_a)
    tensors[f"{PREFIX}{site.module}.lora_B.weight"] = lora_b
    ranks[site.module] = rank
    done.update(have)
  stray = sorted("/".join(p[:-1]) for p in flat if p[-1] == LORA_A and p[:-1] not in done)
  if stray:
    raise ConfigError(f"LoRA on {', '.join(stray[:5])} has no HF Linear tensor in the "
                      f"{config.family_name} layout, so peft cannot hold it; target other "
                      "modules, or merge it (`t5lite export hf --merge`)")
  if not ranks:
    raise ConfigError("the params hold no LoRA weights (lora_a / lora_b): pass the whole "
                      "params or the adapter half of the adapted model")
  task = task_type(config)
  saved = saved_tensors(config, flat, entries, tuple(map(tuple, saved_modules)), task)
  tensors.update({PREFIX + name: value for name, value in saved[0].items()})
  os.makedirs(out, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(out, WEIGHTS_FILE),
                              metadata={"format": "pt"})
  universe = {e.hf.rsplit(".", 1)[0] for e in entries}  # every HF module with weights
  write_settings(out, _settings(config, found, universe, ranks, saved[1], task,
                                base_name_or_path))
  return [CONFIG_FILE, WEIGHTS_FILE]


def write_settings(out: str, settings: dict) -> None:
  """adapter_config.json, as peft writes it (sorted keys)."""
  with open(os.path.join(out, CONFIG_FILE), "w") as f:
    json.dump(settings, f, indent=2, sort_keys=True)


def saved_tensors(config, flat, entries, prefixes, task) -> tuple[dict, list[str]]:
  """({HF tensor name: array}, peft modules_to_save names) of the saved modules."""
  scan = config.scan_layers
  wanted = {k for k in flat if _under(k, prefixes, scan) and not adapters.is_adapter_path(k)}
  empty = ["/".join(q) for q in prefixes if not any(_under(k, (q,), scan) for k in wanted)]
  if empty:
    raise ConfigError(f"saved modules {empty} are not in the params: pass the whole params "
                      "(or the adapter half with the saved modules)")
  tensors, modules, covered = {}, set(), set()
  for e in entries:
    inside = [p in wanted for p in e.ours]
    if not any(inside):
      continue
    if not all(inside):
      raise ConfigError(f"HF tensor {e.hf} holds {', '.join('/'.join(p) for p in e.ours)}, "
                        "only some of them saved modules: save all of them or none")
    tensors[e.hf] = np.ascontiguousarray(e.to_hf([np.asarray(flat[p]) for p in e.ours]))
    module = e.hf.rsplit(".", 1)[0]
    # peft wraps the task's own head modules itself; naming a child of one too would wrap it
    # twice (RoBERTa's classifier.dense inside `classifier`).
    parts = module.split(".")
    ancestors = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
    modules.add(next((m for m in ancestors if m in TASK_MODULES.get(task, ())), module))
    covered.update(e.ours)
  left = sorted("/".join(p) for p in wanted - covered)
  if left:
    raise ConfigError(f"saved modules' params {', '.join(left[:5])} have no HF tensor; peft "
                      "cannot hold them")
  return tensors, sorted(modules)


def _leaf_or_path(chosen: set[str], universe: set[str], module: str) -> str:
  """A module's leaf name where every module of that name is chosen, else its full path
  (peft matches a target name to modules that end with '.name')."""
  leaf = module.rsplit(".", 1)[-1]
  if all(u in chosen for u in universe if u == leaf or u.endswith("." + leaf)):
    return leaf
  return module


def _settings(config, found, universe, ranks, modules_to_save, task, base_name_or_path) -> dict:
  adapter = config.adapter
  targets = sorted({_leaf_or_path(set(ranks), universe, m) for m in ranks})
  odd = {m: k for m, k in ranks.items() if k != adapter.r}  # fused: rank (parts) x r
  rank_pattern, alpha_pattern = {}, {}
  for m, k in odd.items():
    same = {n for n, j in odd.items() if j == k}
    name = _leaf_or_path(same, set(ranks), m)
    key = name if name != m else re.escape(m)  # peft reads the keys as regular expressions
    rank_pattern[key] = k
    parts = k / adapter.r  # alpha / r (or / sqrt(r)) stays the same at rank parts x r
    alpha_pattern[key] = adapter.lora_alpha * (math.sqrt(parts) if adapter.use_rslora else parts)
  return {
      "peft_type": "LORA", "task_type": task, "r": adapter.r, "lora_alpha": adapter.lora_alpha,
      "lora_dropout": adapter.lora_dropout, "use_rslora": adapter.use_rslora,
      "target_modules": targets, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
      "fan_in_fan_out": any(found[m].conv1d for m in ranks), "bias": "none",
      "modules_to_save": modules_to_save or None, "inference_mode": True,
      "init_lora_weights": True, "base_model_name_or_path": base_name_or_path or None,
      "use_dora": False, "lora_bias": False, "layers_to_transform": None,
      "layers_pattern": None, "exclude_modules": None, "layer_replication": None,
      "target_parameters": None, "trainable_token_indices": None, "revision": None,
      "auto_mapping": None, "megatron_config": None, "megatron_core": "megatron.core",
      "loftq_config": {}, "eva_config": None, "corda_config": None,
      "alora_invocation_tokens": None, "use_qalora": False, "qalora_group_size": 16,
      "ensure_weight_tying": False}


# --- load -----------------------------------------------------------------------------------

def read_dir(adapter_dir: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(adapter_config.json, the tensors) of a peft adapter directory (safetensors only)."""
  config_file = limits.file_inside(adapter_dir, CONFIG_FILE)
  if config_file is None or not os.path.isfile(config_file):
    raise ConfigFileNotFoundError(f"{os.path.join(adapter_dir, CONFIG_FILE)} not found: is "
                                  f"{adapter_dir} a peft adapter directory?")
  settings = limits.read_json(config_file)
  if not isinstance(settings, dict):
    raise ConfigError(f"{config_file}: a JSON {type(settings).__name__}, not an object")
  if settings.get("peft_type") not in PEFT_TYPES:
    raise ConfigError(f"{config_file}: peft_type={settings.get('peft_type')!r}; t5lite reads "
                      f"{', '.join(PEFT_TYPES)} adapters")
  bad = [f"{k}={settings[k]!r}" for k, ok in UNSUPPORTED.items()
         if k in settings and settings[k] not in ok and settings["peft_type"] == "LORA"]
  if bad:
    raise ConfigError(f"{config_file}: {', '.join(bad)} has no t5lite equivalent (t5lite's "
                      "LoRA is plain LoRA on kernels: no DoRA, no trained biases)")
  peft_settings.check(config_file, settings)
  weights = limits.file_inside(adapter_dir, WEIGHTS_FILE)
  if weights is None or not os.path.isfile(weights):
    raise ConfigFileNotFoundError(f"{os.path.join(adapter_dir, WEIGHTS_FILE)} not found (t5lite "
                                  "reads safetensors only; peft writes it by default)")
  try:
    tensors = safetensors.numpy.load_file(weights)
  except Exception as e:  # SafetensorError, OSError
    raise ConfigError(f"{weights} cannot be read (truncated or corrupted?): "
                      f"{type(e).__name__}: {e}") from e
  peft_settings.check_tensors(weights, tensors)
  return settings, tensors


def _pattern_value(patterns: dict, module: str, default):
  """peft's get_pattern_key: the first key that matches the module's name at a '.' boundary."""
  for key, value in (patterns or {}).items():
    if re.match(rf"(.*\.)?({key})$", module):
      return value
  return default


def _split(site: Site, lora_a: np.ndarray, lora_b: np.ndarray):
  """[(part, its A (rank, fan_in), its B (out, rank))] of a site's peft LoRA (module doc)."""
  pieces = np.split(lora_b, np.cumsum([math.prod(s) for s in site.out_shapes])[:-1])
  live = [j for j, piece in enumerate(pieces) if np.any(piece)]
  rank = lora_a.shape[0]
  if len(pieces) > 1 and live and rank % len(live) == 0:
    r = rank // len(live)
    blocks = [(j, slice(k * r, (k + 1) * r)) for k, j in enumerate(live)]
    if all(not np.any(np.delete(pieces[j], cols, axis=1)) for j, cols in blocks):
      return [(j, lora_a[cols], pieces[j][:, cols]) for j, cols in blocks]
  return [(j, lora_a, piece) for j, piece in enumerate(pieces)]


def load_peft(adapter_dir: str, base_config: ModelConfig
              ) -> tuple[AdapterConfig, Tree, tuple[Path, ...]]:
  """(AdapterConfig, adapter params, saved module prefixes) of a peft adapter directory
  (LoRA here; prompt and prefix tuning in t5lite.interop.peft.prompts) for a base
  of base_config: lora_a / lora_b of every adapted kernel and the saved modules' params, in
  base_config's layout (scanned iff scan_layers). Refuses what t5lite cannot hold exactly."""
  settings, tensors = read_dir(adapter_dir)
  if settings["peft_type"] != "LORA":
    raise ConfigError(f"{adapter_dir} is a {settings['peft_type']} adapter: read it with "
                      "t5lite.interop.peft.adapters.load")
  return load_lora(adapter_dir, settings, tensors, base_config)


def load_lora(adapter_dir: str, settings: dict, tensors: dict, base_config: ModelConfig
              ) -> tuple[AdapterConfig, Tree, tuple[Path, ...]]:
  """load_peft's work on a read LoRA directory (read_dir's settings and tensors)."""
  base = base_config.replace(adapter=None)
  found, entries, shapes = sites(base)
  rslora = bool(settings.get("use_rslora"))
  loras, others = {}, {}
  for key, value in tensors.items():
    name = key.removeprefix(PREFIX)
    match = LORA_KEY.fullmatch(name)
    if match:
      loras.setdefault(match[1], {})[match[2]] = np.asarray(value, np.float32)
    elif ".lora_" in name:
      raise ConfigError(f"{adapter_dir}: tensor {key} is a LoRA variant t5lite cannot hold "
                        "(only Linear lora_A / lora_B)")
    else:
      others[name] = value
  if not loras:
    raise ConfigError(f"{adapter_dir} holds no LoRA weights (no *.lora_A.weight tensors)")
  parts = {}  # our Dense path -> (A (rank, fan_in), B (out, rank), alpha at that rank)
  for module, pair in sorted(loras.items()):
    site = found.get(module)
    if site is None:
      raise ConfigError(f"{adapter_dir}: {PREFIX}{module}.lora_A.weight maps to no kernel of "
                        f"this {base.family_name} model (its adaptable modules are e.g. "
                        f"{', '.join(sorted(found)[:4])})")
    if set(pair) != {"A", "B"}:
      raise ConfigError(f"{adapter_dir}: {module} has lora_{''.join(pair)} only")
    lora_a, lora_b = pair["A"], pair["B"]
    rank, fan_out = lora_a.shape[0], sum(math.prod(s) for s in site.out_shapes)
    if lora_a.shape != (rank, site.fan_in) or lora_b.shape != (fan_out, rank):
      raise ConfigError(f"{adapter_dir}: {module}'s lora_A {lora_a.shape} / lora_B "
                        f"{lora_b.shape} do not fit its ({fan_out}, {site.fan_in}) weight")
    alpha = float(_pattern_value(settings.get("alpha_pattern"), module,
                                 settings.get("lora_alpha", 8)))
    for j, a, b in _split(site, lora_a, lora_b):
      # The same scale alpha / rank (or / sqrt) at the part's own rank.
      ratio = a.shape[0] / rank
      part_alpha = alpha if ratio == 1 else alpha * (math.sqrt(ratio) if rslora else ratio)
      small = min(site.fan_in, math.prod(site.out_shapes[j]))
      if a.shape[0] > small:
        raise ConfigError(f"{adapter_dir}: {module}'s LoRA rank {a.shape[0]} is larger than "
                          f"{'/'.join(site.parts[j])}'s smaller side ({site.fan_in} x "
                          f"{math.prod(site.out_shapes[j])}); a rank of at most {small} fits")
      parts[site.parts[j]] = (a, b, part_alpha, site.in_shape, site.out_shapes[j])
  by_rank = {}
  for path, (a, *_) in parts.items():
    by_rank.setdefault(a.shape[0], []).append("/".join(path))
  if len(by_rank) > 1:
    listed = "; ".join(f"rank {k}: {', '.join(v[:3])}" for k, v in sorted(by_rank.items()))
    raise ConfigError(f"{adapter_dir} has LoRAs of different ranks ({listed}); t5lite's "
                      "AdapterConfig has one r for every kernel")
  r = next(iter(by_rank))
  alphas = sorted({p[2] for p in parts.values()})
  lora_alpha = alphas[0] if len(alphas) == 1 else float(settings.get("lora_alpha", 8))
  flat = {}
  for path, (a, b, alpha, in_shape, out_shape) in parts.items():
    b = b * (alpha / lora_alpha)  # another alpha at the same rank: its scale moves into B
    flat[path + (LORA_A,)] = a.T.reshape(in_shape + (r,))
    flat[path + (LORA_B,)] = np.ascontiguousarray(b.T).reshape((r,) + out_shape)
  saved = load_saved(adapter_dir, base, entries, shapes, others, flat)
  adapter = AdapterConfig(r=r, lora_alpha=lora_alpha, use_rslora=rslora,
                          lora_dropout=float(settings.get("lora_dropout") or 0.0),
                          target_modules=_targets(base, set(parts), adapter_dir))
  return adapter, in_layout(base, flat, adapter_dir), saved


def load_saved(adapter_dir, base, entries, shapes, others, flat) -> tuple[Path, ...]:
  """Puts the saved modules' tensors into flat; returns their prefixes: a whole top-level
  module ('head') when all of it is saved, else each module's own path."""
  by_name = {e.hf: e for e in entries}
  for name, value in sorted(others.items()):
    e = by_name.get(name)
    if e is None:
      raise ConfigError(f"{adapter_dir}: tensor {PREFIX}{name} maps to no param of this "
                        f"{base.family_name} model")
    want = [shapes[p] for p in e.ours]
    if tuple(value.shape) != e.hf_shape(want):
      raise ConfigError(f"{adapter_dir}: {PREFIX}{name} has shape {tuple(value.shape)}, "
                        f"expected {e.hf_shape(want)}")
    for path, array in zip(e.ours, e.from_hf(np.asarray(value), want)):
      flat[path] = array.astype(base.storage_dtype)
  saved = {p for p in flat if not adapters.is_adapter_path(p)}
  prefixes = set()
  for path in saved:
    whole = all(k in saved for k in shapes if k[0] == path[0])
    prefix = path[:1] if whole else path[:-1]
    if base.scan_layers:  # in the layout's names: encoder/layers/...
      prefix = tuple("layers" if i == 1 and LAYER.fullmatch(x) else x
                     for i, x in enumerate(prefix))
    prefixes.add(prefix)
  return tuple(sorted(prefixes))


def _targets(base: ModelConfig, chosen: set[Path], where: str) -> tuple[str, ...]:
  """target_modules whose AdapterConfig.targets holds for exactly the chosen Dense paths (in
  base's layout): the shortest path suffix of each that matches no other Dense."""
  if base.scan_layers:
    chosen = {tuple("layers" if LAYER.fullmatch(x) else x for x in p) for p in chosen}
  probe = base.replace(adapter=AdapterConfig(target_modules=("*",)))  # every Dense
  universe = {k[:-1] for k in traverse_util.flatten_dict(abstract_params(probe))
              if k[-1] == LORA_A}
  if chosen == {u for u in universe if u[-1] in LAYER_MODULES}:
    return (ALL_LINEAR,)
  patterns = set()
  for path in sorted(chosen):
    for n in range(1, len(path) + 1):
      pattern = "/".join(path[-n:])
      if all(u in chosen for u in universe if AdapterConfig(target_modules=(pattern,)).targets(u)):
        patterns.add(pattern)
        break
  config = AdapterConfig(target_modules=tuple(sorted(patterns)))
  wrong = sorted("/".join(u) for u in universe if config.targets(u) != (u in chosen))
  if wrong:  # a layout bug (a kernel no Dense path names), not bad input
    raise AssertionError(f"{where}: target_modules {config.target_modules} miss {wrong}")
  return config.target_modules


def in_layout(base: ModelConfig, flat: dict, where: str) -> Tree:
  """flat (unscanned paths) as a tree in base's layout; scanning needs every layer alike."""
  if not base.scan_layers:
    return traverse_util.unflatten_dict(flat)
  for stack, n in (("encoder", base.num_encoder_layers), ("decoder", base.num_decoder_layers)):
    per_layer = [{k[2:] for k in flat if k[:2] == (stack, f"layers_{i}")} for i in range(n)]
    odd = sorted(set().union(*per_layer) - set.intersection(*per_layer)) if n else []
    if odd:
      covered = [i for i, keys in enumerate(per_layer) if odd[0] in keys]
      raise ConfigError(f"{where} adapts {stack} {'/'.join(odd[0][:-1])} in layers {covered} "
                        f"of {n} only; a scan_layers=True model adapts every layer alike: use "
                        "a base config with scan_layers=False")
  return scan_params(traverse_util.unflatten_dict(flat), base)
