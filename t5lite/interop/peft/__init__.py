"""PEFT adapters: peft-library directories (LoRA, prompt, prefix), the record of a PEFT
run's base, LoRA merging, and batches that mix adapters."""
