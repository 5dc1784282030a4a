"""Scale out: the same recipe on many ranks through torchrun, with DDP, FSDP2, HSDP or tensor parallelism,
never a home-made engine.

- `ranks`: the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR) read and joined
  (gloo on CPU, nccl on CUDA), each rank's slice of the global batch, the reductions metrics need.
- `mesh`: the strategy's rank layout as a torch DeviceMesh (dp; replicate x shard; dp x tp) and
  which share of the batch a rank trains on.
- `wrap`: DDP, or tensor parallelism (`parallelize_module`) and then FSDP2's `fully_shard` per block
  and the root over the mesh's data-parallel part, put on after the memory plan (which linear
  layers tensor parallelism splits is runner/builders/tensor_plan.py, checked with the recipe
  before any rank starts); `grad_norm`: clipping over gradients on several meshes.
- `launch`: `ckrun RECIPE --nproc N` starts torchrun on this machine and passes its exit status on.

Checkpoints of a distributed run (torch.distributed.checkpoint) live with the others in runner/train.
"""
