"""Memory plans applied to a model: its repeated blocks, checkpointing, activation offload, and
measuring or predicting the peak memory of a step."""
