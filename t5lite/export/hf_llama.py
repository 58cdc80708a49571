"""Placeholder: the HF llama layout is being written."""
