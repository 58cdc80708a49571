"""A t5lite vocabulary as HF tokenizer files that encode exactly like it.

transformers builds a T5 tokenizer from `spiece.model` through a converter that drops
sentencepiece's byte fallback: a character outside the pieces becomes <unk>
instead of its UTF-8 bytes. So besides `spiece.model` we write `tokenizer.json` ourselves,
straight from the model proto, in the `tokenizers` library's documented JSON format:

  normalizer     the model's precompiled charsmap (NFKC for T5's own), extra-space removal
  pre_tokenizer  Metaspace: spaces become '▁', one '▁' is prepended to the text (not after
                 each sentinel), words split before each '▁' (split_by_whitespace)
  model          Unigram (piece, score) table with byte_fallback, or BPE with merges
  post_processor `$A </s>`: HF's T5 tokenizers append EOS (t5lite's encode does not;
                 seqio appends it in a preprocessor)
  added_tokens   <pad> </s> <unk> and the <extra_id_N> sentinels, matched in the normalized
                 text as sentencepiece matches user-defined pieces

Leading spaces need care: Metaspace prepends no '▁' to text that already starts with one,
nor to text whose first characters a normalizer removed. So the normalizer turns them into
the dummy prefix itself: "  x" -> "▁  x" (-> "▁▁▁x") for models that keep whitespace, and
"  x" -> "▁x" for models that strip it (T5's). It runs on the whole text once; sentinel
contents, normalized too, never start with a space. Saved with tokenizer_class
"PreTrainedTokenizerFast",
which loads tokenizer.json as it is: transformers 5's T5Tokenizer would rebuild the pipeline
around our vocabulary with byte fallback off.

Known differences, none in ordinary text: text that starts with a sentinel lacks the lone
'▁' sentencepiece puts before it, and "</s>", "<pad>", "<unk>" or a byte piece's name
("<0x41>") typed as text become those ids where sentencepiece spells them out (HF's own T5
tokenizers share the first two; tokenizers' Unigram has no way to keep byte pieces out of
its lattice).

A ByteVocabulary is ByT5's layout, which transformers' ByT5Tokenizer reproduces by itself.

The `tokenizers`-backed kinds (t5lite.data.vocab.hf_vocabularies) already are HF's pipelines, so
they are written as HF writes them: a WordPieceVocabulary as BertTokenizer's vocab.txt, and
a ByteLevelBPEVocabulary as GPT2Tokenizer's (or, with RoBERTa's specials,
RobertaTokenizer's) vocab.json + merges.txt, each with tokenizer.json (our tokenizer plus
the post-processor HF's class adds: `[CLS] $A [SEP]`, `<s> $A </s>`, nothing for GPT-2),
tokenizer_config.json and special_tokens_map.json. transformers' AutoTokenizer loads them
and encodes as the vocabulary does. A TokenizerJsonVocabulary (an imported LLaMA's, ...) is
written back as it came: its tokenizer.json unchanged, with its special tokens' roles.
"""
from __future__ import annotations

import json
import os

from sentencepiece import sentencepiece_model_pb2 as spm_pb2
from tokenizers import Tokenizer, processors

from t5lite.data.vocab.hf_vocabularies import ByteLevelBPEVocabulary, WordPieceVocabulary
from t5lite.data.vocab.tokenizer_json import TokenizerJsonVocabulary
from t5lite.data.vocab.vocabularies import ByteVocabulary, SentencePieceVocabulary, Vocabulary
from t5lite.errors import ConfigError

SPACE = "\u2581"  # '▁', sentencepiece's visible space
Piece = spm_pb2.ModelProto.SentencePiece
SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


def write_hf_tokenizer(vocabulary: Vocabulary, out: str, *, model_max_length: int = 512) -> list[str]:
  """Writes the tokenizer files of `vocabulary` into `out`; returns the file names."""
  if isinstance(vocabulary, TokenizerJsonVocabulary):  # imported from HF: as it came
    specials = {_HF_ROLE[role]: token for role, token in vocabulary.roles.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
              "model_max_length": model_max_length}
    return _write_files(out, {
        "tokenizer.json": vocabulary.tokenizer_json,
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(specials, indent=2, ensure_ascii=False)})
  if isinstance(vocabulary, (WordPieceVocabulary, ByteLevelBPEVocabulary)):
    return _write_files(out, _tokenizers_files(vocabulary, model_max_length))
  extras = [f"<extra_id_{i}>" for i in range(vocabulary.extra_ids)]
  config = {**SPECIAL_TOKENS, "extra_ids": vocabulary.extra_ids,
            "additional_special_tokens": extras, "model_max_length": model_max_length}
  if isinstance(vocabulary, SentencePieceVocabulary):
    files = {"spiece.model": vocabulary.serialized_model,
             "tokenizer.json": json.dumps(tokenizer_json(vocabulary), ensure_ascii=False)}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
  elif isinstance(vocabulary, ByteVocabulary):
    files = {}
    config["tokenizer_class"] = "ByT5Tokenizer"
  else:
    raise ConfigError(f"{type(vocabulary).__name__} has no HF tokenizer equivalent")
  files["tokenizer_config.json"] = json.dumps(config, indent=2)
  files["special_tokens_map.json"] = json.dumps(
      {**SPECIAL_TOKENS, "additional_special_tokens": extras}, indent=2)
  return _write_files(out, files)


def _write_files(out: str, files: dict[str, str | bytes]) -> list[str]:
  for name, content in files.items():
    mode = "wb" if isinstance(content, bytes) else "w"
    with open(os.path.join(out, name), mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
      f.write(content)
  return sorted(files)


# HF's names of the special-token roles (tokenizer_config.json, special_tokens_map.json).
_HF_ROLE = {"pad": "pad_token", "eos": "eos_token", "unk": "unk_token", "bos": "bos_token",
            "mask": "mask_token", "cls": "cls_token", "sep": "sep_token"}


def _tokenizers_files(vocabulary: WordPieceVocabulary | ByteLevelBPEVocabulary,
                      model_max_length: int) -> dict[str, str]:
  """The files transformers' BertTokenizer / GPT2Tokenizer / RobertaTokenizer save."""
  tokens = vocabulary.tokens
  specials = {_HF_ROLE[role]: tokens[i] for role, i in vocabulary.special_tokens.items()}
  tokenizer = Tokenizer.from_str(vocabulary.tokenizer.to_str())  # a copy to add to
  if isinstance(vocabulary, WordPieceVocabulary):
    specials.pop("eos_token", None)  # [SEP] is t5lite's EOS for BERT; BertTokenizer has none
    files = {"vocab.txt": "".join(t + "\n" for t in tokens)}
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": vocabulary.lowercase,
              "strip_accents": vocabulary.strip_accents, "tokenize_chinese_chars": True}
    if vocabulary.cls_id is not None and vocabulary.sep_id is not None:
      cls, sep = tokens[vocabulary.cls_id], tokens[vocabulary.sep_id]
      tokenizer.post_processor = processors.TemplateProcessing(
          single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
          special_tokens=[(cls, vocabulary.cls_id), (sep, vocabulary.sep_id)])
  else:
    merges = "".join(f"{left} {right}\n" for left, right in vocabulary.merges)
    files = {"vocab.json": json.dumps(dict(zip(tokens, range(len(tokens)))), ensure_ascii=False),
             "merges.txt": "#version: 0.2\n" + merges}
    config = {"add_prefix_space": False}
    if vocabulary.style == "roberta":
      config["tokenizer_class"] = "RobertaTokenizer"
      tokenizer.post_processor = processors.RobertaProcessing(  # (sep, cls): no keywords
          (tokens[vocabulary.sep_id], vocabulary.sep_id),
          (tokens[vocabulary.cls_id], vocabulary.cls_id), trim_offsets=True,
          add_prefix_space=False)
    else:
      config["tokenizer_class"] = "GPT2Tokenizer"  # adds no special tokens
      tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
  config.update(specials, model_max_length=model_max_length)
  files["tokenizer.json"] = tokenizer.to_str()
  files["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False)
  files["special_tokens_map.json"] = json.dumps(specials, indent=2, ensure_ascii=False)
  return files


def tokenizer_json(vocabulary: SentencePieceVocabulary) -> dict:
  """The tokenizers-library JSON of a sentencepiece vocabulary, extra ids included."""
  proto = spm_pb2.ModelProto()
  proto.ParseFromString(vocabulary.serialized_model)
  trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
  if not trainer.split_by_whitespace:
    raise ConfigError("sentencepiece models trained with split_by_whitespace=false have no "
                      "tokenizer.json equivalent (HF's Metaspace always splits at spaces)")
  base = len(proto.pieces)
  extras = [(base + vocabulary.extra_ids - 1 - i, f"<extra_id_{i}>")
            for i in range(vocabulary.extra_ids)]
  added = [(i, p.piece) for i, p in enumerate(proto.pieces)
           if p.type in (Piece.CONTROL, Piece.UNKNOWN, Piece.USER_DEFINED)]
  return {
      "version": "1.0",
      "truncation": None,
      "padding": None,
      "added_tokens": [_added_token(i, text) for i, text in sorted(added + extras)],
      "normalizer": _normalizer(normalizer),
      "pre_tokenizer": {"type": "Metaspace", "replacement": SPACE, "split": True,
                        "prepend_scheme": "first" if normalizer.add_dummy_prefix else "never"},
      "post_processor": {
          "type": "TemplateProcessing",
          "single": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "</s>", "type_id": 0}}],
          "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "</s>", "type_id": 0}},
                   {"Sequence": {"id": "B", "type_id": 0}},
                   {"SpecialToken": {"id": "</s>", "type_id": 0}}],
          "special_tokens": {"</s>": {"id": "</s>", "ids": [vocabulary.eos_id],
                                      "tokens": ["</s>"]}},
      },
      "decoder": {"type": "Sequence", "decoders": [
          {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
          {"type": "ByteFallback"},
          {"type": "Fuse"},
          *([{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
            if normalizer.add_dummy_prefix else []),
      ]},
      "model": _model(proto, extras),
  }


def _added_token(i: int, text: str) -> dict:
  return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": True, "special": True}


def _normalizer(spec) -> dict | None:
  steps = []
  if spec.precompiled_charsmap:
    import base64
    steps.append({"type": "Precompiled",
                  "precompiled_charsmap": base64.b64encode(spec.precompiled_charsmap).decode()})
  # \A, not ^: Oniguruma's ^ also matches after every newline.
  if spec.remove_extra_whitespaces:
    # sentencepiece strips leading/trailing spaces and squeezes runs of them to one.
    steps += [{"type": "Strip", "strip_left": False, "strip_right": True},
              {"type": "Replace", "pattern": {"Regex": r"\A +"},
               "content": SPACE if spec.add_dummy_prefix else ""},
              {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]
  elif spec.add_dummy_prefix:
    steps.append({"type": "Replace", "pattern": {"Regex": r"\A "}, "content": SPACE + " "})
  return {"type": "Sequence", "normalizers": steps} if steps else None


def _model(proto, extras: list[tuple[int, str]]) -> dict:
  trainer = proto.trainer_spec
  pieces = [(p.piece, p.score) for p in proto.pieces]
  pieces += [(text, 0.0) for _, text in sorted(extras)]
  if trainer.model_type == spm_pb2.TrainerSpec.UNIGRAM:
    return {"type": "Unigram", "unk_id": trainer.unk_id, "vocab": [list(p) for p in pieces],
            "byte_fallback": trainer.byte_fallback}
  if trainer.model_type == spm_pb2.TrainerSpec.BPE:
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    return {"type": "BPE", "dropout": None, "unk_token": proto.pieces[trainer.unk_id].piece,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
            "byte_fallback": trainer.byte_fallback, "ignore_merges": False, "vocab": vocab,
            "merges": _bpe_merges(proto, vocab)}
  model_type = spm_pb2.TrainerSpec.ModelType.Name(trainer.model_type)
  raise ConfigError(f"sentencepiece model_type {model_type} has no tokenizer.json equivalent; "
                    "export UNIGRAM or BPE models")


def _bpe_merges(proto, vocab: dict[str, int]) -> list[str]:
  """BPE merges in sentencepiece's priority order (by piece score, best first): every way of
  splitting a normal piece into two known pieces, as transformers' converter derives them."""
  merges = []
  for piece in proto.pieces:
    if piece.type != Piece.NORMAL or len(piece.piece) < 2:
      continue
    for cut in range(1, len(piece.piece)):
      left, right = piece.piece[:cut], piece.piece[cut:]
      if left in vocab and right in vocab:
        merges.append((vocab[left], vocab[right], piece.score, f"{left} {right}"))
  merges.sort(key=lambda m: (-m[2], m[0], m[1]))
  # "left right" strings: every tokenizers version reads them (pairs only from 0.20 on);
  # sentencepiece pieces hold '▁', never an ASCII space.
  return [m[3] for m in merges]
