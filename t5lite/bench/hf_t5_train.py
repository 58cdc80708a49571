"""HF transformers' PyTorch T5 train step: the baseline of `t5lite bench train`.

The model is `T5ForConditionalGeneration` built from the very weights t5lite starts from
(t5lite.interop.hf.checkpoints.save_hf, then `from_pretrained`), so both sides begin identical. The
step is what HF's Trainer does per batch, minus its bookkeeping:

    loss = model(input_ids=..., attention_mask=..., labels=...).loss   # mean CE over labels != -100
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)

Batches are HF style: examples padded to the longest of their batch (`pad_examples`, what
`DataCollatorForSeq2Seq(padding="longest", label_pad_token_id=-100)` produces), labels -100 on
pads, an encoder attention mask; HF derives decoder_input_ids by shifting the labels right.

Choices that favour HF, none that slow it down:
  * torch.optim.AdamW with `fused=True` (one kernel over all params; faster than the default
    for-loop implementation on CPU) when the installed torch supports it.
  * No gradient clipping (HF Trainer clips at 1.0 by default; t5lite does not clip either).
  * Weight decay on params of rank >= 2 only, as t5lite's AdamW (the same update, not a speed
    choice); betas, eps and learning rate are the caller's, the same as t5lite's.
  * fp32 weights; with a bfloat16 run config the forward and backward run under
    torch.autocast(bfloat16), HF's mixed precision.
"""
from __future__ import annotations

import contextlib
import tempfile
from typing import Sequence

import numpy as np

from t5lite.interop.hf import checkpoints as hf_export
from t5lite.models.config import ModelConfig

IGNORE_INDEX = -100  # HF's label pad: CrossEntropyLoss(ignore_index=-100)


def pad_examples(examples: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
  """(inputs, targets) token arrays -> one batch padded to its longest inputs / targets.

  Example: [([5, 6, 1], [7, 1]), ([8, 1], [9, 4, 1])] ->
    input_ids      [[5 6 1] [8 1 0]]
    attention_mask [[1 1 1] [1 1 0]]
    labels         [[7 1 -100] [9 4 1]]
  """
  in_len = max(1, max(len(i) for i, _ in examples))
  out_len = max(1, max(len(t) for _, t in examples))
  input_ids = np.zeros((len(examples), in_len), np.int64)
  attention_mask = np.zeros((len(examples), in_len), np.int64)
  labels = np.full((len(examples), out_len), IGNORE_INDEX, np.int64)
  for row, (inputs, targets) in enumerate(examples):
    input_ids[row, :len(inputs)] = inputs
    attention_mask[row, :len(inputs)] = 1
    labels[row, :len(targets)] = targets
  return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def useful_tokens(batch: dict[str, np.ndarray]) -> int:
  """Non-pad input tokens plus non-pad target tokens of an HF batch."""
  return int(np.sum(batch["attention_mask"]) + np.sum(batch["labels"] != IGNORE_INDEX))


def model_from_t5lite(config: ModelConfig, params, device: str = "cpu"):
  """The HF model holding t5lite's params (through the checkpoint export), in train mode."""
  import torch
  import transformers
  # Quiet: the load's progress bar, and 5.x's note that it leaves the different lm_head untied.
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  with tempfile.TemporaryDirectory() as path:
    hf_export.save_hf(config.replace(dtype="float32", param_dtype="float32"), params, path)
    model = transformers.T5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
  if not config.tie_output_embedding and (
      model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()):
    # transformers 5.x may tie on load (see export/hf.py): give lm_head its own tensor.
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
  return model.to(device).train()


def make_adamw(model, *, learning_rate: float, b1: float, b2: float, eps: float,
               weight_decay: float):
  """torch AdamW with t5lite's decay rule (rank >= 2 decays), fused when available."""
  import torch
  decay = [p for p in model.parameters() if p.ndim >= 2]
  no_decay = [p for p in model.parameters() if p.ndim < 2]
  groups = [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]
  kwargs = dict(lr=learning_rate, betas=(b1, b2), eps=eps)
  try:
    return torch.optim.AdamW(groups, fused=True, **kwargs)
  except (RuntimeError, TypeError):  # older torch, or a device without the fused kernel
    return torch.optim.AdamW(groups, **kwargs)


class HFTrainer:
  """HF's model and optimizer on one device, stepping on batches of `pad_examples` form."""

  def __init__(self, config: ModelConfig, params, *, learning_rate: float, b1: float,
               b2: float, eps: float, weight_decay: float, device: str = "cpu",
               num_threads: int | None = None):
    import torch
    self.torch = torch
    if num_threads:
      torch.set_num_threads(num_threads)
    self.device = device
    self.model = self.make_model(config, params, device)
    self.optimizer = make_adamw(self.model, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                weight_decay=weight_decay)
    self.autocast_dtype = None if config.dtype == "float32" else getattr(torch, config.dtype)

  def make_model(self, config: ModelConfig, params, device: str):
    """The HF model holding t5lite's params (T5ForConditionalGeneration here)."""
    return model_from_t5lite(config, params, device)

  def to_device(self, batch: dict[str, np.ndarray]) -> dict:
    """A batch as torch tensors on the model's device (done before any timing)."""
    return {k: self.torch.from_numpy(np.ascontiguousarray(v)).to(self.device)
            for k, v in batch.items()}

  def _autocast(self):
    if self.autocast_dtype is None:
      return contextlib.nullcontext()
    return self.torch.autocast(self.device.split(":")[0], dtype=self.autocast_dtype)

  def step(self, batch: dict):
    """One optimizer update; returns the loss (a detached 0-d tensor)."""
    with self._autocast():
      loss = self.model(**batch).loss
    loss.backward()
    self.optimizer.step()
    self.optimizer.zero_grad(set_to_none=True)
    return loss.detach()

  def loss(self, batch: dict) -> float:
    """The loss of a batch without an update (no grad)."""
    with self.torch.no_grad(), self._autocast():
      return float(self.model(**batch).loss)

  def synchronize(self) -> None:
    if self.device.startswith("cuda"):
      self.torch.cuda.synchronize()

  def peak_device_bytes(self) -> int | None:
    """Peak allocated accelerator memory (None on CPU, where RSS is measured instead)."""
    if self.device.startswith("cuda"):
      return int(self.torch.cuda.max_memory_allocated())
    return None

  @property
  def attention_implementation(self) -> str:
    return str(getattr(self.model.config, "_attn_implementation", "unknown"))
