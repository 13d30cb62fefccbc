"""Experiment tracking: result packages with evaluation metrics."""
