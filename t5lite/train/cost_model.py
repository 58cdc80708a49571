"""Analytic training cost (FLOPs per sequence) and peak device throughput, for MFU.

The count is the usual "6 * params * tokens + attention" estimate (REFERENCE §6): every matmul
weight costs 2 FLOPs per token forward and 4 backward; attention scores and the weighted sum add
12 * h * d_kv per (query, key) pair over forward and backward. Only matmuls are counted: embedding
lookups, position tables, relative-bias tables, norms and softmax are left out, since they are a
rounding error next to the matmuls and MFU is conventionally quoted against matmul FLOPs.

Worked example, T5 v1.1 base (d=768, d_ff=2048, h=12, d_kv=64, 12+12 layers, V=32128, gated-GELU)
at inputs 512 / targets 114: P_enc = 84.9M, P_dec = 113.2M, P_xkv = 14.2M ->
6 * 64.84e9 + 36.88e9 = 425.9 GFLOP per sequence.
"""
from __future__ import annotations

import re

from t5lite.models.config import ModelConfig


def _attention_params(config: ModelConfig) -> int:
  """Q, K, V and output projections of one attention block."""
  return 4 * config.d_model * config.num_heads * config.d_kv


def _mlp_params(config: ModelConfig) -> int:
  """wi (wi_0 and wi_1 when gated) and wo of one MLP block."""
  num_in = 2 if config.gated_mlp else 1
  return (num_in + 1) * config.d_model * config.d_ff


def encoder_layer_params(config: ModelConfig) -> int:
  """Matmul weights of one encoder layer (self-attention + MLP)."""
  return _attention_params(config) + _mlp_params(config)


def decoder_layer_params(config: ModelConfig) -> int:
  """Matmul weights of one decoder layer: self-attention, cross-attention (encoder_decoder
  only; a decoder_only layer has none) and MLP."""
  cross = _attention_params(config) if config.architecture == "encoder_decoder" else 0
  return _attention_params(config) + cross + _mlp_params(config)


def flops_per_sequence(config: ModelConfig, inputs_length: int, targets_length: int) -> float:
  """Training FLOPs (forward + backward) for one sequence of the given feature lengths.

  encoder_decoder (REFERENCE §6, exactly):
    6*[P_enc*L_in + (P_dec - P_xkv)*L_tgt + P_xkv*L_in + d*V*L_tgt]
      + 12*h*d_kv*[n_enc*L_in^2 + n_dec*(L_tgt^2 + L_tgt*L_in)]
    with P_xkv = 2*d*h*d_kv per decoder layer: the cross-attention K/V projections run over
    the L_in encoder positions, not the L_tgt decoder ones.
  decoder_only: one stack over L = L_in + L_tgt (the converter concatenates inputs and
    targets for a prefix LM; pass inputs_length=0 for a plain LM):
    6*[P_dec*L + d*V*L] + 12*h*d_kv*n_dec*L^2
  encoder_only (MLM): one stack over L = L_in, the output projection at every position
    (targets_length is ignored, since MLM targets are aligned with the inputs):
    6*[P_enc*L + d*V*L] + 12*h*d_kv*n_enc*L^2
  Attention is counted over the full L x L square even when causal, as in §6, so the figures
  stay comparable with the published ones.
  """
  d, vocab = config.d_model, config.vocab_size
  attn = 12 * config.num_heads * config.d_kv
  n_enc, n_dec = config.num_encoder_layers, config.num_decoder_layers
  if config.architecture == "encoder_decoder":
    l_in, l_tgt = inputs_length, targets_length
    p_enc = n_enc * encoder_layer_params(config)
    p_dec = n_dec * decoder_layer_params(config)
    p_xkv = n_dec * 2 * d * config.num_heads * config.d_kv
    dense = p_enc * l_in + (p_dec - p_xkv) * l_tgt + p_xkv * l_in + d * vocab * l_tgt
    return float(6 * dense + attn * (n_enc * l_in**2 + n_dec * (l_tgt**2 + l_tgt * l_in)))
  if config.architecture == "decoder_only":
    length = inputs_length + targets_length
    p_dec = n_dec * decoder_layer_params(config)
    return float(6 * (p_dec + d * vocab) * length + attn * n_dec * length**2)
  length = inputs_length
  p_enc = n_enc * encoder_layer_params(config)
  return float(6 * (p_enc + d * vocab) * length + attn * n_enc * length**2)


# Dense bf16 peak FLOP/s per chip (vendor figures; a large matmul reaches ~80% on H100).
PEAK_FLOPS: dict[str, float] = {
    "h100": 989e12,
    "h200": 989e12,
    "a100": 312e12,
    "tpu v4": 275e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
}

# jax device_kind strings vary ('NVIDIA H100 80GB HBM3', 'TPU v5 lite', 'TPU v5'), so each
# table key is matched by a pattern, most specific first ('TPU v5 lite' before 'TPU v5').
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\bh100\b", "h100"),
    (r"\bh200\b", "h200"),
    (r"\ba100\b", "a100"),
    (r"\bv4\b", "tpu v4"),
    (r"\bv5\s*(e|lite(pod)?)\b", "tpu v5e"),
    (r"\bv5\s*p\b|\bv5$", "tpu v5p"),
)


def peak_flops(device_kind: str) -> float | None:
  """Peak bf16 FLOP/s of one device from its jax `device_kind`, or None when unknown (CPU,
  unlisted GPUs), in which case MFU is not reported."""
  kind = device_kind.strip().lower()
  for pattern, key in _DEVICE_PATTERNS:
    if re.search(pattern, kind):
      return PEAK_FLOPS[key]
  return None


def mfu(flops_per_step: float, step_seconds: float, peak_total: float) -> float:
  """Model FLOPs utilization: achieved FLOP/s over the peak of all devices together (a
  fraction, 0.41 = 41%)."""
  if step_seconds <= 0 or peak_total <= 0:
    raise ValueError(f"step_seconds and peak_total must be positive, got {step_seconds}, "
                     f"{peak_total}")
  return flops_per_step / step_seconds / peak_total
