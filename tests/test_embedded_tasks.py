"""The embedded default tasks (stdlib prose) and the `t5lite tasks` / `t5lite cache` verbs."""
import itertools
import json
import os
import re

import numpy as np
import pytest

import t5lite_tasks  # noqa: F401 (registers the tasks)
from helpers.terminal import on_terminal, redrawn
from t5lite import cli
from t5lite.data import describe, pipeline, rows
from t5lite.data.converters.sequence import (DecoderOnlyFeatureConverter, EncDecFeatureConverter,
                                    EncoderOnlyFeatureConverter)
from t5lite.data.vocab.hf_training import train_wordpiece
from t5lite.data.registry import TaskRegistry
from t5lite.data.vocab.vocabularies import load_vocabulary
from t5lite_tasks import embedded

LENGTHS = {"inputs": 128, "targets": 32}


def test_corpus_is_prepared_once_with_a_trained_vocabulary():
  directory = embedded.prepare()
  train, validation = embedded.source("train"), embedded.source("validation")
  assert len(train) > 700 and 20 < len(validation) < 80
  assert not {train[i]["name"] for i in range(len(train))} & \
      {validation[i]["name"] for i in range(len(validation))}
  vocab = embedded.VOCABULARY
  assert vocab.vocab_size == embedded.VOCAB_PIECES + embedded.EXTRA_IDS
  text = "Return a list of the words in the string, using sep as the delimiter."
  assert vocab.decode(vocab.encode(text).tolist()) == text
  assert len(vocab.encode(text)) < len(text) / 2.5  # a real subword vocabulary, not bytes
  assert embedded.prepare() == directory


def test_span_corruption_task_makes_t5_examples():
  ex = describe.preprocessed_examples(TaskRegistry.get("stdlib_span_corruption"), "train",
                                      LENGTHS, 3)
  vocab = embedded.VOCABULARY
  for e in ex:
    assert len(e["inputs"]) == 128 and e["inputs"][-1] == 1 and e["targets"][-1] == 1
    assert e["targets"][0] == vocab.vocab_size - 1  # <extra_id_0> opens the targets


def test_prefix_lm_task_gives_a_prefix_to_the_encoder_and_its_continuation_to_the_decoder():
  """T5's LM objective: each example is one piece of the concatenated text, split once at a
  point drawn per example, EOS after both halves."""
  lengths = {"inputs": 48, "targets": 40}
  ex = describe.preprocessed_examples(TaskRegistry.get("stdlib_prefix_lm"), "train", lengths, 6)
  splits = set()
  for e in ex:
    inputs, targets = list(e["inputs"]), list(e["targets"])
    assert inputs[-1] == 1 and targets[-1] == 1  # EOS on both
    assert len(inputs) + len(targets) - 2 == min(lengths.values()) - 1  # one whole piece
    assert len(inputs) >= 2 and len(targets) >= 2  # a prefix, and something to predict
    splits.add(len(inputs))
  assert len(splits) > 2  # the split point is drawn per example


def test_docstring_summary_task_and_its_metric():
  task = TaskRegistry.get("stdlib_docstring_summary")
  ex = describe.preprocessed_examples(task, "validation", {"inputs": 256, "targets": 32}, 2)
  for e in ex:
    assert e["inputs_pretokenized"].startswith("summarize: ")
    assert e["targets_pretokenized"].endswith(".") and e["targets"][-1] == 1
  reference = [e["targets_pretokenized"] for e in ex]
  scores = task.metric_fns[0](reference, [task.postprocess_fn(" " + r + " ") for r in reference])
  assert scores["rouge1"] == pytest.approx(100.0)


def test_tasks_cli_list_show_stats(capsys):
  assert cli.main(["tasks", "list"]) == 0
  out = capsys.readouterr().out
  assert "stdlib_span_corruption" in out and "glue_v002_proportional" in out
  assert cli.main(["tasks", "show", "stdlib_docstring_summary", "-n", "1", "--split",
                   "validation", "--lengths", "inputs=256,targets=32"]) == 0
  out = capsys.readouterr().out
  assert "raw example 0" in out and re.search(r"decoded: ['\"]summarize:", out)
  assert cli.main(["tasks", "stats", "stdlib_span_corruption", "--max_examples", "50",
                   "--lengths", "inputs=128,targets=32"]) == 0
  stats = json.loads(capsys.readouterr().out)
  assert stats["examples"] == 50 and stats["inputs"]["max"] == 128
  assert 0.9 < stats["packing_efficiency"] <= 1.0
  assert cli.main(["tasks", "show", "stdlib_sumary"]) == 2
  assert re.search(r"closest: [\w, ]*stdlib_docstring_summary", capsys.readouterr().err)


def test_cache_on_a_terminal_shows_a_progress_bar(tmp_path, monkeypatch):
  with on_terminal(monkeypatch) as screen:
    assert cli.main(["cache", "stdlib_docstring_summary", "--split", "validation",
                     "--cache_dir", str(tmp_path)]) == 0
  shown = screen()
  assert redrawn(shown) and "cache stdlib_docstring_summary validation: 100%|" in shown


def test_cache_cli_and_cached_training_data(tmp_path, capsys):
  assert cli.main(["cache", "stdlib_span_corruption", "--split", "train",
                   "--cache_dir", str(tmp_path)]) == 0
  info = json.loads(capsys.readouterr().out.splitlines()[-1])
  assert info["examples"] == info["source_examples"] > 700
  converter = EncDecFeatureConverter()
  runs = []
  for cached in (True, False):
    config = pipeline.PipelineConfig(global_batch_size=4, task_feature_lengths=LENGTHS,
                                     use_cached=cached, cache_dir=str(tmp_path))
    runs.append(next(pipeline.get_dataset("stdlib_span_corruption", config, converter)))
  for key in runs[0]:
    np.testing.assert_array_equal(runs[0][key], runs[1][key])


# --- stdlib_lm (GPT-2 style) and stdlib_mlm (BERT style) ------------------------------------

def test_lm_and_mlm_tasks_register_with_vocabularies_trained_and_cached():
  assert {"stdlib_lm", "stdlib_mlm"} <= set(TaskRegistry.names())
  lm, mlm = embedded.LM_VOCABULARY, embedded.MLM_VOCABULARY
  assert lm.vocab_size == embedded.LM_VOCAB_SIZE == 4000
  assert mlm.vocab_size == embedded.MLM_VOCAB_SIZE == 4000
  assert lm.special_tokens == {"eos": 0, "unk": 0, "bos": 0} and lm.pad_id is None
  assert mlm.special_tokens == {"pad": 0, "eos": 3, "unk": 1, "mask": 4, "cls": 2, "sep": 3}
  directory = embedded.prepare()
  for name, vocab in ((f"byte_level_bpe_{lm.vocab_size}", lm),
                      (f"wordpiece_{mlm.vocab_size}", mlm)):
    assert load_vocabulary(os.path.join(directory, name)) == vocab.vocabulary
  text = "Return a list of the words in the string, using sep as the delimiter."
  assert lm.decode(lm.encode(text)) == text and mlm.decode(mlm.encode(text)) == text.lower()
  assert len(lm.encode(text)) < len(text) / 3.5 and len(mlm.encode(text)) < len(text) / 3.5


def test_vocabulary_cache_is_built_once_and_rebuilt_when_damaged(tmp_path, monkeypatch):
  monkeypatch.setattr(embedded, "prepare", lambda: str(tmp_path))
  monkeypatch.setattr(embedded, "_train_texts", lambda documents=None: ["a few words, twice"] * 2)
  trained = []

  def train(texts):
    trained.append(1)
    return train_wordpiece(texts, 100)
  vocab = embedded._prepared_vocabulary("wp", train)
  assert embedded._prepared_vocabulary("wp", train) == vocab and len(trained) == 1
  assert sorted(os.listdir(tmp_path)) == [".lock", "wp"]  # no temporaries left
  (tmp_path / "wp" / "vocab.txt").unlink()  # as a build killed halfway by older code
  assert embedded._prepared_vocabulary("wp", train) == vocab and len(trained) == 2


def test_lm_task_makes_gpt2_batches():
  config = pipeline.PipelineConfig(global_batch_size=4, task_feature_lengths={"targets": 64})
  batches = pipeline.get_dataset("stdlib_lm", config, DecoderOnlyFeatureConverter())
  batch = next(batches)
  assert batch["decoder_target_tokens"].shape == (4, 64)
  eos_between_documents = False
  for batch in [batch, *itertools.islice(batches, 3)]:
    targets, segments = batch["decoder_target_tokens"], batch["decoder_segment_ids"]
    assert 0 <= targets.min() and targets.max() < embedded.LM_VOCAB_SIZE
    assert (segments > 0).mean() > 0.95  # concatenated pieces fill the rows
    assert (batch["decoder_input_tokens"][:, 0] == 0).all()  # BOS 0 is <|endoftext|>
    eos_between_documents |= bool(((targets == 0) & (segments > 0)).any())
  assert eos_between_documents


def test_wordpiece_lm_task_is_a_causal_lm_on_the_mlm_tasks_tokens():
  config = pipeline.PipelineConfig(global_batch_size=3, task_feature_lengths={"targets": 47})
  batches = pipeline.get_dataset("stdlib_lm_wordpiece", config,
                                 DecoderOnlyFeatureConverter(bos_id=2))
  vocab, seps = embedded.MLM_VOCABULARY, 0
  for batch in itertools.islice(batches, 4):
    targets, segments = batch["decoder_target_tokens"], batch["decoder_segment_ids"]
    assert targets.shape == (3, 47) and (segments > 0).all()  # full pieces, packed
    assert (batch["decoder_input_tokens"][:, 0] == 2).all()  # [CLS] starts each row
    np.testing.assert_array_equal(batch["decoder_input_tokens"][:, 1:], targets[:, :-1])
    assert 5 <= targets.min() or set(np.unique(targets[targets < 5])) <= {3}  # only [SEP]s
    assert targets.max() < vocab.vocab_size
    seps += int((targets == vocab.eos_id).sum())
    text = vocab.decode([int(t) for t in targets[0] if t != vocab.eos_id])
    assert text == text.lower() and len(text.split()) > 20  # stdlib_mlm's uncased WordPiece
  assert seps > 0  # documents end in [SEP]


def test_text_to_text_classification_tasks_write_the_label_as_a_word():
  from t5lite_tasks import embedded_heads, embedded_text_to_text
  vocab, lengths = embedded.VOCABULARY, {"inputs": 96, "targets": 8}
  for name, words in (("stdlib_docstring_module", embedded_heads.MODULES),
                      ("stdlib_sentence_pair", embedded_text_to_text.PAIR_LABELS)):
    task = TaskRegistry.get(name)
    examples = describe.preprocessed_examples(task, "validation", lengths, 40)
    targets = [vocab.decode(ex["targets"].tolist()) for ex in examples]
    assert set(targets) == set(words) and all(ex["targets"][-1] == 1 for ex in examples)
    prefix = name.split("stdlib_")[1].replace("_", " ")
    assert all(vocab.decode(ex["inputs"].tolist()).startswith(prefix) for ex in examples)
    assert task.metric_fns[0](targets, targets[::-1])["accuracy"] < 100
  # The whole-span LM in the same vocabulary: every token in the loss, EOS between documents.
  config = pipeline.PipelineConfig(global_batch_size=4, task_feature_lengths={"targets": 61})
  batches = list(itertools.islice(pipeline.get_dataset(
      "stdlib_lm_sentencepiece", config, DecoderOnlyFeatureConverter()), 4))
  assert all(b["decoder_loss_weights"].all() for b in batches)
  assert any((b["decoder_target_tokens"] == vocab.eos_id).any() for b in batches)


def mlm_rows(batch):
  """Each packed segment's (targets, inputs, weights)."""
  for r in range(batch["encoder_segment_ids"].shape[0]):
    segments = batch["encoder_segment_ids"][r]
    for s in range(1, segments.max() + 1):
      at = segments == s
      yield (batch["mlm_target_tokens"][r][at], batch["encoder_input_tokens"][r][at],
             batch["mlm_loss_weights"][r][at])


def test_mlm_task_makes_bert_batches_and_never_masks_specials():
  config = pipeline.PipelineConfig(global_batch_size=4, task_feature_lengths={"inputs": 64})
  batch = next(pipeline.get_dataset("stdlib_mlm", config, EncoderOnlyFeatureConverter()))
  assert {k: v.shape for k, v in batch.items()} == {
      k: (4, 64) for k in ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions",
                           "mlm_target_tokens", "mlm_loss_weights")}
  vocab = embedded.MLM_VOCABULARY
  for key in ("encoder_input_tokens", "mlm_target_tokens"):
    assert 0 <= batch[key].min() and batch[key].max() < embedded.MLM_VOCAB_SIZE
  specials = list(vocab.special_tokens.values())
  chosen = pieces = 0
  for targets, inputs, weights in mlm_rows(batch):
    assert targets[0] == vocab.cls_id and targets[-1] == vocab.sep_id  # [CLS] piece [SEP]
    special = np.isin(targets, specials)
    assert not weights[special].any() and (inputs[special] == targets[special]).all()
    assert ((inputs != targets) <= (weights > 0)).all()
    chosen += weights.sum()
    pieces += (~special).sum()
  assert 0.13 < chosen / pieces < 0.17  # 15% of the other tokens


def test_mlm_task_draws_new_masks_every_epoch():
  # Two epochs of one row, unshuffled: the same documents twice, concatenated into one
  # group, so the pieces' tokens (without [CLS] / [SEP]) are one text twice over.
  config = pipeline.PipelineConfig(global_batch_size=8, task_feature_lengths={"inputs": 64},
                                   split="validation", shuffle=False, num_epochs=2)
  examples = list(rows.task_row_dataset(TaskRegistry.get("stdlib_mlm"), 0, config))
  tokens = np.concatenate([e["targets"][1:-1] for e in examples])
  weights = np.concatenate([e["weights"][1:-1] for e in examples])
  half = tokens.size // 2
  assert half > 200 and (tokens[:half] == tokens[half:]).all()
  first, second = weights[:half] > 0, weights[half:] > 0
  assert 0.1 < first.mean() < 0.2 and 0.1 < second.mean() < 0.2
  assert (first & second).sum() < 0.5 * first.sum()  # other positions: not the same masks
