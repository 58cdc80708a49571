"""Benchmarks of t5lite against HF transformers' recipes (`t5lite bench <what>`).

Each benchmark module exposes `run(...) -> dict` and `main(argv) -> int`; a run prints a short
table and ends with one JSON line of its figures, including `ratio_vs_hf`.

  data            span corruption + packing throughput vs HF's FlaxDataCollatorForT5MLM
  hf_t5_collator  the HF side of `data`: a numpy re-implementation of HF's collator
  decode          greedy and beam decoding throughput vs HF's T5 `generate` on CPU
  hf_t5_decode    the HF side of `decode`: a random PyTorch T5 and its `generate`
  peft            full finetuning vs LoRA vs prompt tuning: step time, trainable params,
                  optimizer-state bytes, and ROUGE on the embedded summarization task
"""
