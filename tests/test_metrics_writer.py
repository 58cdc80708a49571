"""Metric sinks (metrics.jsonl, TensorBoard), the progress line, the MFU cost model and plots."""
from __future__ import annotations

import glob
import json
import os
import struct

import pytest

from t5lite.families import family_of
from t5lite.models.config import ModelConfig
from t5lite.runtime.metrics_writer import MetricsWriter, ProgressLine, format_duration
from t5lite.train import cost_model
from t5lite.cli import plot


# --- metrics.jsonl and TensorBoard -------------------------------------------------------------

def _read_tfrecords(path: str) -> list[bytes]:
  """Frames of a TFRecord file (TB event files are TFRecords), checking both CRCs."""
  from tensorboardX.record_writer import masked_crc32c
  records = []
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos < len(data):
    header = data[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
    assert header_crc == masked_crc32c(header)
    payload = data[pos + 12:pos + 12 + length]
    (payload_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
    assert payload_crc == masked_crc32c(payload)
    records.append(payload)
    pos += 16 + length
  return records


def test_jsonl_exact_content(tmp_path):
  import numpy as np
  with MetricsWriter(tmp_path) as writer:
    writer.write(1, {"loss": 4.5})
    writer.write(2, {"loss": np.float32(3.25), "learning_rate": 0.01})
    writer.write(10, {"eval/glue_cola/accuracy": 0.5})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line) for line in lines] == [
      {"step": 1, "loss": 4.5},
      {"step": 2, "loss": 3.25, "learning_rate": 0.01},
      {"step": 10, "eval/glue_cola/accuracy": 0.5},
  ]
  # Appends on reopen (a resumed run keeps its history).
  with MetricsWriter(tmp_path) as writer:
    writer.write(11, {"loss": float("nan")})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 4 and json.loads(lines[-1]) == {"step": 11, "loss": None}


def test_jsonl_flushed_before_close(tmp_path):
  writer = MetricsWriter(tmp_path)
  writer.write(3, {"loss": 2.0})
  assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 3, "loss": 2.0}
  writer.close()


def test_non_primary_writes_nothing(tmp_path):
  model_dir = tmp_path / "run"
  writer = MetricsWriter(model_dir, is_primary=False)
  writer.write(1, {"loss": 1.0})
  writer.close()
  assert not model_dir.exists()


def test_tensorboard_events_read_back(tmp_path):
  from tensorboardX.proto import event_pb2
  with MetricsWriter(tmp_path) as writer:
    writer.write(5, {"loss": 2.5})
    writer.write(6, {"loss": 2.0, "eval/t/acc": 0.75})
  files = glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
  assert len(files) == 1 and os.path.getsize(files[0]) > 0
  scalars = []
  for payload in _read_tfrecords(files[0]):
    event = event_pb2.Event.FromString(payload)
    for value in event.summary.value:
      scalars.append((event.step, value.tag, pytest.approx(value.simple_value)))
  assert scalars == [(5, "loss", 2.5), (6, "loss", 2.0), (6, "eval/t/acc", 0.75)]


# --- progress line ----------------------------------------------------------------------------

def test_progress_line_numbers():
  progress = ProgressLine(1000)
  # 120 steps, 296,280 tokens in 24 s: 12,345 tok/s, 0.2 s/step, 880 steps left -> 176 s.
  line = progress.update(120, 3.4123, 1e-2, tokens=296_280, seconds=24.0, mfu=0.412)
  assert line == "step 120/1000  loss 3.412  lr 1.0e-02  12,345 tok/s  MFU 41.2%  ETA 2m56s"
  # Next 10 steps in 8 s (0.8 s/step), 10,000 tokens. Moving average over both intervals:
  # 32 s / 130 steps; ETA = 870 * 32 / 130 = 214.2 s; tok/s = 306,280 / 32 = 9,571.
  line = progress.update(130, 3.0, 5e-3, tokens=10_000, seconds=8.0)
  assert line == "step 130/1000  loss 3.000  lr 5.0e-03  9,571 tok/s  ETA 3m34s"


def test_progress_line_window_and_end():
  progress = ProgressLine(100, start_step=50, window=1)
  progress.update(60, 1.0, 1e-3, tokens=1000, seconds=100.0)  # slow interval, then dropped
  line = progress.update(70, 1.0, 1e-3, tokens=1000, seconds=1.0)
  assert line.endswith("1,000 tok/s  ETA 3s")  # 30 steps left at 0.1 s/step
  assert "ETA" not in progress.update(100, 1.0, 1e-3, tokens=1000, seconds=1.0)


def test_format_duration():
  assert [format_duration(s) for s in (7, 192, 3725)] == ["7s", "3m12s", "1h02m05s"]


# --- cost model -------------------------------------------------------------------------------

T5_V11_BASE = ModelConfig(d_model=768, d_ff=2048, num_heads=12, d_kv=64, num_encoder_layers=12,
                          num_decoder_layers=12, vocab_size=32128)


def _flops(config, inputs: int, targets: int) -> float:
  """The family's FLOPs of one example with these encoder input / decoder target lengths
  (a decoder-only stream holds both: the converter concatenates inputs and targets)."""
  lengths = {"encoder_input_tokens": inputs, "decoder_target_tokens": targets}
  if config.architecture == "decoder_only":
    lengths = {"decoder_target_tokens": inputs + targets}
  return family_of(config).flops_per_example(lengths)


def test_t5_base_flops():
  assert _flops(T5_V11_BASE, 512, 114) == pytest.approx(426e9, rel=0.01)


def test_small_config_by_hand():
  config = ModelConfig(d_model=4, d_ff=8, num_heads=2, d_kv=2, num_encoder_layers=1,
                       num_decoder_layers=1, vocab_size=10, mlp_activation="relu")
  # attention block 4*4*2*2 = 64, MLP 2*4*8 = 64: encoder layer 128, decoder layer 192,
  # P_xkv = 2*4*2*2 = 32; attention pairs cost 12*h*d_kv = 48.
  # 6*[128*3 + (192-32)*2 + 32*3 + 4*10*2] + 48*[9 + (4 + 6)] = 6*880 + 48*19
  assert _flops(config, 3, 2) == 6 * 880 + 48 * 19
  # decoder_only over L = 3 + 2: 6*(128 + 40)*5 + 48*25
  decoder = config.replace(architecture="decoder_only")
  assert _flops(decoder, 3, 2) == 6 * 168 * 5 + 48 * 25
  # encoder_only over L = 3: 6*(128 + 40)*3 + 48*9
  encoder = config.replace(architecture="encoder_only")
  assert _flops(encoder, 3, 0) == 6 * 168 * 3 + 48 * 9
  # Gated MLP: one more d x d_ff kernel per layer (2 layers, 32 params each, over 3 and 2 tokens).
  gated = config.replace(mlp_activation="gated-gelu")
  assert _flops(gated, 3, 2) - _flops(config, 3, 2) == 6 * 32 * (3 + 2)
  # Tokens per example: what each family trains on.
  assert family_of(config).tokens_per_example(
      {"encoder_input_tokens": 3, "decoder_target_tokens": 2, "decoder_loss_weights": 2}) == 5
  assert family_of(encoder).tokens_per_example(
      {"encoder_input_tokens": 3, "mlm_target_tokens": 3}) == 3
