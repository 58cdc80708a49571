"""The batches of `t5lite bench train`: both sides' views of the same examples.

  pretrain   one random batch of ids in [2, vocab): t5lite's feature dict and HF's padded
             dict (no padding at these fixed lengths).
  finetune   t5lite: packed batches of the embedded task from the real pipeline; HF: the very
             examples those rows hold (`unpack`), shuffled and padded B at a time.
"""
from __future__ import annotations

import numpy as np

from t5lite.bench.hf_t5_train import pad_examples

FINETUNE_TASK = "stdlib_docstring_summary"


def shift_right(targets: np.ndarray) -> np.ndarray:
  """Decoder inputs of unpacked targets: [[5 6 1]] -> [[0 5 6]]."""
  return np.pad(targets[:, :-1], ((0, 0), (1, 0)))


def pretrain_batches(vocab_size: int, batch_size: int, lengths: tuple[int, int], seed: int):
  """([t5lite batch], [HF batch]): one random batch of ids in [2, vocab), no padding."""
  rng = np.random.default_rng(seed)
  inputs = rng.integers(2, vocab_size, (batch_size, lengths[0]), dtype=np.int32)
  targets = rng.integers(2, vocab_size, (batch_size, lengths[1]), dtype=np.int32)
  t5lite = {"encoder_input_tokens": inputs, "decoder_input_tokens": shift_right(targets),
            "decoder_target_tokens": targets,
            "decoder_loss_weights": np.ones_like(targets)}
  return [t5lite], [pad_examples(list(zip(inputs, targets)))]


def unpack(batch: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
  """The (inputs, targets) examples a packed EncDec batch holds, row by row."""
  examples = []
  for row in range(batch["encoder_input_tokens"].shape[0]):
    enc, dec = batch["encoder_segment_ids"][row], batch["decoder_segment_ids"][row]
    for segment in np.unique(np.concatenate([enc, dec])):
      if segment > 0:
        examples.append((batch["encoder_input_tokens"][row][enc == segment],
                         batch["decoder_target_tokens"][row][dec == segment]))
  return examples


def finetune_batches(batch_size: int, lengths: tuple[int, int], steps: int, seed: int):
  """(t5lite packed batches, HF padded batches of the same examples, parity batch, vocab size).

  The parity batch is every example of t5lite's first batch, padded as one HF batch: its HF
  loss equals t5lite's first loss when both models are the same.
  """
  import t5lite_tasks  # noqa: F401 (registers the embedded tasks; builds the vocab once)
  from t5lite.data.converters.sequence import EncDecFeatureConverter
  from t5lite.data.pipeline import PipelineConfig, get_dataset
  from t5lite.data.registry import TaskRegistry
  task = TaskRegistry.get(FINETUNE_TASK)
  config = PipelineConfig(global_batch_size=batch_size, seed=seed,
                          task_feature_lengths={"inputs": lengths[0], "targets": lengths[1]})
  iterator = get_dataset(FINETUNE_TASK, config, EncDecFeatureConverter(pack=True))
  packed = [next(iterator) for _ in range(steps)]
  examples = [ex for batch in packed for ex in unpack(batch)]
  order = np.random.default_rng(seed).permutation(len(examples))  # HF's DataLoader shuffles
  examples = [examples[i] for i in order]
  hf = [pad_examples(examples[i:i + batch_size]) for i in range(0, len(examples), batch_size)]
  vocab_size = task.output_features["targets"].vocabulary.vocab_size
  return packed, hf, pad_examples(unpack(packed[0])), vocab_size


def t5lite_useful_tokens(batch: dict[str, np.ndarray]) -> int:
  if "encoder_segment_ids" not in batch:  # pretrain: no padding
    return int(batch["encoder_input_tokens"].size + batch["decoder_target_tokens"].size)
  return int(np.sum(batch["encoder_segment_ids"] > 0) + np.sum(batch["decoder_segment_ids"] > 0))


# --- BERT and GPT-2 (`--family bert|gpt2`): one random batch, no padding ----------------------

BERT_CLS, BERT_SEP, BERT_MASK = 101, 102, 103  # bert-base-uncased's special ids


def bert_batches(vocab_size: int, batch_size: int, length: int, seed: int,
                 mask_rate: float = 0.15):
  """([t5lite batch], [HF batch]): BERT pretraining rows `[CLS] A [SEP] B [SEP]` of random ids,
  token types 0 on A and 1 on B, 15% of the non-special positions chosen for the MLM loss
  (80% of them [MASK], 10% a random id, 10% kept, as BERT's collator) and a random
  next-sentence label per row. t5lite: encoder_input_tokens, encoder_token_type_ids,
  mlm_target_tokens / mlm_loss_weights, sentence_labels; HF: input_ids, attention_mask,
  token_type_ids, labels (-100 where not chosen), next_sentence_label.
  """
  if length < 5:
    raise ValueError(f"a BERT row needs length >= 5, got {length}")
  rng = np.random.default_rng(seed)
  low = min(1000, vocab_size // 2)  # bert-base-uncased's word pieces start near 1000
  ids = rng.integers(low, vocab_size, (batch_size, length), dtype=np.int32)
  split = rng.integers(2, length - 2, batch_size)  # [SEP] of segment A at column split
  col = np.arange(length)[None, :]
  special = (col == 0) | (col == split[:, None]) | (col == length - 1)
  ids = np.where(col == 0, BERT_CLS, np.where(special, BERT_SEP, ids)).astype(np.int32)
  types = (col > split[:, None]).astype(np.int32)
  chosen = (rng.random(ids.shape) < mask_rate) & ~special
  chosen[~chosen.any(axis=1), 1] = True  # every row trains on at least one token
  draw = rng.random(ids.shape)
  inputs = np.where(chosen & (draw < 0.8), BERT_MASK, ids)
  inputs = np.where(chosen & (draw >= 0.8) & (draw < 0.9),
                    rng.integers(low, vocab_size, ids.shape), inputs).astype(np.int32)
  sentence = rng.integers(0, 2, batch_size, dtype=np.int32)
  t5lite = {"encoder_input_tokens": inputs, "encoder_token_type_ids": types,
            "mlm_target_tokens": ids, "mlm_loss_weights": chosen.astype(np.int32),
            "sentence_labels": sentence}
  hf = {"input_ids": inputs.astype(np.int64), "attention_mask": np.ones_like(ids, np.int64),
        "token_type_ids": types.astype(np.int64),
        "labels": np.where(chosen, ids, -100).astype(np.int64),
        "next_sentence_label": sentence.astype(np.int64)}
  return [t5lite], [hf]


def gpt2_batches(vocab_size: int, batch_size: int, length: int, seed: int):
  """([t5lite batch], [HF batch]): rows of random ids, next-token prediction at every position
  but the last (HF's labels = input_ids, shifted inside the model). t5lite: decoder_input_tokens
  = the ids, decoder_target_tokens = the ids shifted left, decoder_loss_weights 0 on the last
  column; HF: input_ids, labels (= input_ids)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab_size, (batch_size, length), dtype=np.int32)
  targets = np.pad(ids[:, 1:], ((0, 0), (0, 1)))
  weights = np.ones_like(ids)
  weights[:, -1] = 0
  t5lite = {"decoder_input_tokens": ids, "decoder_target_tokens": targets,
            "decoder_loss_weights": weights}
  return [t5lite], [{"input_ids": ids.astype(np.int64), "labels": ids.astype(np.int64)}]


def family_batches(family: str, vocab_size: int, batch_size: int, length: int, seed: int):
  """bert_batches or gpt2_batches."""
  make = {"bert": bert_batches, "gpt2": gpt2_batches}[family]
  return make(vocab_size, batch_size, length, seed)
