"""`t5lite export hf | peft | params | serving | student`: checkpoints out to other formats.

  t5lite export hf --checkpoint MODEL_DIR[/checkpoints/STEP] --out DIR [--max_shard_size 5GB]
                   [--merge]   (a LoRA run: its adapters folded into the weights)
  t5lite export peft --checkpoint RUN_DIR --out DIR   (a PEFT run's adapter, for the peft library)
  t5lite export params --checkpoint MODEL_DIR[/checkpoints/STEP] --out DIR [--dtype bfloat16]
  t5lite export serving --checkpoint MODEL_DIR[/checkpoints/STEP] --out DIR   (see --help)
  t5lite export student --checkpoint TEACHER --out DIR [--layers 0,2,4,7,9,11]

A MODEL_DIR means its newest checkpoint. Nothing is written into a non-empty --out.
Each export ends with one JSON line saying what it wrote.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings

from t5lite.errors import ConfigError
from t5lite.runtime.model_dir import check_location
from t5lite.util import progress, staging

FORMATS = {
    "hf": "HF transformers: config.json, model.safetensors and tokenizer files (ELECTRA: one "
          "directory per network)",
    "params": "a params-only MODEL_DIR (no optimizer or data state), optionally cast to bf16",
    "serving": "a jax.export artifact (encode + decode) with params and vocabulary",
    "student": "a distillation student MODEL_DIR made of a teacher's layers (DistilBERT's init)",
    "peft": "a PEFT run's adapter (LoRA, prompt or prefix tuning) as a peft library "
            "directory (adapter_config.json + adapter_model.safetensors), for "
            "PeftModel.from_pretrained on the HF base",
}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}


def main(argv: list[str]) -> int:
  if not argv or argv[0] not in FORMATS:
    return usage(__doc__, FORMATS, argv)
  fmt, rest = argv[0], argv[1:]
  if fmt == "serving":
    from t5lite.interop.serving import artifact as serving
    return serving.main(rest)
  args = _parser(fmt).parse_args(rest)
  _check_empty(args.out)
  with staging.upload(args.out) as out:  # a bucket URL: written here, then uploaded
    if fmt == "hf":
      summary = export_hf(args.checkpoint, out, max_shard_bytes=args.max_shard_size,
                          dtype=args.dtype, merge=args.merge)
    elif fmt == "peft":
      summary = export_peft(args.checkpoint, out)
    elif fmt == "student":
      summary = export_student(args.checkpoint, out, layers=args.layers,
                               keep_token_types=args.keep_token_types,
                               keep_pooler=args.keep_pooler, dtype=args.dtype)
    else:
      summary = export_params(args.checkpoint, out, dtype=args.dtype)
  print(json.dumps(staging.renamed(summary, out, args.out)))
  return 0


def usage(doc: str, formats: dict[str, str], argv: list[str]) -> int:
  """The verb's usage and formats: on stdout and 0 for --help, else on stderr and 2."""
  asked = bool(argv) and argv[0] in ("-h", "--help")
  print(doc + "\nformats:\n" + "\n".join(f"  {k:8s} {v}" for k, v in formats.items()),
        file=sys.stdout if asked else sys.stderr)
  return 0 if asked else 2


def export_hf(checkpoint: str, out: str, *, max_shard_bytes: int | None = None,
              dtype: str | None = None, merge: bool = False) -> dict:
  """An HF directory from a t5lite checkpoint: weights, config and tokenizer files. A model
  of several networks (ELECTRA's generator and discriminator) gives one directory each,
  out/<network name>. A LoRA model exports with merge only: its adapters folded into the
  kernels (t5lite.interop.peft.lora_merge.merge)."""
  from t5lite.interop.hf import checkpoints as hf
  from t5lite.interop.hf import tokenizer as hf_tokenizer
  from t5lite.interop.peft import lora_merge
  from t5lite.interop import params_only
  from t5lite.families import family_of
  config, params, step, vocabulary = _load(checkpoint)
  merged = config.adapter is not None
  if merged:
    if config.adapter.method != "lora" or merge:
      config, params = lora_merge.merge(config, params)  # refuses prompts and prefixes
    else:
      raise ConfigError(f"{checkpoint} is a LoRA model (r={config.adapter.r}, target_modules="
                        f"{list(config.adapter.target_modules)}): HF's model has no LoRA. "
                        "Use `t5lite export hf --merge` for the base with the adapters folded "
                        "in, or `t5lite export peft` for the adapters as a peft directory")
  params = params_only.cast_params(params, dtype)
  files = []
  for name, net_config, net_params in family_of(config).networks(params):
    path = os.path.join(out, name) if name else out
    with progress.Progress(f"export hf: {name or 'weights'}", None, "shard") as bar:
      written = hf.write_hf(net_config, net_params, path, max_shard_bytes=max_shard_bytes,
                            progress=bar.done)
    if vocabulary is not None:
      written += hf_tokenizer.write_hf_tokenizer(vocabulary, path)
    files += [os.path.join(name, f) if name else f for f in written]
  return {"export": "hf", "step": step, "out": os.path.abspath(out), "files": sorted(files),
          "merged_lora": merged}


def export_peft(checkpoint: str, out: str) -> dict:
  """The adapter of a PEFT run (a RUN_DIR, or any MODEL_DIR of an adapted model: LoRA, a soft
  prompt or prefixes) as a peft adapter directory; the saved modules (a new head) as peft's
  modules_to_save."""
  import jax

  from t5lite.interop.peft import adapters as peft_io
  from t5lite.interop.peft import record as peft_record
  from t5lite.runtime import model_dir
  config, params, step = peft_record.load_run(checkpoint)
  if config.adapter is None:
    raise ConfigError(f"{checkpoint} holds no adapters (its model config has adapter=None): "
                      "`export peft` writes a PEFT run's adapter; `t5lite export hf` exports "
                      "this model")
  record = peft_record.read(model_dir.model_dir_of(checkpoint)) or {}
  base = record.get("base", "")
  hf_base = bool(base) and os.path.isfile(os.path.join(base, "config.json"))  # peft can load it
  files = peft_io.save(config, jax.device_get(params), out,
                       base_name_or_path=base if hf_base else "",
                       saved_modules=peft_record.saved_prefixes(record))
  return {"export": "peft", "step": step, "out": os.path.abspath(out), "files": files,
          **config.adapter.summary(),
          "saved_modules": record.get("saved_modules", [])}


def export_params(checkpoint: str, out: str, *, dtype: str | None = None) -> dict:
  """A params-only MODEL_DIR: what eval, infer, export and finetuning read, a fraction of a
  training checkpoint's size (Adam keeps two moments per param; Adafactor less)."""
  from t5lite.interop import params_only
  config, params, step, vocabulary = _load(checkpoint)
  params = params_only.cast_params(params, dtype)
  if dtype is not None:
    config = config.replace(param_dtype=dtype)
  path = params_only.write_model_dir(out, config, params, step=step, vocabulary=vocabulary)
  return {"export": "params", "step": step, "out": os.path.abspath(out), "checkpoint": path,
          "param_dtype": config.param_dtype}


def export_student(checkpoint: str, out: str, *, layers: str, keep_token_types: bool = False,
                   keep_pooler: bool = False, dtype: str | None = None) -> dict:
  """A student MODEL_DIR of the teacher's `layers` (t5lite.interop.student); the teacher is a
  t5lite checkpoint or an HF directory."""
  from t5lite.interop import params_only
  from t5lite.interop import student
  from t5lite.runtime import model_dir
  try:
    model_dir.model_dir_of(checkpoint)
    config, params, step, vocabulary = _load(checkpoint)
  except FileNotFoundError:  # an HF directory
    from t5lite.interop.hf.checkpoints import load_hf
    from t5lite.data.vocab.vocabularies import load_vocabulary
    config, params = load_hf(checkpoint)
    step = 0
    try:
      vocabulary = load_vocabulary(checkpoint)
    except FileNotFoundError:
      vocabulary = None
  chosen = student.parse_layers(layers)
  config, params = student.student_from_teacher(config, params, chosen,
                                                keep_token_types=keep_token_types,
                                                keep_pooler=keep_pooler)
  params = params_only.cast_params(params, dtype)
  if dtype is not None:
    config = config.replace(param_dtype=dtype)
  path = params_only.write_model_dir(out, config, params, step=0, vocabulary=vocabulary)
  return {"export": "student", "teacher_step": step, "layers": chosen,
          "out": os.path.abspath(out), "checkpoint": path}


def _load(checkpoint: str):
  """(config, params as numpy, step, vocabulary or None) of a t5lite checkpoint."""
  import jax

  from t5lite.data.vocab.vocabularies import load_vocabulary
  from t5lite.interop.peft import record as peft_record
  from t5lite.runtime import model_dir
  with progress.stage(f"export: reading {checkpoint}"):
    config, params, step = peft_record.load_run(checkpoint)
  try:
    vocabulary = load_vocabulary(model_dir.model_dir_of(checkpoint))
  except FileNotFoundError:
    warnings.warn(f"{model_dir.model_dir_of(checkpoint)} holds no vocabulary; exporting the "
                  "weights without tokenizer files")
    vocabulary = None
  return config, jax.device_get(params), step, vocabulary


def _check_empty(out: str) -> None:
  check_location(out, "--out")
  staging.check_empty(out)


def _size(text: str) -> int:
  """'5GB' -> 5_000_000_000 (decimal units like transformers; KiB/MiB/GiB are binary)."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
  if not match or match.group(2).upper() not in UNITS:
    raise argparse.ArgumentTypeError(f"expected a size like 5GB or 500MB, got {text!r}")
  return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def _parser(fmt: str) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=f"t5lite export {fmt}", description=FORMATS[fmt])
  parser.add_argument("--checkpoint", required=True,
                      help="a MODEL_DIR (its newest step) or MODEL_DIR/checkpoints/STEP")
  parser.add_argument("--out", required=True, help="a new or empty folder")
  if fmt != "peft":  # adapters stay float32, as peft keeps them
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="cast the weights (default: keep the checkpoint's dtype)")
  if fmt == "student":
    parser.add_argument("--layers", default="0,2,4,7,9,11",
                        help="the teacher's layers the student keeps, in order (default: "
                        "DistilBERT's 0,2,4,7,9,11)")
    parser.add_argument("--keep_token_types", action="store_true",
                        help="keep the token-type embeddings (DistilBERT drops them)")
    parser.add_argument("--keep_pooler", action="store_true",
                        help="keep the pooler and its sentence head (DistilBERT drops them)")
  if fmt == "hf":
    parser.add_argument("--max_shard_size", type=_size, default=_size("5GB"),
                        help="split model.safetensors into shards of at most this size "
                        "(default 5GB, as transformers)")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA model: fold its adapters into the kernels (kernel += "
                        "scale * A B) and export the plain model")
  return parser
