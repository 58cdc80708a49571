"""`t5lite export serving`: a checkpoint as a `jax.export` artifact that runs without t5lite.

  t5lite export serving --checkpoint MODEL_DIR[/checkpoints/STEP] --out DIR
      [--input_length 512] [--max_decode_length 128] [--methods greedy,beam]
      [--num_beams 4] [--alpha 0.6] [--adapter RUN_DIR] [--adapters NAME=RUN_DIR,...]

writes

  DIR/serving.json         manifest: model config, step, lengths, methods, beam settings,
                           jax version, the platforms the functions were lowered for, and
                           the size and SHA-256 of every other file (the loader checks them)
  DIR/params.safetensors   the params, keys joined with '/' ("decoder/layers_0/..."), dtypes kept
  DIR/greedy.jax_export    one serialized function per method: fn(params, tokens) -> ids, where
  DIR/beam.jax_export      tokens is (batch, input_length) int32, 0-padded, any batch size
  DIR/vocabulary.json      the MODEL_DIR's vocabulary, as Vocabulary.save writes it
  DIR/spiece.model         (sentencepiece vocabularies only)
  DIR/serving_loader.py    the loader: `python DIR/serving_loader.py DIR --text "..."`

Each function is the very program `t5lite.generate` jits (decoding.py: encoder, prefill and the
greedy or beam loop), traced with a symbolic batch dimension, so the artifact's ids equal the
live model's. Its output follows `generate`: (batch, max_decode_length) int32 ids without the
start token, EOS included, 0 after EOS. The input length is fixed at export: shorter inputs
are padded with 0 by the loader, longer ones are refused (never silently truncated, which
would change the answer).

A PEFT run's RUN_DIR as --checkpoint, or a base --checkpoint with --adapter RUN_DIR, exports
the adapted model (base and adapters joined). With --adapters NAME=RUN_DIR,... (adapters of
the base --checkpoint, all LoRA or all soft prompts or all prefixes:
t5lite.interop.peft.adapter_batch) the artifact serves them all at once:
params.safetensors holds the base and the adapters stacked (index 0 the base alone, then the
names in order: serving.json's "adapters"), and each function is fn(params, adapter_ids,
tokens) with adapter_ids (batch,) int32, one adapter per row, all rows in one program.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import traverse_util

from t5lite.data.vocab.vocabularies import CONFIG_FILE as VOCABULARY_FILE
from t5lite.data.vocab.vocabularies import Vocabulary, load_vocabulary
from t5lite.errors import ConfigError
from t5lite.families import family_of
from t5lite.models import adapters as adapters_lib
from t5lite.models.decoding import search as decoding
from t5lite.models.config import ModelConfig
from t5lite.runtime import model_dir
from t5lite.util import paths, staging

MANIFEST_FILE = "serving.json"
PARAMS_FILE = "params.safetensors"
LOADER_FILE = "serving_loader.py"
EXPORT_SUFFIX = ".jax_export"
FORMAT = "t5lite-serving"
FORMAT_VERSION = 2  # 2: serving.json lists every file's size and SHA-256
METHODS = ("greedy", "beam")
PLATFORMS = ("cpu", "cuda")
KEY_SEPARATOR = "/"


def serving_function(config: ModelConfig, method: str, *, max_decode_length: int,
                     num_beams: int = 4, alpha: float = 0.6):
  """fn(params, tokens (B, L) int32) -> (B, max_decode_length) int32 ids: what
  `t5lite.generate(config, params, tokens, method=...)` computes, as one traceable function."""
  if method not in METHODS:
    raise ConfigError(f"method {method!r} is not one of {METHODS}")
  if method == "beam" and num_beams == 1:
    method = "greedy"  # generate's canonical form: one beam is greedy search
  settings = {"greedy": dict(temperature=0.0),
              "beam": dict(num_beams=int(num_beams), alpha=float(alpha))}[method]

  # generate()'s own program, not a copy: the artifact's ids equal the live model's. It takes
  # the params as the checkpoint stores them (and the artifact ships them): scanned layer
  # stacks are sliced inside it. XLA's attention: one program for every platform it is
  # exported for (cuDNN's kernel would tie it to the GPU it was exported on).
  config = config.replace(attention_implementation="xla")
  run = decoding.generate_program(config, method, int(max_decode_length),
                                  tuple(sorted(settings.items())))

  def generate(params, tokens):
    return run(params, tokens, jax.random.key(0))  # greedy and beam draw no random numbers
  return generate


def per_row_function(fn, config: ModelConfig):
  """fn(params, tokens) of a model whose params carry one adapter per row, as
  fn(bank params, adapter_ids, tokens): the adapters' leaves stacked on an adapter axis
  (adapter_batch.AdapterBank.stacked, joined to the base) and gathered per row inside."""
  from t5lite.interop.peft import adapter_batch

  def generate(params, adapter_ids, tokens):
    base, stacked = adapters_lib.split(params)
    return fn(adapters_lib.combine(base, adapter_batch.gather(stacked, adapter_ids, config)),
              tokens)
  return generate


def export_function(fn, params, input_length: int,
                    platforms: Sequence[str] = PLATFORMS,
                    per_row: bool = False) -> jax.export.Exported:
  """fn(params, tokens) exported for tokens (b, input_length) int32, b symbolic (any b >= 1);
  per_row: fn(params, adapter_ids, tokens) with adapter_ids (b,) int32.

  When lowering for a platform other than cpu fails on this machine, the export falls back to
  cpu alone with a warning (`Exported.platforms` and the manifest say which it holds) rather
  than failing.
  """
  batch, = jax.export.symbolic_shape("b")
  tokens = jax.ShapeDtypeStruct((batch, input_length), jnp.int32)
  # Shapes and dtypes only: the artifact is free of the exporting machine's devices.
  specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  args = (specs, jax.ShapeDtypeStruct((batch,), jnp.int32), tokens) if per_row else (
      specs, tokens)
  try:
    return jax.export.export(jax.jit(fn), platforms=tuple(platforms))(*args)
  except Exception as error:  # noqa: BLE001 - any lowering failure: fall back to cpu alone
    if tuple(platforms) == ("cpu",) or "cpu" not in platforms:
      raise
    warnings.warn(f"lowering for {tuple(platforms)} failed ({type(error).__name__}: {error}); "
                  "exporting for cpu only")
    return jax.export.export(jax.jit(fn), platforms=("cpu",))(*args)


def flat_params(params) -> dict[str, np.ndarray]:
  """{"encoder/layers_0/...": array}: host copies, each in its own dtype (bf16 stays bf16)."""
  flat = traverse_util.flatten_dict(params, sep=KEY_SEPARATOR)
  return {key: np.asarray(jax.device_get(value)) for key, value in sorted(flat.items())}


def export_serving(checkpoint_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                   input_length: int, max_decode_length: int,
                   methods: Sequence[str] = METHODS, num_beams: int = 4,
                   alpha: float = 0.6, adapter: str | None = None,
                   adapters: str | dict | None = None) -> dict:
  """Writes the serving artifact of a checkpoint to out_dir (see the module docstring);
  returns its manifest. Refuses an out_dir that already holds files. adapter: a PEFT RUN_DIR
  joined to the base checkpoint; adapters: {name: RUN_DIR} (or 'a=DIR,b=DIR') served per
  row (with `adapter`, a RUN_DIR or one of the names, as what rows default to)."""
  from t5lite.interop.peft import adapter_batch
  _check_settings(input_length, max_decode_length, methods, num_beams)
  out_dir = os.path.abspath(os.fspath(out_dir))
  if os.path.isdir(out_dir) and os.listdir(out_dir):
    raise FileExistsError(f"{out_dir} is not empty; choose a new --out")
  config, params, step, bank, default = adapter_batch.load_model(checkpoint_path, adapter,
                                                                 adapters, None, None)
  if bank is not None:  # the base and every adapter, stacked: gathered per row when run
    params = adapters_lib.combine(bank.base, bank.stacked)
  family = family_of(config)
  if not family.decodes:
    raise ConfigError(f"a serving artifact decodes; a {family.name!r} model cannot")
  if (config.bos_id, config.eos_id) != (decoding.PAD_ID, decoding.EOS_ID):
    # The loader (serving_loader.py, which needs no t5lite) reads T5's ids: 0 pads, 1 ends.
    raise ConfigError(f"the serving artifact decodes with T5's ids (start 0, EOS 1); this model "
                      f"has bos_id={config.bos_id}, eos_id={config.eos_id}")
  vocabulary = _vocabulary_or_none(model_dir.model_dir_of(checkpoint_path))
  # Trace everything before writing anything: a failed export leaves no half artifact.
  exports = {}
  for method in methods:
    fn = serving_function(config, method, max_decode_length=max_decode_length,
                          num_beams=num_beams, alpha=alpha)
    if bank is not None:
      fn = per_row_function(fn, config)
    exports[method] = export_function(fn, params, input_length, per_row=bank is not None)
  manifest = dict(
      format=FORMAT, format_version=FORMAT_VERSION, model_config=config.to_dict(), step=step,
      input_length=input_length, max_decode_length=max_decode_length, methods=list(methods),
      exports={m: m + EXPORT_SUFFIX for m in methods}, num_beams=num_beams, alpha=alpha,
      params=PARAMS_FILE, vocabulary=None if vocabulary is None else VOCABULARY_FILE,
      pad_id=decoding.PAD_ID, eos_id=decoding.EOS_ID, jax_version=jax.__version__,
      # Per-row adapters: the names of the adapter axis (0: the base alone), rows' default.
      adapters=None if bank is None else list(bank.names),
      default_adapter=None if bank is None else default,
      base_rows=None if bank is None else (bank.config.adapter.method == "lora"
                                           and not bank.saved),
      # Where every method runs (all of them, unless a fallback dropped cuda).
      platforms=[p for p in PLATFORMS if all(p in e.platforms for e in exports.values())])
  _write_artifact(out_dir, manifest, params, exports, vocabulary)
  return manifest


def _write_artifact(out_dir: str, manifest: dict, params, exports: dict,
                    vocabulary: Vocabulary | None) -> None:
  os.makedirs(out_dir, exist_ok=True)
  params_path = os.path.join(out_dir, PARAMS_FILE)
  safetensors.numpy.save_file(flat_params(params), params_path,
                              metadata={"format": FORMAT, "key_separator": KEY_SEPARATOR})
  os.chmod(params_path, 0o644)  # safetensors writes 0600; a server may run as another user
  for method, exported in exports.items():
    with open(os.path.join(out_dir, manifest["exports"][method]), "wb") as f:
      f.write(exported.serialize())
  if vocabulary is not None:
    vocabulary.save(out_dir)
  shutil.copyfile(os.path.join(os.path.dirname(__file__), LOADER_FILE),
                  os.path.join(out_dir, LOADER_FILE))
  # Written last, so that an artifact with a manifest is whole.
  model_dir.write_json(os.path.join(out_dir, MANIFEST_FILE),
                       {**manifest, "files": _checksums(out_dir)})


def _checksums(out_dir: str) -> dict:
  """{file name: {"size", "sha256"}} of every file in out_dir (sha256: hashlib alone, so the
  loader needs no other package to check them)."""
  listed = {}
  for name in sorted(os.listdir(out_dir)):
    with open(os.path.join(out_dir, name), "rb") as f:
      listed[name] = {"size": os.path.getsize(f.name),
                      "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
  return listed


def _check_settings(input_length: int, max_decode_length: int, methods: Sequence[str],
                    num_beams: int) -> None:
  if input_length < 1 or max_decode_length < 1:
    raise ConfigError(f"input_length and max_decode_length must be positive, got "
                      f"{input_length} and {max_decode_length}")
  unknown = [m for m in methods if m not in METHODS]
  if unknown or not methods or len(set(methods)) != len(methods):
    raise ConfigError(f"methods {list(methods)}: choose one or more of {METHODS}, each once")
  if "beam" in methods and num_beams < 1:
    raise ConfigError(f"num_beams must be positive, got {num_beams}")


def _vocabulary_or_none(directory: str) -> Vocabulary | None:
  """The MODEL_DIR's vocabulary; None (ids in, ids out only) for a MODEL_DIR without one."""
  try:
    return load_vocabulary(directory)
  except FileNotFoundError:
    warnings.warn(f"{directory} has no vocabulary: the artifact serves token ids only")
    return None


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="t5lite export serving",
      description="Write a jax.export serving artifact (params, vocabulary, greedy/beam "
                  "decode functions over any batch size, and a loader that needs no t5lite).")
  parser.add_argument("--checkpoint", required=True,
                      help="MODEL_DIR (its newest step) or MODEL_DIR/checkpoints/STEP")
  parser.add_argument("--out", required=True, help="the artifact's folder (new or empty)")
  parser.add_argument("--input_length", type=int, default=512,
                      help="inputs are padded to this many tokens (EOS included); longer "
                           "inputs are refused")
  parser.add_argument("--max_decode_length", type=int, default=128)
  parser.add_argument("--methods", default=",".join(METHODS),
                      help=f"comma-separated, from {','.join(METHODS)}")
  parser.add_argument("--num_beams", type=int, default=4)
  parser.add_argument("--alpha", type=float, default=0.6, help="beam length penalty exponent")
  parser.add_argument("--adapter", default=None, metavar="RUN_DIR",
                      help="a PEFT run's RUN_DIR: its adapters joined to the base --checkpoint "
                      "(with --adapters: what rows that name none use; a name or a RUN_DIR)")
  parser.add_argument("--adapters", default=None, metavar="NAME=RUN_DIR,...",
                      help="adapters of the base --checkpoint (one kind), served per row: the "
                      "functions take (params, adapter_ids, tokens)")
  return parser


def main(argv: list[str]) -> int:
  from t5lite.runtime.model_dir import check_location
  args = _parser().parse_args(argv)
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  check_location(args.out, "--out")
  if paths.is_url(args.out):  # (a local --out: export_serving refuses one that is not empty)
    staging.check_empty(args.out)
  with staging.upload(args.out) as out:  # a bucket URL: written here, then uploaded
    manifest = export_serving(args.checkpoint, out, input_length=args.input_length,
                              max_decode_length=args.max_decode_length, methods=methods,
                              num_beams=args.num_beams, alpha=args.alpha,
                              adapter=args.adapter, adapters=args.adapters)
  print(f"wrote serving artifact {paths.absolute(args.out)}: step {manifest['step']}, "
        f"methods {','.join(manifest['methods'])}, platforms {','.join(manifest['platforms'])}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
