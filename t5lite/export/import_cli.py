"""`t5lite import hf | t5x`: checkpoints from elsewhere into a params-only t5lite MODEL_DIR.

  t5lite import hf --from DIR --out MODEL_DIR [--dtype bfloat16]
  t5lite import t5x --from DIR --out MODEL_DIR   (see --help)

The MODEL_DIR is what finetune.gin's INITIAL_CHECKPOINT_PATH, eval, infer and export read
(t5lite/export/params_only.py). Each import ends with one JSON line saying what it wrote.
"""
from __future__ import annotations

import argparse
import json
import os
import warnings

FORMATS = {
    "hf": "an HF transformers T5 directory (safetensors, or .bin through weights_only loading)",
    "t5x": "a T5X checkpoint (msgpack + tensorstore, or T5X's orbax layout)",
}


def main(argv: list[str]) -> int:
  if not argv or argv[0] not in FORMATS:
    from t5lite.export.export_cli import usage
    return usage(__doc__, FORMATS, argv)
  fmt, rest = argv[0], argv[1:]
  if fmt == "t5x":
    from t5lite.export import t5x
    return t5x.main(rest)
  parser = argparse.ArgumentParser(prog="t5lite import hf", description=FORMATS["hf"])
  parser.add_argument("--from", dest="source", required=True, help="the HF model directory")
  parser.add_argument("--out", required=True, help="the new t5lite MODEL_DIR")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                      help="store the params in this dtype (default: the checkpoint's)")
  args = parser.parse_args(rest)
  print(json.dumps(import_hf(args.source, args.out, dtype=args.dtype)))
  return 0


def import_hf(source: str, out: str, *, dtype: str | None = None) -> dict:
  """An HF T5 directory as a params-only MODEL_DIR at step 0, its vocabulary carried along."""
  from t5lite.export import hf, params_only
  overrides = {"param_dtype": dtype} if dtype else {}
  config, params = hf.load_hf(source, **overrides)
  vocabulary = hf_vocabulary(source)
  if vocabulary is None:
    warnings.warn(f"{source} has no spiece.model and is not ByT5: the MODEL_DIR gets no "
                  "vocabulary, so eval and infer will need T5LITE_VOCAB")
  path = params_only.write_model_dir(out, config, params, step=0, vocabulary=vocabulary)
  return {"import": "hf", "from": os.path.abspath(source), "out": os.path.abspath(out),
          "checkpoint": path, "param_dtype": config.param_dtype,
          "vocabulary": repr(vocabulary) if vocabulary else None}


def hf_vocabulary(source: str):
  """The vocabulary of an HF directory: spiece.model (extra ids from tokenizer_config.json,
  else T5's 100), or ByT5's bytes; None when neither is there."""
  from t5lite.data.vocabularies import ByteVocabulary, SentencePieceVocabulary
  config_path = os.path.join(source, "tokenizer_config.json")
  tokenizer_config = {}
  if os.path.isfile(config_path):
    with open(config_path, encoding="utf-8") as f:
      tokenizer_config = json.load(f)
  extra_ids = tokenizer_config.get("extra_ids")
  if os.path.isfile(os.path.join(source, "spiece.model")):
    return SentencePieceVocabulary(os.path.join(source, "spiece.model"),
                                   100 if extra_ids is None else int(extra_ids))
  if tokenizer_config.get("tokenizer_class") == "ByT5Tokenizer":
    return ByteVocabulary(125 if extra_ids is None else int(extra_ids))  # ByT5's default
  return None
