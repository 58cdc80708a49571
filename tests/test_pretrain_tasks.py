"""The BERT-line pretraining tasks (t5lite_tasks.embedded_pretrain) through the pipeline, and
what EncoderOnlyFeatureConverter passes on for them: token types, sentence labels, span
boundary features. Small: the validation split, a few rows."""
import grain
import numpy as np
import pytest

import t5lite_tasks  # noqa: F401 (registers the tasks)
from t5lite.data import pipeline, rows
from t5lite.data.converters.sequence import EncoderOnlyFeatureConverter
from t5lite.data.registry import TaskRegistry
from t5lite.errors import ConfigError
from t5lite_tasks import embedded

TASKS = ("stdlib_bert_pretrain", "stdlib_albert_pretrain", "stdlib_roberta_pretrain",
         "stdlib_spanbert_pretrain")


def _ds(examples):
  return grain.MapDataset.source(examples).to_iter_dataset()


def _mlm(n, **extra):
  tokens = np.arange(10, 10 + n, dtype=np.int32)
  return {"inputs": tokens, "targets": tokens, "weights": np.zeros(n, np.int32), **extra}


# --- The converter -------------------------------------------------------------------------

def test_converter_passes_token_types_and_sentence_labels_unpacked():
  examples = [_mlm(4, token_type_ids=np.array([0, 0, 1, 1]), sentence_label=np.int32(1)),
              _mlm(3, token_type_ids=np.array([0, 0, 1]), sentence_label=np.int32(0))]
  out = list(EncoderOnlyFeatureConverter(pack=False)(_ds(examples), {"inputs": 6}))
  assert [r["encoder_token_type_ids"].tolist() for r in out] == [[0, 0, 1, 1, 0, 0],
                                                                 [0, 0, 1, 0, 0, 0]]
  assert [int(r["sentence_labels"]) for r in out] == [1, 0]
  assert out[0]["sentence_labels"].shape == () and "mlm_span_offset" not in out[0]
  # Plain MLM examples keep exactly the keys they always had.
  plain = next(iter(EncoderOnlyFeatureConverter(pack=False)(_ds([_mlm(3)]), {"inputs": 6})))
  assert set(plain) == set(EncoderOnlyFeatureConverter().model_feature_lengths({"inputs": 6}))


def test_converter_refuses_to_pack_sentence_labels():
  with pytest.raises(ConfigError, match="pack=False.*pooler"):
    list(EncoderOnlyFeatureConverter()(_ds([_mlm(3, sentence_label=np.int32(0))]),
                                       {"inputs": 8}))
  with pytest.raises(ValueError, match="one length"):
    list(EncoderOnlyFeatureConverter()(_ds([_mlm(3, token_type_ids=np.zeros(2, np.int32))]),
                                       {"inputs": 8}))


def test_converter_span_features_are_row_positions_when_packed():
  span = dict(span_left=np.array([0, 0, 0, 0, 0]), span_right=np.array([0, 3, 3, 0, 0]),
              span_offset=np.array([0, 1, 2, 0, 0]))
  span["span_right"] = np.array([0, 3, 3, 0, 0])
  examples = [_mlm(4, **{k: np.zeros(4, np.int32) for k in span}), _mlm(5, **span)]
  row, = EncoderOnlyFeatureConverter(num_packing_bins=1)(_ds(examples), {"inputs": 10})
  # The docstring's example: the second example starts at row position 4.
  assert row["mlm_span_left"].tolist() == [0, 0, 0, 0, 0, 4, 4, 0, 0, 0]
  assert row["mlm_span_right"].tolist() == [0, 0, 0, 0, 0, 7, 7, 0, 0, 0]
  assert row["mlm_span_offset"].tolist() == [0, 0, 0, 0, 0, 1, 2, 0, 0, 0]
  assert "encoder_token_type_ids" not in row and "sentence_labels" not in row
  # Cut by the inputs length: the right boundary stays inside the example.
  row, = EncoderOnlyFeatureConverter(pack=False)(_ds([_mlm(5, **span)]), {"inputs": 2})
  assert row["mlm_span_right"].tolist() == [0, 1] and row["mlm_span_offset"].tolist() == [0, 1]


# --- The tasks -----------------------------------------------------------------------------

def batch(name, pack, length=64, rows_=2):
  config = pipeline.PipelineConfig(global_batch_size=rows_, split="validation",
                                   task_feature_lengths={"inputs": length})
  return next(pipeline.get_dataset(name, config, EncoderOnlyFeatureConverter(pack=pack)))


def check_masking(b, chosen_low=0.1, chosen_high=0.2):
  vocab = embedded.MLM_VOCABULARY
  specials = np.isin(b["mlm_target_tokens"], list(vocab.special_tokens.values()))
  real = b["encoder_segment_ids"] > 0
  weights = b["mlm_loss_weights"] > 0
  assert not (weights & specials).any()
  assert ((b["encoder_input_tokens"] != b["mlm_target_tokens"]) <= weights).all()
  assert chosen_low < weights.sum() / (real & ~specials).sum() < chosen_high


@pytest.mark.parametrize("name", ["stdlib_bert_pretrain", "stdlib_albert_pretrain"])
def test_pair_tasks_make_bert_rows(name):
  assert set(TASKS) <= set(TaskRegistry.names())
  b = batch(name, pack=False, length=37, rows_=4)
  assert b["sentence_labels"].shape == (4,) and set(b["sentence_labels"].tolist()) <= {0, 1}
  for r in range(4):
    tokens = b["mlm_target_tokens"][r][b["encoder_segment_ids"][r] > 0]
    types = b["encoder_token_type_ids"][r][b["encoder_segment_ids"][r] > 0]
    seps = np.flatnonzero(tokens == 3)
    assert tokens[0] == 2 and len(seps) == 2 and seps[1] == len(tokens) - 1
    assert (types[:seps[0] + 1] == 0).all() and (types[seps[0] + 1:] == 1).all()
  check_masking(b)


def test_spanbert_task_has_full_rows_and_span_features():
  b = batch("stdlib_spanbert_pretrain", pack=True)
  assert (b["encoder_segment_ids"] > 0).all()  # single segments of the full length
  check_masking(b)
  offset = b["mlm_span_offset"]
  assert ((offset > 0) == (b["mlm_loss_weights"] > 0)).all()
  positions = np.arange(offset.shape[1])
  at = offset > 0
  assert (b["mlm_span_left"][at] == (positions - offset)[at]).all()
  assert (b["mlm_span_right"][at] > positions[None].repeat(2, 0)[at]).all()


def test_roberta_task_packs_full_sentences_with_new_masks_every_epoch():
  b = batch("stdlib_roberta_pretrain", pack=True)
  assert "sentence_labels" not in b and "encoder_token_type_ids" not in b
  check_masking(b)
  # Two epochs of one row, unshuffled: the same documents twice, in one group of 128, so
  # the examples' words (specials aside) are one text twice over, masked anew.
  config = pipeline.PipelineConfig(global_batch_size=8, task_feature_lengths={"inputs": 64},
                                   split="validation", shuffle=False, num_epochs=2)
  examples = list(rows.task_row_dataset(TaskRegistry.get("stdlib_roberta_pretrain"), 0, config))
  for e in examples:
    assert e["targets"][0] == 2 and e["targets"][-1] == 3 and len(e["targets"]) <= 64
  tokens = np.concatenate([e["targets"] for e in examples])
  weights = np.concatenate([e["weights"] for e in examples])[tokens > 4]
  tokens = tokens[tokens > 4]
  half = tokens.size // 2
  assert half > 200 and (tokens[:half] == tokens[half:]).all()
  first, second = weights[:half] > 0, weights[half:] > 0
  assert 0.1 < first.mean() < 0.2 and 0.1 < second.mean() < 0.2
  assert (first & second).sum() < 0.5 * first.sum()
