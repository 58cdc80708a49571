"""`t5lite bench peft` on a tiny model: the JSON line's structure, and the relations its figures
must have (LoRA's trainable params by the formula, its optimizer state smaller than full
finetuning's, full finetuning training every param)."""
import json
import math

import pytest

from t5lite.bench import peft as bench_peft
from t5lite.bench.train import model_config
from t5lite.families import family_of

TINY = ["--model", "tiny", "--batch_size", "8", "--inputs_length", "32",
        "--targets_length", "8", "--steps", "3", "--warmup", "1"]


def run_bench(capsys, tmp_path, *flags):
  code = bench_peft.main([*TINY, "--out", str(tmp_path / "bench"), *flags])
  lines = capsys.readouterr().out.strip().splitlines()
  return code, lines, json.loads(lines[-1])


def lora_formula(config, r=8):
  """r * (fan_in + fan_out) over every query and value kernel: the encoder's self-attention,
  the decoder's self- and cross-attention, each (d_model) -> (heads x d_kv)."""
  kernels = 2 * (config.num_encoder_layers + 2 * config.num_decoder_layers)
  return kernels * r * (config.d_model + config.num_heads * config.d_kv)


def test_the_speed_part_reports_every_method(capsys, tmp_path):
  code, lines, report = run_bench(capsys, tmp_path, "--finetune_steps", "0")
  assert code == 0, report["methods"]
  assert report["bench"] == "peft" and report["ratio_vs_hf"] is None
  assert set(report["machine"]) >= {"cpu", "cores", "backend", "device_kind"}
  assert set(report["methods"]) == {"full", "lora", "prompt_tuning"}
  assert report["finetune"] is None
  full, lora, prompt = (report["methods"][m] for m in ("full", "lora", "prompt_tuning"))
  for entry in (full, lora, prompt):
    assert {"step_s_median", "trainable_params", "optimizer_state_bytes"} <= set(entry)
    assert len(entry["step_s"]) == 3 and entry["step_s_median"] > 0
    assert all(math.isfinite(x) for x in entry["losses"]) and len(entry["losses"]) == 4
  config = model_config("tiny")
  n_params = sum(x.size for x in __import__("jax").tree.leaves(
      family_of(config).abstract_params()))
  # Full finetuning trains every param; LoRA its A and B of the query and value kernels only.
  assert full["trainable_params"] == full["model_params"] == n_params
  assert lora["trainable_params"] == lora_formula(config) == lora["trainable_params_formula"]
  assert lora["model_params"] == n_params + lora["trainable_params"]
  # AdamW: two float32 moments per trainable param (and a step count), for LoRA only its own.
  assert lora["optimizer_state_bytes"] < full["optimizer_state_bytes"]
  assert 8 * lora["trainable_params"] <= lora["optimizer_state_bytes"] < 8 * lora[
      "trainable_params"] + 64
  assert 8 * n_params <= full["optimizer_state_bytes"] < 8 * n_params + 64
  assert lora["frozen_base_bytes"] == 4 * n_params and full["frozen_base_bytes"] == 0
  assert lora["optimizer_state_vs_full"] < 0.2
  # A LoRA adapter starts at B = 0: its first loss is the base's, as full finetuning's is.
  assert lora["losses"][0] == pytest.approx(full["losses"][0], rel=1e-5)
  # Prompt tuning: 20 soft tokens of d_model, the base untouched.
  assert prompt["trainable_params"] == 20 * config.d_model
  assert prompt["optimizer_state_bytes"] < lora["optimizer_state_bytes"]
  assert prompt["frozen_base_bytes"] == 4 * n_params
  assert any(line.startswith("lora ") for line in lines[:-1])  # the table


def test_bad_methods_are_refused(capsys, tmp_path):
  with pytest.raises(SystemExit):
    bench_peft.main([*TINY, "--methods", "full,qlora", "--out", str(tmp_path / "b")])
  assert "qlora" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.slow
def test_the_finetune_part_reports_rouge_per_method(capsys, tmp_path):
  code, _, report = run_bench(capsys, tmp_path, "--methods", "full,lora",
                              "--finetune_steps", "2", "--finetune_batch_size", "8",
                              "--finetune_inputs_length", "32",
                              "--finetune_targets_length", "8", "--eval_examples", "4")
  assert code == 0
  assert report["finetune"]["task"] == "stdlib_docstring_summary"
  for method in ("full", "lora"):
    finetune = report["methods"][method]["finetune"]
    assert finetune["steps"] == 2
    assert {"rouge1", "rouge2", "rougeLsum"} <= set(finetune["rouge"])
    assert all(0 <= v <= 100 for v in finetune["rouge"].values())
