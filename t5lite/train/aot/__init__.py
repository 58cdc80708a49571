"""Ahead-of-time compiles of the train step (or decoding) for a topology, and their cost report."""
