"""HF tokenizers that come as tokenizer.json only (t5lite.data.vocab.tokenizer_json): a
LLaMA-2 tokenizer (SentencePiece BPE converted by transformers' LlamaTokenizerFast) and a
byte-level BPE saved as a plain PreTrainedTokenizerFast encode and decode as HF's; `t5lite
import hf` of a LLaMA folder carries its tokenizer into MODEL_DIR (tokenizer.json, or an older
folder's tokenizer.model, converted), and `t5lite infer` then prints what HF's generate +
decode give."""
import json
import pickle

import pytest
import sentencepiece as spm
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from t5lite import cli
from t5lite.data.vocab.tokenizer_json import TokenizerJsonVocabulary
from t5lite.data.vocab.vocabularies import load_vocabulary
from t5lite.errors import ConfigError

pytestmark = pytest.mark.parity

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Return a list of the words in it.",
          "Naïve café owners sell crème brûlée; 東京 is far.",
          "x = 3 * (y + 2)  # tabs\tand", "    indented code with    runs of spaces",
          "Numbers: 1234567890, 3.14159."] * 40
TEXTS = ["The lazy café dog.", "  two leading spaces", "trailing space ", "tabs\tand\nlines",
         "emoji 🦙 and 東京 outside the pieces", "</s> typed as text, and <s>", "", "a"]


def _llama_2(tmp_path):
  """A LLaMA-2-style folder's tokenizer: sentencepiece BPE with LLaMA's ids (unk 0, bos 1,
  eos 2, byte fallback) and LLaMA-2's tokenizer_config.json, loaded by transformers (which
  converts tokenizer.model) and saved again, as transformers saves it: tokenizer.json and
  tokenizer_config.json, no tokenizer.model."""
  source = tmp_path / "llama_source"
  source.mkdir()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS), model_prefix=str(source / "tokenizer"), vocab_size=320,
      model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True,
      character_coverage=1.0, minloglevel=2)
  (source / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
      "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": False}))
  folder = tmp_path / "llama"
  transformers.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
  assert not (folder / "tokenizer.model").exists()
  return folder


def _byte_level(tmp_path):
  """A GPT-NeoX / LLaMA-3 style byte-level BPE, saved as HF saves such a tokenizer."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|begin|>", "<|end|>", "<|pad|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin|>",
                                            eos_token="<|end|>", pad_token="<|pad|>")
  folder = tmp_path / "byte_level"
  hf.save_pretrained(folder)
  return folder


@pytest.mark.parametrize("make", [_llama_2, _byte_level], ids=["llama_2", "byte_level"])
def test_a_tokenizer_json_encodes_and_decodes_as_hf(make, tmp_path):
  folder = make(tmp_path)
  assert not (folder / "vocab.json").exists() and not (folder / "vocab.txt").exists()
  hf = transformers.AutoTokenizer.from_pretrained(folder)
  vocabulary = load_vocabulary(folder)
  assert isinstance(vocabulary, TokenizerJsonVocabulary)
  assert vocabulary.vocab_size == len(hf)
  assert vocabulary.bos_id == hf.bos_token_id and vocabulary.eos_id == hf.eos_token_id
  assert vocabulary.pad_id == hf.pad_token_id and vocabulary.unk_id == hf.unk_token_id
  for text in TEXTS:
    ids = hf(text, add_special_tokens=False).input_ids
    assert len(ids) >= len(text.split()), (text, ids)  # a real tokenizer, not an empty one
    assert vocabulary.encode(text).tolist() == ids, text
    upto_eos = ids[:ids.index(hf.eos_token_id)] if hf.eos_token_id in ids else ids
    assert vocabulary.decode(ids) == hf.decode(upto_eos, skip_special_tokens=True), text
  # decode stops at the first EOS, as generation does; special tokens are skipped.
  ids = hf("fox dog", add_special_tokens=False).input_ids
  row = [hf.bos_token_id, *ids, hf.eos_token_id, *ids]
  assert vocabulary.decode(row) == hf.decode(ids, skip_special_tokens=True)
  vocabulary.save(tmp_path / "saved")
  assert json.loads((tmp_path / "saved" / "vocabulary.json").read_text())["kind"] == (
      "tokenizer_json")
  assert load_vocabulary(tmp_path / "saved") == vocabulary
  assert pickle.loads(pickle.dumps(vocabulary)) == vocabulary


def test_a_damaged_tokenizer_json_or_role_is_refused_in_one_line(tmp_path):
  folder = _byte_level(tmp_path)
  config = json.loads((folder / "tokenizer_config.json").read_text())
  (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|nope|>"}))
  with pytest.raises(ConfigError, match="eos_token '<|nope|>' is not one of its tokens"):
    load_vocabulary(folder)
  (folder / "tokenizer.json").write_text('{"model": ')
  with pytest.raises(ConfigError, match="is not a tokenizer.json that HF `tokenizers` loads"):
    load_vocabulary(folder)


def test_import_hf_of_a_llama_folder_brings_its_tokenizer_and_infer_equals_hf(tmp_path):
  folder = _llama_2(tmp_path)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
      vocab_size=len(hf_tokenizer), hidden_size=32, intermediate_size=72, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
      initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))
  model.eval().save_pretrained(folder)
  out = tmp_path / "imported"
  assert cli.main(["import", "hf", "--from", str(folder), "--out", str(out)]) == 0
  assert isinstance(load_vocabulary(out), TokenizerJsonVocabulary)
  prompts = ["The quick brown", "Naïve café 🦙", "x = 3 * (y"]
  (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
  predictions = tmp_path / "predictions.jsonl"
  assert cli.main(["infer", "--gin_file=gin/runs/infer.gin", f"--gin.CHECKPOINT_PATH={out}",
                   f"--gin.INFER_INPUT={tmp_path / 'prompts.txt'}",
                   f"--gin.INFER_OUTPUT={predictions}", "--gin.INPUTS_LENGTH=24",
                   "--gin.MAX_DECODE_LENGTH=9", "--gin.BATCH_SIZE=4"]) == 0
  got = [json.loads(line)["prediction"] for line in predictions.read_text().splitlines()]
  want = []
  for prompt in prompts:
    ids = hf_tokenizer(prompt, return_tensors="pt").input_ids  # <s> first, as HF adds it
    assert ids[0, 0].item() == hf_tokenizer.bos_token_id
    with torch.no_grad():
      output = model.generate(ids, max_new_tokens=9, do_sample=False, pad_token_id=0)
    want.append(hf_tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True))
  assert got == want
  assert any(text.strip() for text in want)  # the comparison is of real text
  assert json.loads((out / "vocabulary.json").read_text())["vocab_size"] == len(hf_tokenizer)
  # An older folder with tokenizer.model alone: converted on import as AutoTokenizer does.
  source = tmp_path / "llama_source"
  assert not (source / "tokenizer.json").exists()
  model.save_pretrained(source)
  assert cli.main(["import", "hf", "--from", str(source), "--out", str(tmp_path / "old")]) == 0
  converted = load_vocabulary(tmp_path / "old")
  assert isinstance(converted, TokenizerJsonVocabulary)
  assert (converted.bos_id, converted.eos_id, converted.unk_id) == (1, 2, 0)
  for text in TEXTS + prompts:
    assert converted.encode(text).tolist() == hf_tokenizer(text, add_special_tokens=False).input_ids
  # `export hf` writes the tokenizer back as it came: HF loads it and encodes the same.
  assert cli.main(["export", "hf", "--checkpoint", str(out), "--out", str(tmp_path / "hf")]) == 0
  exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
  assert (tmp_path / "hf" / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
  for text in TEXTS + prompts:
    assert exported(text).input_ids == hf_tokenizer(text).input_ids
