"""`t5lite bench train`: the harness end to end on a tiny model, both modes, no timing checks.

Both sides start from the same weights (t5lite's init through the HF export), so on the same
examples their first losses agree; in pretrain mode (the same batch every step) the second
loss agrees too, which checks that both AdamW updates are the same.
"""
import json

import numpy as np
import pytest

from t5lite.bench import hf_t5_train, train as bench, train_batches

KEYS = ("bench", "mode", "ratio_vs_hf", "t5lite_tokens_per_s", "hf_tokens_per_s", "t5lite_step_s",
        "hf_step_s", "t5lite_compile_s", "step_peak_rss_mb", "process_max_rss_mb", "step0_loss",
        "config", "tokens_per_run", "mfu_t5lite", "load_avg_1m", "flops_per_s",
        "matmul_flops_per_s", "fraction_of_matmul_peak")
TINY_ARGS = ["--model", "tiny", "--batch_size", "2", "--inputs_length", "32",
             "--targets_length", "8", "--steps", "2", "--repeats", "1"]



@pytest.mark.e2e
@pytest.mark.slow
def test_pretrain_main_prints_one_json_line_and_both_sides_agree(capsys, quick_matmul_rate):
  assert bench.main(TINY_ARGS) == 0
  out = capsys.readouterr().out.strip().splitlines()
  report = json.loads(out[-1])
  assert all(key in report for key in KEYS)
  assert report["bench"] == "train" and report["mode"] == "pretrain"
  assert report["ratio_vs_hf"] > 0 and report["config"]["d_model"] == 32
  assert report["tokens_per_run"] == 2 * 2 * (32 + 8)
  # The FLOP rates count the same model FLOPs per run on both sides, against the rate of the
  # step's largest matmul (2 rows x 32 inputs, d_model 32, d_ff 64) on this machine.
  assert report["matmul_shape"] == [64, 32, 64]
  ratio_of_rates = report["flops_per_s"]["t5lite"] / report["flops_per_s"]["hf"]
  assert ratio_of_rates == pytest.approx(report["t5lite_tokens_per_s"] / report["hf_tokens_per_s"],
                                         rel=0.02)
  assert report["fraction_of_matmul_peak"]["t5lite"] == pytest.approx(
      report["flops_per_s"]["t5lite"] / report["matmul_flops_per_s"], rel=0.02)
  assert report["step0_loss_rel_diff"] < 1e-4
  # Same batch at both warm-up steps: after one AdamW update the losses still agree.
  np.testing.assert_allclose(report["warmup_losses"]["t5lite"], report["warmup_losses"]["hf"],
                             rtol=1e-3)
  assert any(line.startswith("ratio t5lite / HF") for line in out[:-1])  # the table


@pytest.mark.e2e
@pytest.mark.slow
def test_finetune_packs_for_t5lite_and_pads_the_same_examples_for_hf(quick_matmul_rate):
  config = bench.model_config("tiny")
  report = bench.run(mode="finetune", config=config, batch_size=2, inputs_length=64,
                     targets_length=16, steps=2, repeats=1, log=None)
  assert report["mode"] == "finetune" and report["config"]["vocab_size"] % 128 == 0
  assert report["step0_loss_rel_diff"] < 1e-4  # packing masks == HF's padding masks
  assert report["tokens_counted"].startswith("non-pad")
  assert report["padding_efficiency"]["t5lite"] <= 1.0
  assert report["steps_per_run"]["t5lite"] == 2


@pytest.mark.parity
def test_unpack_and_pad_examples():
  packed = {"encoder_input_tokens": np.array([[7, 8, 1, 9, 1, 0]]),
            "encoder_segment_ids": np.array([[1, 1, 1, 2, 2, 0]]),
            "decoder_target_tokens": np.array([[3, 1, 4, 5, 1]]),
            "decoder_segment_ids": np.array([[1, 1, 2, 2, 2]])}
  examples = train_batches.unpack(packed)
  assert [(list(i), list(t)) for i, t in examples] == [([7, 8, 1], [3, 1]), ([9, 1], [4, 5, 1])]
  batch = hf_t5_train.pad_examples(examples)
  np.testing.assert_array_equal(batch["input_ids"], [[7, 8, 1], [9, 1, 0]])
  np.testing.assert_array_equal(batch["attention_mask"], [[1, 1, 1], [1, 1, 0]])
  np.testing.assert_array_equal(batch["labels"], [[3, 1, -100], [4, 5, 1]])
  assert hf_t5_train.useful_tokens(batch) == train_batches.t5lite_useful_tokens(packed) == 10


FAMILY_KEYS = ("bench", "family", "tokens_per_s", "hf_tokens_per_s", "ratio_vs_hf",
               "step0_loss", "step0_loss_diff", "cpu_model", "cpu_count", "load_avg_1m",
               "others_cpu_fraction", "config", "length", "batch_size")


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_family_bench_prints_one_json_line_and_both_sides_agree(family, capsys):
  """BertForPreTraining (MLM + next sentence) and GPT2LMHeadModel vs t5lite's step on the same
  tiny config, weights and batch: the step-0 losses agree, and after one AdamW update too."""
  args = ["--family", family, "--model", "tiny", "--batch_size", "2", "--length", "32",
          "--steps", "2", "--repeats", "1"]
  assert bench.main(args) == 0
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert all(key in report for key in FAMILY_KEYS)
  assert report["family"] == family and report["config"]["family"] == family
  assert report["tokens_per_s"] > 0 and report["ratio_vs_hf"] > 0
  assert report["tokens_per_run"] == 2 * 32 * 2
  assert report["step0_loss_diff"] < 1e-4
  np.testing.assert_allclose(report["warmup_losses"]["t5lite"], report["warmup_losses"]["hf"],
                             rtol=1e-3)


def test_family_batches_hold_the_same_examples_for_both_sides():
  (t5,), (hf,) = train_batches.bert_batches(500, 3, 16, seed=0)
  chosen = t5["mlm_loss_weights"] > 0
  np.testing.assert_array_equal(hf["input_ids"], t5["encoder_input_tokens"])
  np.testing.assert_array_equal(hf["token_type_ids"], t5["encoder_token_type_ids"])
  np.testing.assert_array_equal(hf["labels"], np.where(chosen, t5["mlm_target_tokens"], -100))
  np.testing.assert_array_equal(hf["next_sentence_label"], t5["sentence_labels"])
  assert (hf["input_ids"][:, 0] == train_batches.BERT_CLS).all() and chosen.any(axis=1).all()
  assert not chosen[:, 0].any() and not chosen[:, -1].any()  # [CLS] / [SEP] never predicted
  (t5,), (hf,) = train_batches.gpt2_batches(500, 2, 8, seed=0)
  np.testing.assert_array_equal(hf["input_ids"], t5["decoder_input_tokens"])
  np.testing.assert_array_equal(t5["decoder_target_tokens"][:, :-1], hf["labels"][:, 1:])
  assert t5["decoder_loss_weights"][:, -1].sum() == 0 and t5["decoder_loss_weights"][:, :-1].all()
