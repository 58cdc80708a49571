"""HF transformers' side of `t5lite bench decode`: a random PyTorch T5 and its `generate`.

The model is a `T5ForConditionalGeneration` built from a T5Config with t5lite's sizes
(t5lite.interop.hf.checkpoints.config_to_hf), randomly initialized from a torch seed and untied like
T5 v1.1 (transformers 5.x ties unless lm_head gets its own tensor). t5lite decodes
with the very same weights: the bench saves this model and reads it with `t5lite.load_hf`.

Decoding is HF's own `generate` with its KV cache (use_cache=True, the default), fp32, under
torch.no_grad (generate's default), with the encoder attention mask passed explicitly:
  greedy  do_sample=False, num_beams=1
  beam    do_sample=False, num_beams=K, length_penalty=alpha (HF divides by length ** alpha,
          T5X by ((5 + length) / 6) ** alpha: the searches can disagree on which finished
          hypothesis wins, so the bench reports beam agreement without requiring it)
Outputs are returned like t5lite's: start token stripped, 0-padded to max_new_tokens.
"""
from __future__ import annotations

import numpy as np

from t5lite.interop.hf import checkpoints as hf_export
from t5lite.models.config import ModelConfig


def random_model(config: ModelConfig, seed: int = 0):
  """A randomly initialized HF T5 with the config's shapes, in eval mode, on CPU."""
  import torch
  import transformers
  transformers.utils.logging.set_verbosity_error()  # no notes about untied lm_head on load
  transformers.utils.logging.disable_progress_bar()
  torch.manual_seed(seed)
  hf_config = hf_export.config_to_hf(config.replace(dropout_rate=0.0))
  hf_config.pop("architectures")
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf_config))
  if not config.tie_output_embedding:  # its own lm_head, at the init scale of T5's output layer
    weight = torch.randn_like(model.lm_head.weight) * config.d_model ** -0.5
    model.lm_head.weight = torch.nn.Parameter(weight)
  return model.eval()


class HFDecoder:
  """HF generate over numpy token batches, with inputs converted before any timing."""

  def __init__(self, model, num_threads: int | None = None):
    import torch
    self.torch = torch
    if num_threads:
      torch.set_num_threads(num_threads)
    self.model = model

  def prepare(self, inputs: np.ndarray) -> dict:
    """input_ids and the encoder attention mask (1 on non-pad tokens) as torch tensors."""
    ids = self.torch.from_numpy(np.ascontiguousarray(inputs, np.int64))
    return {"input_ids": ids, "attention_mask": (ids > 0).long()}

  def generate(self, batch: dict, *, max_new_tokens: int, method: str = "greedy",
               num_beams: int = 4, alpha: float = 0.6) -> np.ndarray:
    """(B, max_new_tokens) int32 output ids: start token stripped, 0 after EOS and at the end."""
    kwargs = dict(do_sample=False, num_beams=1)
    if method == "beam":
      kwargs = dict(do_sample=False, num_beams=num_beams, length_penalty=alpha)
    elif method != "greedy":
      raise ValueError(f"method={method!r}: the bench compares 'greedy' and 'beam'")
    with self.torch.no_grad():
      out = self.model.generate(**batch, max_new_tokens=max_new_tokens, **kwargs).numpy()
    out = out[:, 1:]  # drop decoder_start_token_id
    return np.pad(out, ((0, 0), (0, max_new_tokens - out.shape[1]))).astype(np.int32)
