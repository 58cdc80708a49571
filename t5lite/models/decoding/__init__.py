"""Decoding: greedy, sampling and beam search over a model's cached decoder; the state types."""
