"""`t5lite bench decode`: the report's figures, and both sides decoding the same tokens."""
import json

import numpy as np
import pytest

from t5lite.bench import decode as bench
from t5lite.bench import hf_t5_decode

from helpers import tiny

FIELDS = ("ratio_vs_hf", "greedy_ratio_vs_hf", "beam_ratio_vs_hf", "t5lite_greedy_tokens_per_s",
          "hf_greedy_tokens_per_s", "t5lite_beam_tokens_per_s", "hf_beam_tokens_per_s")
CONFIG = tiny(vocab_size=256, num_heads=2, d_kv=16)


@pytest.mark.e2e
@pytest.mark.slow
def test_main_ends_with_one_json_line(capsys):
  assert bench.main(["--batch_size", "2", "--inputs_length", "8", "--max_new_tokens", "4",
                     "--num_beams", "2", "--repeats", "1", "--d_model", "32", "--d_ff", "64",
                     "--num_heads", "2", "--d_kv", "16", "--num_layers", "1",
                     "--vocab_size", "256"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  report = json.loads(lines[-1])
  assert report["bench"] == "decode" and all(report[f] > 0 for f in FIELDS)
  assert report["ratio_vs_hf"] == report["greedy_ratio_vs_hf"]
  assert report["greedy_tokens_match"] is True
  assert (report["batch_size"], report["max_new_tokens"], report["repeats"]) == (2, 4, 1)
  assert not any(line.startswith("{") for line in lines[:-1])


@pytest.mark.parity
def test_both_sides_decode_the_same_greedy_tokens(tmp_path):
  import t5lite
  model = hf_t5_decode.random_model(CONFIG, seed=1)
  model.save_pretrained(tmp_path)
  config, params = t5lite.load_hf(str(tmp_path))
  inputs = bench.make_inputs(3, 16, CONFIG.vocab_size, seed=1)
  hf = hf_t5_decode.HFDecoder(model, num_threads=2)
  ours = t5lite.generate(config, params, inputs, max_decode_length=12)
  np.testing.assert_array_equal(ours, hf.generate(hf.prepare(inputs), max_new_tokens=12))
  assert bench.output_tokens(ours) == sum(
      int(np.flatnonzero(r == 1)[0]) + 1 if 1 in r else len(r) for r in ours)
  assert bench.output_tokens(np.array([[5, 1, 0], [4, 4, 4]])) == 5


def test_peak_rss_increase_sees_what_a_call_allocates():
  held = []
  grown = bench.peak_rss_increase_mb(lambda: held.append(np.ones(64 * 2**20, np.uint8)))
  assert 60 < grown < 80
  held.clear()
  assert bench.peak_rss_increase_mb(lambda: None) < 8


@pytest.mark.e2e
@pytest.mark.slow
def test_memory_mode_ends_with_one_json_line(capsys):
  """--memory: each params layout decoded in its own subprocess, one JSON line of figures."""
  assert bench.main(["--memory", "--batch_size", "2", "--inputs_length", "8",
                     "--max_new_tokens", "4", "--num_beams", "2", "--d_model", "32",
                     "--d_ff", "64", "--num_heads", "2", "--d_kv", "16", "--num_layers", "1",
                     "--vocab_size", "256"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  report = json.loads(lines[-1])
  assert report["bench"] == "decode_memory" and report["ratio_vs_hf"] is None
  assert 0 < report["layer_params_mb"] < report["params_mb"]
  for variant in bench.MEMORY_VARIANTS:
    for method in bench.METHODS:
      assert report[f"{variant}_{method}_peak_rss_increase_mb"] > -1
  assert not any(line.startswith("{") for line in lines[:-1])
