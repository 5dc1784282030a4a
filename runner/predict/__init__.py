"""Predicting a step's peak memory without allocating it: the training step (runner/train/) run on
fake tensors with a plan applied (runner/memory/), and on CUDA a model of the caching allocator.
It stands above training: it uses train/, and neither train/ nor memory/ import it."""
