"""Measuring a plan: the probe the tuner runs (warm-up and timed steps), what it found, and how far a
lossy plan moves the gradient or the update."""
