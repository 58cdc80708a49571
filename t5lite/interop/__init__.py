"""Formats t5lite exchanges with other tools, and the loaders training and evaluation stand on:
HF transformers (hf/), T5X (t5x/), peft (peft/), jax.export serving artifacts (serving/),
params-only MODEL_DIRs, frozen models beside a run, distillation students."""
