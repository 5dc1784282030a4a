"""Memory plans applied to a model: its repeated blocks, checkpointing, activation offload, and
measuring the peak memory of a step. Predicting it without running it is runner/predict/."""
