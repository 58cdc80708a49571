"""Whole HF directories through `t5lite import hf` and `t5lite export hf` (in process): a
BERT with its vocab.txt and a GPT-2 with its vocab.json + merges.txt become MODEL_DIRs that
carry their vocabulary, and come back as directories that transformers' AutoTokenizer and
AutoModel load, encoding and predicting as before."""
import os

import numpy as np
import pytest
import torch
import transformers

import t5lite
from t5lite.data.vocab.hf_training import train_byte_level_bpe, train_wordpiece
from t5lite.data.sources.stdlib_corpus import stdlib_documents
from t5lite.data.vocab.vocabularies import load_vocabulary
from t5lite.cli.export import export_hf
from t5lite.interop.hf.tokenizer import write_hf_tokenizer
from t5lite.cli.imports import import_hf

pytestmark = pytest.mark.parity

TEXT = "The quick brown fox: it jumps over 12 lazy dogs, naïvely."


@pytest.fixture(scope="module")
def texts():
  return [d["text"] for d in stdlib_documents()[:200]]


def _hf_model(kind: str, vocab_size: int, special):
  torch.manual_seed(0)
  if kind == "bert":
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=24, num_hidden_layers=2,
                                     num_attention_heads=3, intermediate_size=40,
                                     max_position_embeddings=64, pad_token_id=special)
    return transformers.BertForPreTraining(config).eval(), transformers.AutoModelForPreTraining
  config = transformers.GPT2Config(vocab_size=vocab_size, n_embd=24, n_layer=2, n_head=3,
                                   n_positions=64, bos_token_id=special, eos_token_id=special)
  return transformers.GPT2LMHeadModel(config).eval(), transformers.AutoModelForCausalLM


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_import_then_export_carries_the_vocabulary_and_the_model(kind, texts, tmp_path):
  vocabulary = (train_wordpiece(texts, 600) if kind == "bert"
                else train_byte_level_bpe(texts, 600))
  special = vocabulary.pad_id if kind == "bert" else vocabulary.eos_id
  model, auto = _hf_model(kind, vocabulary.vocab_size, special)
  source = tmp_path / "hf"
  model.save_pretrained(source)
  write_hf_tokenizer(vocabulary, str(source))

  summary = import_hf(str(source), str(tmp_path / "model_dir"))
  assert summary["vocabulary"] is not None
  carried = load_vocabulary(tmp_path / "model_dir")
  assert carried == vocabulary
  out = tmp_path / "back"
  files = export_hf(str(tmp_path / "model_dir"), str(out))["files"]
  assert ("vocab.txt" in files) if kind == "bert" else {"vocab.json", "merges.txt"} <= set(files)

  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
  assert ids == vocabulary.encode(TEXT).tolist()
  reloaded, info = auto.from_pretrained(out, output_loading_info=True)
  assert not any(info.values()), info
  batch = torch.tensor([ids])
  with torch.no_grad():
    before, after = model(input_ids=batch), reloaded.eval()(input_ids=batch)
  key = "prediction_logits" if kind == "bert" else "logits"
  np.testing.assert_allclose(after[key].numpy(), before[key].numpy(), rtol=0, atol=1e-6)
  config, params = t5lite.load_hf(str(out))
  ours = t5lite.logits(config, params, np.array([ids]))
  assert np.abs(ours - before[key].numpy()).max() <= 1e-4 * np.abs(before[key].numpy()).max()
  assert os.path.isfile(out / "config.json")


def test_a_bert_whose_vocab_txt_lacks_its_specials_is_refused(tmp_path):
  """An encoder-only model's inputs and masking need [CLS], [SEP] and [MASK]: a vocab.txt
  without them (another model's word list) is refused by name, nothing written."""
  words = ["[PAD]", "[UNK]"] + [f"w{i}" for i in range(46)] + ["##s", "the"]
  model, _ = _hf_model("bert", 64, 0)
  model.save_pretrained(tmp_path / "hf")
  (tmp_path / "hf" / "vocab.txt").write_text("\n".join(words) + "\n")
  with pytest.raises(ValueError, match=r"the tokenizer has no \[MASK\], \[CLS\], \[SEP\], "
                     "which an encoder-only model's inputs and masking need"):
    import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()
