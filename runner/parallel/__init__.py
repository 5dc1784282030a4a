"""Scale out: the same recipe on many ranks through torchrun, with DDP or FSDP2, never a home-made engine.

- `ranks`: the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR) read and joined
  (gloo on CPU, nccl on CUDA), each rank's slice of the global batch, the reductions metrics need.
- `wrap`: DDP, or FSDP2's `fully_shard` per block and then the root, put on after the memory plan.
- `launch`: `ckrun RECIPE --nproc N` starts torchrun on this machine and passes its exit status on.

Checkpoints of a distributed run (torch.distributed.checkpoint) live with the others in runner/train.
"""
