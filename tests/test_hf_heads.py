"""HF parity of the finetuning heads (t5lite.interop.hf.heads): every `*For<Head>` class of BERT,
RoBERTa, ALBERT, GPT-2 and LLaMA that t5lite has.

For each: a random HF model of odd shapes (hidden 30, 5 heads, 3 labels, every parameter
perturbed, biases included) loads with the same logits; save_hf writes files that the matching
AutoModelFor* loads with no missing, unexpected or mismatched keys and the same logits. The
head losses (family loss_fn on batches named as the head converter names them) equal HF's
`.loss` given the same labels. One `t5lite import hf` / `export hf` CLI round trip."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import t5lite
from t5lite import cli
from t5lite.errors import ConfigError
from t5lite.families import family_of

pytestmark = pytest.mark.parity

T = transformers
LABELS = 3
LENGTH = 7
SHAPE = dict(hidden_size=30, num_hidden_layers=2, num_attention_heads=5, intermediate_size=37)
# family: (config class, class stem, config kwargs)
MODELS = {
    "bert": (T.BertConfig, "Bert", dict(vocab_size=50, type_vocab_size=3,
                                        max_position_embeddings=20, **SHAPE)),
    "roberta": (T.RobertaConfig, "Roberta", dict(vocab_size=50, type_vocab_size=1,
                                                 max_position_embeddings=22, **SHAPE)),
    "albert": (T.AlbertConfig, "Albert", dict(vocab_size=50, embedding_size=14, type_vocab_size=2,
                                              max_position_embeddings=20, **SHAPE)),
    # pad_token_id: the eos id, which export writes as the pad (HF's usual choice).
    "gpt2": (T.GPT2Config, "GPT2", dict(vocab_size=50, n_embd=30, n_layer=2, n_head=5,
                                        n_inner=37, n_positions=20, pad_token_id=49,
                                        bos_token_id=49, eos_token_id=49)),
    "llama": (T.LlamaConfig, "Llama", dict(vocab_size=50, num_key_value_heads=1,
                                           pad_token_id=2, **SHAPE)),
}
HEADS = {"sequence_classification": ("ForSequenceClassification",
                                     T.AutoModelForSequenceClassification),
         "token_classification": ("ForTokenClassification", T.AutoModelForTokenClassification),
         "question_answering": ("ForQuestionAnswering", T.AutoModelForQuestionAnswering),
         "multiple_choice": ("ForMultipleChoice", T.AutoModelForMultipleChoice)}
CASES = [(m, h) for m in ("bert", "roberta", "albert") for h in HEADS] + [
    ("gpt2", "sequence_classification"), ("llama", "sequence_classification")]
# Which HF backbones keep the pooler (HF builds token and QA models, and RoBERTa's sequence
# classifier, with add_pooling_layer=False).
POOLED = {("bert", "sequence_classification"), ("bert", "multiple_choice"),
          ("albert", "sequence_classification"), ("albert", "multiple_choice"),
          ("roberta", "multiple_choice")}


def make_hf(family, head, seed=0, **config):
  config_cls, stem, kwargs = MODELS[family]
  suffix, _ = HEADS[head]
  torch.manual_seed(seed)
  labels = 2 if head == "question_answering" else LABELS  # HF's QA outputs are its 2 labels
  config = {"num_labels": labels, **kwargs, **config}
  model = getattr(T, stem + suffix)(config_cls(**config))
  with torch.no_grad():  # biases off 0 and norm scales off 1, so that a swapped one shows
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  return model.eval()


def hf_inputs(family, head, batch=2, seed=1):
  """ids (B, L) or (B, C, L) for multiple choice, without 0 (padding) or 1 (RoBERTa's pad);
  token types for models with more than one (None for multiple choice: t5lite.logits takes
  (B, L) types only, and both sides default to zeros)."""
  rng = np.random.RandomState(seed)
  shape = (batch, 3, LENGTH) if head == "multiple_choice" else (batch, LENGTH)
  ids = rng.randint(2, 50, shape)
  types_n = MODELS[family][2].get("type_vocab_size", 0)
  types = rng.randint(0, types_n, shape) if types_n > 1 and head != "multiple_choice" else None
  return ids, types


def hf_logits(model, ids, types):
  kwargs = {} if types is None else {"token_type_ids": torch.tensor(types)}
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), **kwargs)
  if hasattr(out, "start_logits"):  # ours are (B, L, 2): start, end
    return np.stack([out.start_logits.numpy(), out.end_logits.numpy()], -1)
  return out.logits.numpy()


def assert_close(got, want, tolerance=1e-4):
  assert got.shape == want.shape
  assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


@pytest.mark.parametrize("family, head", CASES)
def test_head_models_load_and_save_hf_exact(family, head, tmp_path):
  model = make_hf(family, head)
  model.save_pretrained(tmp_path / "hf")
  ids, types = hf_inputs(family, head)
  want = hf_logits(model, ids, types)

  config, params = t5lite.load_hf(str(tmp_path / "hf"))
  assert (config.family, config.head, config.num_labels) == (family, head,
                                                             model.config.num_labels)
  if config.architecture == "encoder_only":
    assert config.pooler == ((family, head) in POOLED)
  assert_close(t5lite.logits(config, params, ids, token_type_ids=types), want)

  t5lite.save_hf(config, params, str(tmp_path / "out"))
  saved = json.loads((tmp_path / "out" / "config.json").read_text())
  assert saved["architectures"] == [type(model).__name__]
  back, info = HEADS[head][1].from_pretrained(tmp_path / "out", output_loading_info=True)
  assert type(back) is type(model)
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  assert back.config.num_labels == model.config.num_labels
  assert_close(hf_logits(back.eval(), ids, types), want)


# --- losses --------------------------------------------------------------------------------

def encoder_batch(ids, types, lengths):
  """The head converter's encoder features for rows of the given real lengths (right
  padding, id 0)."""
  real = (np.arange(ids.shape[-1]) < np.asarray(lengths)[..., None]).astype(np.int32)
  real = np.broadcast_to(real, ids.shape)
  return {"encoder_input_tokens": ids * real, "encoder_segment_ids": real,
          "encoder_positions": np.broadcast_to(np.arange(ids.shape[-1]), ids.shape) * real,
          "encoder_token_type_ids": (np.zeros_like(ids) if types is None else types) * real}


def our_loss(config, params, batch):
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  with jax.default_matmul_precision("highest"):
    loss_sum, sums = family_of(config).loss_fn(params, batch, None)
  return float(loss_sum / sums["normalizer"])


def hf_loss(model, batch, prefix, **labels):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(batch[f"{prefix}_input_tokens"]),
                attention_mask=torch.tensor(batch[f"{prefix}_segment_ids"]),
                **({"token_type_ids": torch.tensor(batch["encoder_token_type_ids"])}
                   if prefix == "encoder" else {}),
                **{k: torch.tensor(v) for k, v in labels.items()})
  return float(out.loss)


LOSS_CASES = {  # name: (family, head, HF config extras)
    "single_label": ("bert", "sequence_classification", {}),
    "multi_label": ("bert", "sequence_classification",
                    dict(problem_type="multi_label_classification")),
    "regression": ("bert", "sequence_classification",
                   dict(problem_type="regression", num_labels=1)),
    "token_classification": ("bert", "token_classification", {}),
    "question_answering": ("bert", "question_answering", {}),
    "multiple_choice": ("bert", "multiple_choice", {}),
    "gpt2": ("gpt2", "sequence_classification", {}),
}


def labels_of(name, rng, batch, config):
  """HF's label arguments and our batch's label features (the converter's names)."""
  b, length = batch.shape[0], batch.shape[-1]
  if name == "multi_label":
    labels = rng.randint(0, 2, (b, LABELS)).astype(np.float32)
    return {"labels": labels}, {"labels": labels}
  if name == "regression":
    labels = rng.randn(b).astype(np.float32)
    return {"labels": labels}, {"labels": labels}
  if name == "token_classification":
    labels = rng.randint(0, LABELS, (b, length))
    labels[rng.rand(b, length) < 0.3] = -100  # unlabelled pieces
    labels[batch == 0] = -100  # padding
    return {"labels": labels}, {"token_labels": labels}
  if name == "question_answering":
    start, end = rng.randint(0, 4, b), rng.randint(2, 6, b)
    return ({"start_positions": start, "end_positions": end},
            {"start_positions": start, "end_positions": end})
  classes = 3 if name == "multiple_choice" else config.num_labels
  labels = rng.randint(0, classes, b)
  return {"labels": labels}, {"labels": labels}


@pytest.mark.parametrize("name", sorted(LOSS_CASES))
def test_head_losses_equal_hf(name, tmp_path):
  family, head, extras = LOSS_CASES[name]
  model = make_hf(family, head, seed=2, **extras)
  model.save_pretrained(tmp_path)
  config, params = t5lite.load_hf(str(tmp_path))
  assert config.problem_type == extras.get("problem_type", "")
  rng = np.random.RandomState(3)
  ids, types = hf_inputs(family, head, batch=4, seed=4)
  lengths = [LENGTH, 5, 6, 3]  # right padding on all but the first row
  if head == "question_answering":
    # HF's QA softmax runs over every position, padding included, whose states depend on
    # the padding convention (HF: padding queries see the real tokens; t5lite's segment ids:
    # padding sees padding): only unpadded rows can agree exactly.
    lengths = [LENGTH] * 4
  if head == "multiple_choice":
    lengths = np.asarray(lengths)[:, None] - np.arange(3)  # (B, C): choices differ too
  if config.architecture == "decoder_only":
    real = (np.arange(LENGTH) < np.asarray(lengths)[:, None]).astype(np.int32)
    pad = model.config.pad_token_id  # HF reads the last token that is not the pad
    ids = np.where(ids == pad, 5, ids)
    batch = {"decoder_input_tokens": np.where(real > 0, ids, pad), "decoder_segment_ids": real,
             "decoder_positions": np.arange(LENGTH)[None] * real}
    prefix = "decoder"
  else:
    batch, prefix = encoder_batch(ids, types, lengths), "encoder"
  theirs, ours = labels_of(name, rng, batch[f"{prefix}_input_tokens"], config)
  want = hf_loss(model, batch, prefix, **theirs)
  got = our_loss(config, params, {**batch, **ours})
  assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)


# --- refusals and the CLI ------------------------------------------------------------------

def test_unknown_architectures_and_head_options_without_hf_equivalent_are_refused(tmp_path):
  model = make_hf("bert", "token_classification")
  model.save_pretrained(tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": ["BertModel"]}))
  with pytest.raises(ConfigError, match="BertForTokenClassification"):
    t5lite.load_hf(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(hf))
  config, params = t5lite.load_hf(str(tmp_path))
  # A tagger finetuned from a BERT keeps its pretrained pooler, which it never reads: it
  # exports without it, as HF's BertForTokenClassification has none.
  d = config.d_model
  pooler = {"kernel": np.eye(d, dtype=np.float32), "bias": np.zeros(d, np.float32)}
  t5lite.save_hf(config.replace(pooler=True), {**params, "pooler": pooler}, str(tmp_path / "out"))
  again, _ = t5lite.load_hf(str(tmp_path / "out"))
  assert again.head == "token_classification" and not again.pooler
  gpt2 = make_hf("gpt2", "sequence_classification")
  gpt2.save_pretrained(tmp_path / "gpt2")
  config, params = t5lite.load_hf(str(tmp_path / "gpt2"))
  with pytest.raises(ConfigError, match="lm_loss_weight"):
    t5lite.save_hf(config.replace(lm_loss_weight=0.5), params, str(tmp_path / "out"))


def test_import_and_export_cli_round_trip_a_head_model(tmp_path, capsys):
  model = make_hf("roberta", "sequence_classification")
  model.save_pretrained(tmp_path / "hf")
  ids, types = hf_inputs("roberta", "sequence_classification")
  model_dir, out = str(tmp_path / "model"), str(tmp_path / "out")
  # No tokenizer files in this folder: infer reads them from the MODEL_DIR, not T5LITE_VOCAB.
  with pytest.warns(UserWarning, match=r"no vocabulary; copy the model's tokenizer files into "
                    r"that MODEL_DIR \(--out\) before `t5lite infer`"):
    assert cli.main(["import", "hf", "--from", str(tmp_path / "hf"), "--out", model_dir]) == 0
    assert cli.main(["export", "hf", "--checkpoint", model_dir, "--out", out]) == 0
  capsys.readouterr()
  back, info = T.AutoModelForSequenceClassification.from_pretrained(out,
                                                                     output_loading_info=True)
  assert type(back) is T.RobertaForSequenceClassification
  assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
  assert_close(hf_logits(back.eval(), ids, types), hf_logits(model, ids, types))


@pytest.mark.parametrize("family, head", [("roberta", "sequence_classification"),
                                          ("albert", "token_classification"),
                                          ("bert", "question_answering"),
                                          ("llama", "sequence_classification")])
def test_without_architectures_the_head_is_read_from_the_tensors(family, head, tmp_path):
  model = make_hf(family, head)
  model.save_pretrained(tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  del hf["architectures"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  config, _ = t5lite.load_hf(str(tmp_path))
  assert (config.head, config.pooler) == (head, (family, head) in POOLED)
