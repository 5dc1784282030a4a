"""Put DDP, FSDP2, HSDP or tensor parallelism on a built model whose memory plan is already applied.

Order matters: the plan wraps each block's forward (checkpointing, offload); then tensor parallelism
(`parallelize_module` on the mesh's `tp` dimension) splits the plan's linear layers, whose hooks
redistribute their inputs and outputs, so a recomputed block runs its collectives again; then FSDP2's
`fully_shard` goes on each block (its unshard/reshard hooks then sit outside the checkpoint, so a
recomputed block gathers its parameters again) and last on the root, which owns what no block
holds (embeddings, the head), over the mesh's data-parallel part: all of it for fsdp, its 2-D
replicate x shard for hsdp (HSDP), its `dp` dimension beside `tp` (2-D, as torchtitan composes
them). DDP wraps the root once. The optimizer is built afterwards, on the sharded parameters.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from ..builders.tensor_plan import resolve
from ..memory.blocks import find_blocks
from ..problems import InputError, Place, Problem
from ..recipe.recipe import Recipe
from .mesh import data_mesh, tensor_mesh
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
    """The module to call forward on: DDP around `model`, or `model` itself split in place over the mesh."""
    if not ranks.joined or ranks.mesh is None:
        return model
    if not recipe.distributed.shards:  # ddp: whole copies, gradients averaged
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        log.info("%s", recipe.distributed.describe(ranks.world_size))
        return DistributedDataParallel(model, device_ids=ids)
    return place_on_mesh(model, recipe, ranks.mesh, device, source)


def place_on_mesh(model: nn.Module, recipe: Recipe, mesh, device: torch.device, source: str) -> nn.Module:
    """Tensor parallelism over the mesh's `tp` dimension, then FSDP2 over its data-parallel part, in place
    (the estimate does the same over a fake process group's mesh)."""
    if tensor_mesh(mesh) is not None:
        split_layers(model, recipe, tensor_mesh(mesh), source)
    data = data_mesh(mesh)
    if data is not None:
        shard(model, recipe, device, source, data)
    elif recipe.memory.sharding is not None:
        log.info("memory.sharding: no FSDP2 with a single data-parallel group (every rank is in the tensor "
                 "group); the knobs have nothing to act on")
    return model


def split_layers(model: nn.Module, recipe: Recipe, mesh, source: str) -> dict[str, str]:
    """parallelize_module with the resolved plan (runner/builders/tensor_plan.py); returns it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan, problems = resolve(model, recipe.distributed)
    if problems:  # the recipe checks found these before any rank started; a model built otherwise lands here
        raise InputError([Problem(Place(source), problem.key, problem.message) for problem in problems])
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
    columns = sum(style == "colwise" for style in plan.values())
    log.info("tp: %d linear layers split over %d ranks (%d colwise, %d rowwise)", len(plan), mesh.size(), columns,
             len(plan) - columns)
    return plan


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
        log.info("%s: %s; sharding the model as one unit", recipe.distributed.label(),
                 str(err).split(": ", 1)[-1].split(";")[0])
        blocks = []
    # the root's logits are a view (reshape); ckrun's loss never writes into them in place, which is
    # what this warning, printed once per rank and step, is about
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for block in blocks:
        fully_shard(block.module, **options)
    fully_shard(model, **{**options, "reshard_after_forward": root_reshards(recipe.memory)})
    if reshard and not root_reshards(recipe.memory):
        log.info("%s: the root's parameters (embeddings, the output projection) stay gathered from the forward to "
                 "the backward: memory.loss %s runs the output projection after the model's forward and again in the "
                 "backward", recipe.distributed.label(), recipe.memory.loss.label())
    log.info("%s: %d blocks and the root sharded over %s (reshard_after_forward %s, cpu offload %s, mixed "
             "precision %s)", recipe.distributed.label(), len(blocks), _mesh_text(mesh), reshard,
             "on" if offload else "off", recipe.precision)
    return [block.name for block in blocks]


def root_reshards(plan) -> bool:
    """Whether the root's FSDP2 unit frees its gathered parameters after the forward: as the blocks do
    (memory.sharding), unless the loss splits the head (memory.loss chunked), which reads the output
    projection's weight after the forward returns and recomputes each piece from it in the backward, before
    the root's own backward would gather it again."""
    reshard = True if plan.sharding is None else plan.sharding.reshard_after_forward
    return reshard and not plan.loss.splits_head


def _mesh_text(mesh) -> str:
    if mesh is None:
        return "every rank"
    return " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names or (), mesh.shape, strict=False))


def _mixed_precision(precision: str, policy):
    """Compute in `precision`, reduce gradients in fp32, so no rank's sum loses bits a single process keeps."""
    dtype = _PARAM_DTYPES[precision]
    return policy() if dtype is None else policy(param_dtype=dtype, reduce_dtype=torch.float32)
