"""T5X checkpoints -> t5lite (config, params): `load_t5x` and `t5lite import t5x`.

  t5lite import t5x --from T5X_MODEL_DIR[/checkpoint_N] --out MODEL_DIR
      [--vocabulary SPIECE_MODEL_OR_DIR] [--extra_ids 100] [--mlp_activation gated-gelu]
      [--relative_attention_max_distance 128] [--step N] [--max_params N]

Layouts read: t5x_files.py (msgpack + tensorstore, and T5X's orbax layout). Only 'target'
(the params) is read: optimizer moments and the step counter's state are dropped.

Param names (t5x/examples/t5/network.py, layers.py) are t5lite's own, except that
q/k/v kernels are stored joined, (embed, heads*kv), the out kernel (heads*kv, embed), and
`relpos_bias/rel_embedding` is (heads, buckets). `logits_via_embedding` (no
`decoder/logits_dense`) divides logits by sqrt(emb_dim): t5lite's tie_output_embedding and
scale_logits together. LayerNorm epsilon is T5X's fixed 1e-6.

scalable_t5 (examples/scalable_t5) keeps 3-D kernels and a relative position table inside
every layer (`relpos_bias`, or `relative_posemb` in other versions of its network.py); scanned,
a stack's layers are `encoder/encoder/...` or `encoder/layers/...`, the layer axis at
`param_scan_axis` (1). t5lite shares one table per stack, and scalable_t5 initializes each
layer's table on its own, so its trained checkpoints are refused (before their weights are
read); only those whose tables are equal within each stack import.

Untrusted input: t5x_files.py reads with size limits, checks what each array claims against
its chunk files and the import ceiling (limits.py: --max_params, T5LITE_MAX_IMPORT_PARAMS,
10**11 parameters), and keeps every path inside the checkpoint; here each array's shape and
dtype are checked against the inferred config before its data is read.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import Any, Callable

import numpy as np
from flax import traverse_util

from t5lite.errors import ConfigError, ConfigFileNotFoundError
from t5lite.interop import limits
from t5lite.interop.t5x import files
from t5lite.interop.t5x.files import T5XCheckpointError, find_checkpoint, read_target
from t5lite.interop.t5x.gin_bindings import gin_bindings, read_gin
from t5lite.models.config import ACTIVATIONS, ACTIVATION_ALIASES, ModelConfig
from t5lite.models.params import abstract_params, scan_params
from t5lite.models.transformer import CROSS_ATTENTION
from t5lite.util import paths, progress, staging

# T5X mlp_activations -> t5lite mlp_activation ('gelu' is flax's tanh approximation, as ours).
ACTIVATIONS_FROM_T5X = {("relu",): "relu", ("gelu",): "gelu", ("gelu", "linear"): "gated-gelu",
                        ("silu", "linear"): "swiglu", ("swish", "linear"): "swiglu",
                        ("relu", "linear"): "reglu"}
ATTENTIONS = ("attention", "self_attention", CROSS_ATTENTION)  # T5X's names are ours
# scalable_t5's scanned layers: `encoder/layers/...`, or named like their stack (`encoder/encoder`).
SCAN_NAMES = ("layers", "encoder")
# scalable_t5's per-layer relative position table, in the versions of its network.py.
RELPOS_NAMES = ("relpos_bias", "relative_posemb")


# --- config inference ---------------------------------------------------------------------------

def _layer_count(target: dict, stack: str) -> int:
  indices = {int(m[1]) for key in target if len(key) > 1 and key[0] == stack
             and (m := re.fullmatch(r"layers_(\d+)", key[1]))}
  if indices != set(range(len(indices))):
    raise T5XCheckpointError(f"{stack} layers {sorted(indices)} are not numbered 0..n-1")
  return len(indices)


def _shape(target: dict, key: tuple[str, ...], axis: int | None = None) -> tuple[int, ...]:
  if key not in target:
    raise T5XCheckpointError(f"no {'/'.join(key)} in the checkpoint: not a T5X T5 "
                             "encoder-decoder (t5x/examples/t5 or scalable_t5)")
  shape = tuple(target[key].shape)
  return shape if axis is None else shape[:axis] + shape[axis + 1:]


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a T5X tree stores the model: joined 2-D q/k/v/out kernels (examples/t5) or 3-D
  (scalable_t5); scanned stacks, their name and layer axis; relpos per stack or per layer,
  and the per-layer table's name."""
  joined: bool
  scanned: bool
  scan_axis: int
  relpos_per_layer: bool
  scan_name: str = "layers"  # 'layers', or 'encoder': each stack's scan named like the stack
  relpos_name: str = "relpos_bias"

  def layer_key(self, stack: str, layer: int) -> tuple[str, str]:
    """T5X key of one layer: stack/layers_N, or the stack's scanned layers."""
    if not self.scanned:
      return stack, f"layers_{layer}"
    return stack, stack if self.scan_name == "encoder" else self.scan_name

  def relpos_key(self, stack: str, layer: int = 0) -> tuple[str, ...]:
    if not self.relpos_per_layer:
      return stack, "relpos_bias", "rel_embedding"
    return self.layer_key(stack, layer) + (self.relpos_name, "rel_embedding")


def infer_config(target: dict, gin: dict[str, Any], hints: dict[str, Any],
                 note: Callable[[str], None]) -> tuple[ModelConfig, Layout]:
  """ModelConfig from the arrays' shapes and presence, config.gin's T5Config, then hints."""
  scan_name = next((name for name in SCAN_NAMES
                    if ("encoder", name, "pre_attention_layer_norm", "scale") in target), None)
  axis = gin.get("param_scan_axis", 1) if scan_name else None
  axis = axis if axis is None or isinstance(axis, int) else 1
  try:
    values, gated, layout = _from_shapes(target, scan_name, axis)
  except T5XCheckpointError:
    raise
  except (ValueError, IndexError, ZeroDivisionError) as e:  # arrays of the wrong rank
    raise T5XCheckpointError(f"cannot read a T5 model off the array shapes ({e})") from None
  values.update(_from_gin(gin, gated, hints, note))
  _check_gin(gin, values, note)
  values.update(hints)
  return ModelConfig(**values), layout


def _from_shapes(target: dict, scan_name: str | None,
                 axis: int | None) -> tuple[dict, bool, Layout]:
  """ModelConfig values, gated MLP or not, and the Layout, from shapes and presence."""
  per_layer = ("encoder", "relpos_bias", "rel_embedding") not in target
  layout = Layout(joined=True, scanned=scan_name is not None, scan_axis=axis or 0,
                  relpos_per_layer=per_layer, scan_name=scan_name or "layers")
  first = layout.layer_key("encoder", 0)
  layout = dataclasses.replace(layout, relpos_name=next(
      (name for name in RELPOS_NAMES if first + (name, "rel_embedding") in target),
      RELPOS_NAMES[0]))
  vocab, d_model = _shape(target, ("token_embedder", "embedding"))
  heads, buckets = _shape(target, layout.relpos_key("encoder"), axis if per_layer else None)
  query = _shape(target, first + ("attention", "query", "kernel"), axis)
  gated = first + ("mlp", "wi_0", "kernel") in target
  d_ff = _shape(target, first + ("mlp", "wi_0" if gated else "wi", "kernel"), axis)[1]
  if layout.scanned:
    layers = [_shape(target, layout.layer_key(s, 0) + ("pre_mlp_layer_norm", "scale"))[axis]
              for s in ("encoder", "decoder")]
    if max(layers) > limits.MAX_LAYERS:  # one number in a shape; see limits.MAX_LAYERS
      raise T5XCheckpointError(f"the scanned arrays claim {layers} (encoder, decoder) "
                               f"layers, over {limits.MAX_LAYERS}; refused")
  else:
    layers = [_layer_count(target, s) for s in ("encoder", "decoder")]
  values = dict(vocab_size=vocab, d_model=d_model, d_ff=d_ff,
                num_heads=heads, d_kv=query[-1] if len(query) == 3 else query[1] // max(heads, 1),
                num_encoder_layers=layers[0], num_decoder_layers=layers[1], norm="rms",
                layer_norm_epsilon=1e-6, position_encoding="relative_bias",
                relative_attention_num_buckets=buckets, scan_layers=layout.scanned,
                param_dtype=str(target[("token_embedder", "embedding")].dtype))
  tied = ("decoder", "logits_dense", "kernel") not in target
  values.update(tie_output_embedding=tied, scale_logits=tied)  # T5X logits_via_embedding
  return values, gated, dataclasses.replace(layout, joined=len(query) == 2)


def _from_gin(gin: dict[str, Any], gated: bool, hints: dict[str, Any],
              note: Callable[[str], None]) -> dict[str, Any]:
  values, defaulted = {}, []
  acts = gin.get("mlp_activations")
  if "mlp_activation" in hints:
    pass  # the command line knows better than config.gin
  elif isinstance(acts, (tuple, list)) and tuple(acts) in ACTIVATIONS_FROM_T5X:
    values["mlp_activation"] = ACTIVATIONS_FROM_T5X[tuple(acts)]
    if (len(acts) == 2) != gated:
      raise T5XCheckpointError(f"config.gin says mlp_activations={tuple(acts)}, but the "
                               f"checkpoint's MLP {'is' if gated else 'is not'} gated (wi_0, wi_1)")
  elif acts is not None:
    raise T5XCheckpointError(f"config.gin mlp_activations={acts!r} has no t5lite equivalent; "
                             f"supported: {sorted(ACTIVATIONS_FROM_T5X)}")
  else:  # v1.1's activation when gated; ungated T5 (v1.0) is relu
    values["mlp_activation"] = "gated-gelu" if gated else "relu"
    defaulted.append(f"mlp_activation={values['mlp_activation']!r}")
  distance = gin.get("max_distance", 128)
  values["relative_attention_max_distance"] = distance if isinstance(distance, int) else 128
  if "max_distance" not in gin:
    defaulted.append("relative_attention_max_distance=128")
  if isinstance(gin.get("dropout_rate"), (int, float)):
    values["dropout_rate"] = float(gin["dropout_rate"])
  defaulted = [d for d in defaulted if d.split("=")[0] not in hints]
  if defaulted:
    note(f"not in the checkpoint or its config.gin, so T5's: {', '.join(defaulted)} (T5X's "
         "network.py fixes max_distance 128; override with --mlp_activation / "
         "--relative_attention_max_distance)")
  return values


def _check_gin(gin: dict[str, Any], values: dict[str, Any], note: Callable[[str], None]) -> None:
  """Warns when config.gin describes another model than the arrays (the arrays win)."""
  pairs = {"vocab_size": "vocab_size", "emb_dim": "d_model", "num_heads": "num_heads",
           "head_dim": "d_kv", "mlp_dim": "d_ff", "num_encoder_layers": "num_encoder_layers",
           "num_decoder_layers": "num_decoder_layers"}
  for gin_name, field in pairs.items():
    if gin_name in gin and gin[gin_name] != values[field]:
      note(f"config.gin says {gin_name}={gin[gin_name]!r} but the arrays say {values[field]}; "
           "using the arrays")
  tied, via_embedding = values["tie_output_embedding"], gin.get("logits_via_embedding")
  if isinstance(via_embedding, bool) and via_embedding != tied:
    note(f"config.gin says logits_via_embedding={via_embedding} but the checkpoint "
         f"{'lacks' if tied else 'has'} decoder/logits_dense; using the arrays")


# --- T5X arrays -> t5lite params -------------------------------------------------------------

def _source(path: tuple[str, ...], shape: tuple[int, ...], layout: Layout):
  """(T5X key, expected T5X shape, layer index or None, kind) of one t5lite param (unscanned)."""
  kind = "same"
  if path[-2:] == ("relpos_bias", "rel_embedding"):
    kind, shape = "relpos", shape[::-1]  # ours (buckets, heads), T5X (heads, buckets)
  elif layout.joined and len(path) > 3 and path[-3] in ATTENTIONS:
    kind = "out" if path[-2] == "out" else "qkv"
    shape = (shape[0] * shape[1], shape[2]) if kind == "out" else (shape[0], shape[1] * shape[2])
  layer = None
  if kind == "relpos":
    path = layout.relpos_key(path[0])  # per layer: layer 0's; every copy is checked equal
    layer = 0 if layout.relpos_per_layer else None
  elif len(path) > 1 and (m := re.fullmatch(r"layers_(\d+)", path[1])):
    path, layer = layout.layer_key(path[0], int(m[1])) + path[2:], int(m[1])
  if layer is not None and layout.scanned:
    shape = shape[:layout.scan_axis] + (-1,) + shape[layout.scan_axis:]
  return path, shape, (layer if layout.scanned else None), kind


def _expected(config: ModelConfig, layout: Layout) -> dict:
  shapes = traverse_util.flatten_dict(abstract_params(config.replace(scan_layers=False)))
  return {path: _source(path, tuple(x.shape), layout) for path, x in shapes.items()}


def validate(target: dict, config: ModelConfig, layout: Layout, label: str) -> dict:
  """Checks every array's presence, shape and dtype before any data is read; returns
  {our path: source}. Raises naming each parameter and both shapes."""
  expected = _expected(config, layout)
  layers = {"encoder": config.num_encoder_layers, "decoder": config.num_decoder_layers}
  wanted = {key: tuple(layers[key[0]] if n == -1 else n for n in shape)
            for key, shape, _, _ in expected.values()}
  for key in _relpos_copies(config, layout):  # layers_1.. of per-layer tables: as layers_0
    wanted[key] = wanted[layout.relpos_key(key[0])]
  problems = []
  for key, want in wanted.items():
    if key not in target:
      problems.append(f"{'/'.join(key)}: missing from the checkpoint")
    elif tuple(target[key].shape) != want:
      problems.append(f"{'/'.join(key)}: shape {tuple(target[key].shape)} in the checkpoint, "
                      f"expected {want} for this config")
    elif str(target[key].dtype) not in ("float32", "bfloat16", "float16"):
      problems.append(f"{'/'.join(key)}: dtype {target[key].dtype}")
  problems += [f"{'/'.join(k)}: in the checkpoint, not a parameter of this model"
               for k in target if k not in wanted]
  if problems:
    more = [f"... and {len(problems) - 10} more"] if len(problems) > 10 else []
    raise T5XCheckpointError(f"{label}: the arrays do not fit the inferred config:\n  "
                             + "\n  ".join(problems[:10] + more))
  return expected


def _relpos_copies(config: ModelConfig, layout: Layout) -> list[tuple[str, ...]]:
  """Per-layer relpos tables (unscanned scalable_t5) of layers 1..n-1: checked, not mapped."""
  if not layout.relpos_per_layer or layout.scanned:
    return []
  return [layout.relpos_key(stack, i) for stack, n in (("encoder", config.num_encoder_layers),
                                                      ("decoder", config.num_decoder_layers))
          for i in range(1, n)]


def _to_ours(x: np.ndarray, shape: tuple[int, ...], layer, kind: str, axis: int) -> np.ndarray:
  if layer is not None:
    x = np.take(x, layer, axis=axis)
  return x.T if kind == "relpos" else x.reshape(shape)


def _check_shared_relpos(target: dict, config: ModelConfig, layout: Layout) -> dict:
  """t5lite shares one relpos table per stack: a per-layer T5X checkpoint must agree. Reads
  only the tables (small), so a refused checkpoint costs no weight reads; returns them."""
  arrays = {}
  for stack, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
    keys = [layout.relpos_key(stack, i) for i in range(1 if layout.scanned else n)]
    arrays.update({key: _array(target[key]) for key in keys})
    if layout.scanned:
      copies = [np.take(arrays[keys[0]], i, axis=layout.scan_axis) for i in range(n)]
    else:
      copies = [arrays[key] for key in keys]
    for i, copy in enumerate(copies[1:], 1):
      if not np.array_equal(copy, copies[0]):
        raise T5XCheckpointError(
            f"{'/'.join(keys[0] if layout.scanned else keys[i])}: {stack} layer {i} has its "
            "own relative position table, unlike layer 0 (scalable_t5 initializes one per "
            "layer); t5lite shares one table per stack, so this checkpoint cannot be imported")
  return arrays


def _array(leaf) -> np.ndarray:
  return leaf if isinstance(leaf, np.ndarray) else leaf.read()


def assemble(target: dict, config: ModelConfig, layout: Layout, label: str):
  """t5lite params (scanned iff config.scan_layers) from validated T5X arrays."""
  expected = validate(target, config, layout, label)
  needed = {key for key, *_ in expected.values()}
  arrays = _check_shared_relpos(target, config, layout) if layout.relpos_per_layer else {}
  arrays.update({key: _array(target[key]) for key in needed - set(arrays)})
  shapes = traverse_util.flatten_dict(abstract_params(config.replace(scan_layers=False)))
  flat = {path: _to_ours(arrays[key], tuple(shapes[path].shape), layer, kind, layout.scan_axis)
          .astype(config.storage_dtype, copy=False)
          for path, (key, _, layer, kind) in expected.items()}
  params = traverse_util.unflatten_dict(flat)
  return scan_params(params, config) if config.scan_layers else params


# --- entry points -------------------------------------------------------------------------

def _note(text: str) -> None:
  print(f"t5lite import t5x: note: {text}", file=sys.stderr)


def _load(path: str, step: int | None, hints: dict[str, Any], note=_note,
          max_params: int | None = None):
  """(config, params, step, config.gin text, the T5X model dir: the checkpoint's parent)."""
  unknown = sorted(set(hints) - {f.name for f in dataclasses.fields(ModelConfig)})
  if unknown:
    raise ConfigError(f"unknown ModelConfig fields {unknown}")
  ckpt_dir, step = find_checkpoint(path, step)
  target, recorded_step = read_target(ckpt_dir, max_params)
  gin_path, gin_text = read_gin(ckpt_dir)
  config, layout = infer_config(target, gin_bindings(gin_text, "T5Config"), hints, note)
  params = assemble(target, config, layout, os.path.basename(ckpt_dir))
  step = step if step is not None else (recorded_step or 0)
  return config, params, step, gin_text, os.path.dirname(ckpt_dir)


def load_t5x(path: str, *, step: int | None = None, max_params: int | None = None,
             **config_hints) -> tuple[ModelConfig, Any]:
  """(ModelConfig, params) of a T5X checkpoint: a T5X model dir (its newest checkpoint_N, or
  `step`) or one checkpoint_N folder. config_hints (ModelConfig fields, e.g.
  mlp_activation='gated-gelu', scan_layers=True) override what is inferred. max_params: the
  import ceiling (limits.py)."""
  config, params, *_ = _load(path, step, config_hints, max_params=max_params)
  return config, params


def _gin_vocabulary(gin_text: str, extra_ids: int | None, model_dir: str):
  """config.gin's seqio.SentencePieceVocabulary when its file lies inside the T5X model dir
  (a relative path is taken from there); extra_ids as seqio reads them (the binding, else 0:
  T5X's cc_all.32000.100extra model holds its sentinels).

  config.gin is as untrusted as the checkpoint: followed anywhere, it would have any local file
  read and copied into the output, so paths (and symlinks) out of the model dir are refused.
  """
  from t5lite.data.vocab.vocabularies import SentencePieceVocabulary
  bound = gin_bindings(gin_text, "SentencePieceVocabulary")
  model_file = bound.get("sentencepiece_model_file")
  if extra_ids is None:
    extra_ids = bound["extra_ids"] if isinstance(bound.get("extra_ids"), int) else 0
  problem = f"config.gin names {model_file!r}, not a local file"
  path = _inside_model_dir(model_dir, model_file)
  if path is None and isinstance(model_file, str) and "://" not in model_file:
    problem = (f"config.gin names {model_file!r}, outside the T5X model dir {model_dir}, "
               "and is not followed there")
  elif path is not None and os.path.isfile(path):
    try:
      vocabulary = SentencePieceVocabulary(path, extra_ids)
      print(f"t5lite import t5x: vocabulary {path} (config.gin), {extra_ids} extra ids",
            file=sys.stderr)
      return vocabulary
    except Exception as e:  # not a sentencepiece model: import the weights regardless
      problem = f"config.gin's {path} does not load ({e})"
  print(f"t5lite import t5x: warning: no vocabulary ({problem}); eval and infer will need "
        "one: pass --vocabulary SPIECE_MODEL", file=sys.stderr)
  return None


def _inside_model_dir(model_dir: str, model_file) -> str | None:
  """model_file (relative to model_dir) with its symlinks resolved, if that is in model_dir."""
  if (not isinstance(model_file, str) or not model_file or "://" in model_file
      or "\0" in model_file):
    return None  # a URL (gs://...) or no path
  root = os.path.realpath(model_dir)
  path = os.path.realpath(os.path.join(root, model_file))
  return path if os.path.commonpath([root, path]) == root else None


def _vocabulary(args, gin_text: str, model_dir: str):
  from t5lite.data.vocab import vocabularies
  source = args.vocabulary
  if source is None:
    return _gin_vocabulary(gin_text, args.extra_ids, model_dir)
  if os.path.isdir(source):
    if os.path.isfile(os.path.join(source, vocabularies.CONFIG_FILE)):
      return vocabularies.load_vocabulary(source)
    names = [n for n in (vocabularies.SPIECE_FILE, "sentencepiece.model")
             if os.path.isfile(os.path.join(source, n))]
    if not names:
      raise ConfigFileNotFoundError(
          f"--vocabulary {source}: no spiece.model or sentencepiece.model")
    source = os.path.join(source, names[0])
  return vocabularies.SentencePieceVocabulary(source, 100 if args.extra_ids is None
                                              else args.extra_ids)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="t5lite import t5x", description="Import a T5X checkpoint (msgpack + tensorstore, "
      "or T5X's orbax layout) into a params-only t5lite MODEL_DIR.")
  parser.add_argument("--from", dest="source", required=True, metavar="DIR",
                      help="a T5X model dir (newest checkpoint_N) or one checkpoint_N folder")
  parser.add_argument("--out", required=True, metavar="MODEL_DIR",
                      help="the t5lite MODEL_DIR to write")
  parser.add_argument("--vocabulary", metavar="SPIECE_MODEL_OR_DIR",
                      help="sentencepiece model file, or a folder holding spiece.model or a "
                      "t5lite vocabulary.json (default: config.gin's file, if it lies inside "
                      "the T5X model dir)")
  parser.add_argument("--extra_ids", type=int, default=None, metavar="N",
                      help="sentinels appended to the sentencepiece model (default 100 with "
                      "--vocabulary; with config.gin's model, its extra_ids binding, else 0)")
  parser.add_argument("--mlp_activation", choices=ACTIVATIONS + tuple(ACTIVATION_ALIASES),
                      help="override config.gin's mlp_activations")
  parser.add_argument("--relative_attention_max_distance", type=int, metavar="N",
                      help="override T5X's 128")
  parser.add_argument("--step", type=int, metavar="N",
                      help="which checkpoint_N of a model dir (default: the newest)")
  parser.add_argument("--max_params", type=limits.positive_count, metavar="N",
                      help=limits.MAX_PARAMS_HELP)
  return parser


def main(argv: list[str]) -> int:
  from t5lite.interop.params_only import write_model_dir
  from t5lite.runtime.model_dir import check_location
  args = _parser().parse_args(argv)
  hints = {k: getattr(args, k) for k in ("mlp_activation", "relative_attention_max_distance")
           if getattr(args, k) is not None}
  check_location(args.source, "--from")
  check_location(args.out, "--out")
  if paths.is_url(args.out):  # (a local --out: write_model_dir refuses one with checkpoints)
    staging.check_empty(args.out)
  # On a bucket: the step read is fetched to local disk, the MODEL_DIR written there first.
  with files.staged(args.source, args.step) as source, staging.upload(args.out) as out:
    with progress.stage(f"import t5x: reading {args.source}"):
      config, params, step, gin_text, t5x_dir = _load(source, args.step, hints,
                                                      max_params=args.max_params)
    vocabulary = _vocabulary(args, gin_text, t5x_dir)
    if vocabulary is not None and vocabulary.vocab_size > config.vocab_size:
      raise ConfigError(f"the vocabulary has {vocabulary.vocab_size} ids but the model only "
                        f"{config.vocab_size} embeddings (check --extra_ids)")
    with progress.stage(f"import t5x: writing {args.out}"):
      folder = write_model_dir(out, config, params, step=step, vocabulary=vocabulary)
  import json
  print(json.dumps({"import": "t5x", "from": paths.absolute(args.source), "step": step,
                    "out": paths.absolute(args.out),
                    "checkpoint": staging.renamed(folder, out, args.out),
                    "vocabulary": repr(vocabulary) if vocabulary else None}))
  return 0
