"""Placeholder: the HF albert layout is being written."""
