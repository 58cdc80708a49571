"""Placeholder: the HF gpt2 layout is being written."""
