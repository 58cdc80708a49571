"""`t5lite import hf | t5x | peft`: checkpoints from elsewhere into a params-only t5lite MODEL_DIR.

  t5lite import hf --from DIR --out MODEL_DIR [--dtype bfloat16] [--max_params N]
  t5lite import t5x --from DIR --out MODEL_DIR   (see --help)
  t5lite import peft --from ADAPTER_DIR --base MODEL_DIR --out RUN_DIR

Checkpoints are untrusted input: the sizes they claim are checked against their files and
the import ceiling (--max_params, else T5LITE_MAX_IMPORT_PARAMS, else 10**11 parameters; see
t5lite/interop/limits.py) before anything is allocated, and no file outside the checkpoint
is read through a symlink.

The MODEL_DIR is what finetune.gin's INITIAL_CHECKPOINT_PATH, eval, infer and export read
(t5lite/interop/params_only.py). Each import ends with one JSON line saying what it wrote.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import warnings

from t5lite.errors import ConfigError
from t5lite.interop import limits
from t5lite.runtime.model_dir import check_location
from t5lite.util import paths, progress, staging

MAX_EXTRA_IDS = 1 << 20  # T5 has 100; each one is a vocabulary entry
FORMATS = {
    "hf": ("an HF transformers directory (T5, BERT, RoBERTa, ALBERT, GPT-2, LLaMA; safetensors, "
           "or a T5 .bin through weights_only loading)"),
    "t5x": "a T5X checkpoint (msgpack + tensorstore, or T5X's orbax layout)",
    "peft": ("a peft library adapter directory (LoRA, prompt or prefix tuning) onto its base (a t5lite MODEL_DIR, or an HF "
             "directory): a LoRA run's RUN_DIR that eval, infer, export and training read"),
}


def main(argv: list[str]) -> int:
  if not argv or argv[0] not in FORMATS:
    from t5lite.cli.export import usage
    return usage(__doc__, FORMATS, argv)
  fmt, rest = argv[0], argv[1:]
  if fmt == "t5x":
    from t5lite.interop.t5x import checkpoints as t5x
    return t5x.main(rest)
  if fmt == "peft":
    return _main_peft(rest)
  parser = argparse.ArgumentParser(prog="t5lite import hf", description=FORMATS["hf"])
  parser.add_argument("--from", dest="source", required=True, help="the HF model directory")
  parser.add_argument("--out", required=True, help="the new t5lite MODEL_DIR")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                      help="store the params in this dtype (default: the checkpoint's)")
  parser.add_argument("--max_params", type=limits.positive_count, metavar="N",
                      help=limits.MAX_PARAMS_HELP)
  args = parser.parse_args(rest)
  for path, flag in ((args.source, "--from"), (args.out, "--out")):
    check_location(path, flag)
  if paths.is_url(args.out):  # (a local --out: params_only refuses one with checkpoints)
    staging.check_empty(args.out)
  # A bucket URL: the HF folder is fetched to local disk, the MODEL_DIR written there first.
  with staging.download(args.source) as source, staging.upload(args.out) as out:
    report = import_hf(source, out, dtype=args.dtype, max_params=args.max_params)
  report = staging.renamed(staging.renamed(report, source, args.source), out, args.out)
  print(json.dumps(report))
  return 0


def import_hf(source: str, out: str, *, dtype: str | None = None,
              max_params: int | None = None) -> dict:
  """An HF model directory as a params-only MODEL_DIR at step 0, its vocabulary carried along."""
  from t5lite.interop.hf import checkpoints as hf
  from t5lite.interop import params_only
  overrides = {"param_dtype": dtype} if dtype else {}
  with progress.stage(f"import hf: reading {source}"):
    config, params = hf.load_hf(source, max_params=max_params, **overrides)
  vocabulary = hf_vocabulary(source)
  check_vocabulary_fits(config, vocabulary, source)
  if vocabulary is None:
    warnings.warn(f"{source} has no tokenizer files t5lite reads (spiece.model, "
                  "vocab.txt, vocab.json + merges.txt, tokenizer.json): the MODEL_DIR gets no "
                  "vocabulary; copy the model's tokenizer files into that MODEL_DIR (--out) "
                  "before `t5lite infer` (training and eval use their task's vocabulary)")
  with progress.stage(f"import hf: writing {out}"):
    path = params_only.write_model_dir(out, config, params, step=0, vocabulary=vocabulary)
  return {"import": "hf", "from": os.path.abspath(source), "out": os.path.abspath(out),
          "checkpoint": path, "param_dtype": config.param_dtype,
          "vocabulary": repr(vocabulary) if vocabulary else None}


def _main_peft(rest: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="t5lite import peft", description=FORMATS["peft"])
  parser.add_argument("--from", dest="source", required=True,
                      help="the peft adapter directory (adapter_config.json, "
                      "adapter_model.safetensors)")
  parser.add_argument("--base", required=True,
                      help="the model it adapts: a t5lite MODEL_DIR (e.g. from `t5lite import "
                      "hf`) or an HF directory")
  parser.add_argument("--out", required=True, help="the new RUN_DIR (a new or empty folder)")
  args = parser.parse_args(rest)
  for path, flag in ((args.source, "--from"), (args.base, "--base"), (args.out, "--out")):
    check_location(path, flag)
  if paths.is_url(args.out):  # (a local --out: import_peft refuses one that is not empty)
    staging.check_empty(args.out)
  with staging.download(args.source) as source, staging.upload(args.out) as out:
    report = import_peft(source, args.base, out)
  print(json.dumps(staging.renamed(staging.renamed(report, source, args.source), out,
                                   args.out)))
  return 0


def import_peft(source: str, base: str, out: str) -> dict:
  """A LoRA run's RUN_DIR from a peft adapter directory: the adapter half (LoRA and saved
  modules) as a params-only checkpoint at step 0, the adapted model config, and peft.json
  naming the base with the fingerprint of its params as read
  (t5lite.interop.peft.record)."""
  from t5lite.data.vocab.vocabularies import load_vocabulary
  from t5lite.interop import params_only
  from t5lite.interop.peft import adapters as peft_io
  from t5lite.cli.export import _check_empty
  from t5lite.runtime import partitioning
  from t5lite.interop import frozen_model
  from t5lite.interop.peft import record as peft_record
  _check_empty(out)
  where, base_config, host = frozen_model.read(base, role="base")
  if base_config.adapter is not None:
    raise ConfigError(f"--base {base} is itself a LoRA model (its model config has an "
                      "adapter): name the plain model it adapts (its peft.json's 'base')")
  adapter, adapter_params, saved = peft_io.load(source, base_config)
  # Read as peft_record.load_params reads it, so that the fingerprints agree.
  mesh = partitioning.make_mesh(partitioning.MeshConfig())
  base_params = frozen_model.load(where, base_config, host, mesh,
                                  partitioning.logical_axis_rules())
  if where.hf:
    vocabulary = hf_vocabulary(where.path)
    check_vocabulary_fits(base_config, vocabulary, where.path)
  else:
    try:
      vocabulary = load_vocabulary(where.home)
    except FileNotFoundError:
      vocabulary = None
  config = base_config.replace(adapter=adapter)
  path = params_only.write_model_dir(out, config, adapter_params, step=0, vocabulary=vocabulary)
  peft_record.write(out, peft_record.make(where.path, base_config, base_params, adapter, saved))
  return {"import": "peft", "from": os.path.abspath(source), "base": where.path,
          "out": os.path.abspath(out), "checkpoint": path, **adapter.summary(),
          "saved_modules": ["/".join(p) for p in saved]}


def check_vocabulary_fits(config, vocabulary, source: str) -> None:
  """A ConfigError naming the mismatch when a tokenizer's ids do not fit the model's embedding
  rows, or an encoder-only (BERT-style) model's tokenizer lacks [MASK], [CLS] or [SEP]: such a
  model would train and decode on ids it has no rows or meaning for."""
  if vocabulary is None:
    return
  if vocabulary.vocab_size > config.vocab_size:
    raise ConfigError(f"{source}: the tokenizer has {vocabulary.vocab_size} ids but the model's "
                      f"embedding has {config.vocab_size} rows (config.json vocab_size): ids "
                      f"{config.vocab_size} to {vocabulary.vocab_size - 1} would index past it. "
                      "Put the model's own tokenizer files beside it")
  if 2 * vocabulary.vocab_size < config.vocab_size:  # padding rows are a few, not half
    warnings.warn(f"{source}: the tokenizer has {vocabulary.vocab_size} ids for the model's "
                  f"{config.vocab_size} embedding rows: is it this model's tokenizer? (models "
                  "pad a few rows past their tokenizer, e.g. T5's 32,100 ids in 32,128 rows)")
  if config.architecture == "encoder_only":
    missing = [name for name, token_id in (("[MASK]", vocabulary.mask_id), ("[CLS]",
               vocabulary.cls_id), ("[SEP]", vocabulary.sep_id)) if token_id is None]
    if missing:
      raise ConfigError(f"{source}: the tokenizer has no {', '.join(missing)}, which an "
                        "encoder-only model's inputs and masking need. Put the model's own "
                        "tokenizer files beside it")


def hf_vocabulary(source: str):
  """The vocabulary of an HF directory: spiece.model (extra ids from tokenizer_config.json,
  else T5's 100), ByT5's bytes, BERT's vocab.txt, GPT-2 / RoBERTa's vocab.json + merges.txt,
  any other fast tokenizer's tokenizer.json (LLaMA, Mistral, ...), or LLaMA's tokenizer.model
  alone (converted by transformers); None when none is there."""
  from t5lite.data.vocab.hf_vocabularies import ByteLevelBPEVocabulary, WordPieceVocabulary
  from t5lite.data.vocab.tokenizer_json import TokenizerJsonVocabulary
  from t5lite.data.vocab.vocabularies import ByteVocabulary, SentencePieceVocabulary
  # Both are refused if they are symlinks out of `source` (limits.file_inside).
  config_path = limits.file_inside(source, "tokenizer_config.json")
  spiece = limits.file_inside(source, "spiece.model")
  tokenizer_config = {}
  if config_path is not None and os.path.isfile(config_path):
    tokenizer_config = limits.read_json(config_path)
    if not isinstance(tokenizer_config, dict):
      raise ConfigError(f"{config_path}: a JSON {type(tokenizer_config).__name__}, not an "
                        "object of settings")
  extra_ids = tokenizer_config.get("extra_ids")
  if extra_ids is not None and (isinstance(extra_ids, bool) or not isinstance(extra_ids, int)
                                or not 0 <= extra_ids <= MAX_EXTRA_IDS):
    raise ConfigError(f"{config_path}: extra_ids={extra_ids!r} is not a count of sentinel "
                      f"ids (an integer, 0 to {MAX_EXTRA_IDS})")
  if spiece is not None and os.path.isfile(spiece):
    return SentencePieceVocabulary(spiece, 100 if extra_ids is None else extra_ids)
  if tokenizer_config.get("tokenizer_class") == "ByT5Tokenizer":
    return ByteVocabulary(125 if extra_ids is None else extra_ids)  # ByT5's default
  limits.file_inside(source, "special_tokens_map.json")  # read by tokenizer.json's kind
  # BERT's vocab.txt, or GPT-2 / RoBERTa's vocab.json + merges.txt, read as an HF tokenizer
  # folder (never a vocabulary.json in it, whose file names could point anywhere); each file
  # is refused if a symlink leads out of `source`, as the files above.
  for kind, names in ((WordPieceVocabulary, ("vocab.txt",)),
                      (ByteLevelBPEVocabulary, ("vocab.json", "merges.txt")),
                      (TokenizerJsonVocabulary, ("tokenizer.json",))):
    paths = [limits.file_inside(source, name) for name in names]
    if all(p is not None and os.path.isfile(p) for p in paths):
      return kind._load_hf_directory(pathlib.Path(source))
  model = limits.file_inside(source, "tokenizer.model")
  if model is not None and os.path.isfile(model):
    return _converted_tokenizer_model(source)
  return None


def _converted_tokenizer_model(source: str):
  """A folder with LLaMA's tokenizer.model but no tokenizer.json (older checkpoints): the fast
  tokenizer transformers makes of it, as AutoTokenizer does when it loads the folder (its
  converter is the reference; t5lite does not rewrite it). Without transformers: a warning
  naming the fix, and None."""
  from t5lite.data.vocab.tokenizer_json import TokenizerJsonVocabulary
  try:
    import transformers
  except ImportError:
    warnings.warn(f"{source} has a tokenizer.model but no tokenizer.json: install transformers "
                  "(pip install transformers) to convert it on import, or save the tokenizer "
                  "with transformers first")
    return None
  tokenizer = transformers.AutoTokenizer.from_pretrained(source, local_files_only=True)
  if not hasattr(tokenizer, "backend_tokenizer"):
    raise ConfigError(f"{source}/tokenizer.model: transformers loads it as "
                      f"{type(tokenizer).__name__}, which has no tokenizer.json form")
  roles = {key[:-len("_token")]: token for key, token in tokenizer.special_tokens_map.items()
           if key.endswith("_token") and isinstance(token, str)}
  return TokenizerJsonVocabulary(tokenizer.backend_tokenizer.to_str(), roles,
                                 os.path.join(source, "tokenizer.model"))
