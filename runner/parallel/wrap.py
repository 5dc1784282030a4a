"""Put DDP or FSDP2 on a built model whose memory plan is already applied.

Order matters: the plan wraps each block's forward (checkpointing, offload), then FSDP2's
`fully_shard` goes on each block (its unshard/reshard hooks then sit outside the checkpoint, so a
recomputed block gathers its parameters again) and last on the root, which owns what no block
holds (embeddings, the head). DDP wraps the root once. The optimizer is built afterwards, on the
sharded parameters.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from ..memory.blocks import find_blocks
from ..problems import InputError, Place, Problem
from ..recipe import Recipe
from .ranks import Ranks

log = logging.getLogger(__name__)

_PARAM_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_api():
    """(fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy): public since torch 2.6, in
    torch.distributed._composable.fsdp before."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


def wrap_model(model: nn.Module, recipe: Recipe, ranks: Ranks, device: torch.device, source: str) -> nn.Module:
    """The module to call forward on: DDP around `model`, or `model` itself sharded in place by FSDP2."""
    strategy = recipe.distributed.strategy
    if not ranks.joined or strategy == "none":
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        log.info("ddp: every rank holds the whole model; gradients are averaged over %d ranks", ranks.world_size)
        return DistributedDataParallel(model, device_ids=ids)
    shard(model, recipe, device, source)
    return model


def shard(model: nn.Module, recipe: Recipe, device: torch.device, source: str, mesh=None) -> list[str]:
    """fully_shard each repeated block, then the root; returns the sharded blocks' names. `mesh`: the
    ranks to shard over (default: every rank of the process group)."""
    fully_shard, mixed_precision, cpu_offload = fsdp_api()
    knobs = recipe.memory.sharding
    reshard = True if knobs is None else knobs.reshard_after_forward
    offload = knobs is not None and knobs.offload == "cpu"
    if offload and device.type != "cuda":
        raise InputError([Problem(Place(source), "memory.sharding.offload", "cpu offload moves shards off a GPU, "
                                  "but this run trains on the CPU; set memory.sharding.offload: none")])
    options = {"reshard_after_forward": reshard, "mp_policy": _mixed_precision(recipe.precision, mixed_precision)}
    if offload:
        options["offload_policy"] = cpu_offload()
    if mesh is not None:
        options["mesh"] = mesh
    try:
        blocks = find_blocks(model, recipe.memory.blocks)
    except ValueError as err:  # no repeated blocks: the root alone is one shard unit
        log.info("fsdp: %s; sharding the model as one unit", str(err).split(": ", 1)[-1].split(";")[0])
        blocks = []
    # the root's logits are a view (reshape); ckrun's loss never writes into them in place, which is
    # what this warning, printed once per rank and step, is about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for block in blocks:
        fully_shard(block.module, **options)
    fully_shard(model, **options)
    log.info("fsdp: %d blocks and the root sharded (reshard_after_forward %s, cpu offload %s, mixed precision %s)",
             len(blocks), reshard, "on" if offload else "off", recipe.precision)
    return [block.name for block in blocks]


def _mixed_precision(precision: str, policy):
    """Compute in `precision`, reduce gradients in fp32, so no rank's sum loses bits a single process keeps."""
    dtype = _PARAM_DTYPES[precision]
    return policy() if dtype is None else policy(param_dtype=dtype, reduce_dtype=torch.float32)
