"""Evaluation: metric functions and the evaluator."""
