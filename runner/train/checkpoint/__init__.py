"""Saving and resuming the training state: the step-N directories (store), the sharded ones of a
distributed run (sharded, torch.distributed.checkpoint), the recipe's fingerprint each carries, and
--resume."""
