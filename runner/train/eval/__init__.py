"""Held-out evaluation during a run: the evaluation itself, its schedule (when, and early stopping),
custom metrics, and the best weights kept."""
