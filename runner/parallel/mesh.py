"""The rank layout as a torch `DeviceMesh`: built once after joining, from the strategy's `mesh_dims`.

A strategy names its dimensions outermost first (runner/plan/strategies.py): ddp and fsdp `dp`; hsdp
`replicate` x `shard`; tp `dp` x `tp`. `init_device_mesh` lays ranks out row-major, so the last
dimension's ranks are adjacent (0-1, 2-3): a tensor-parallel group, or an HSDP shard group, sits on
one node's consecutive ranks, where its traffic is fastest, as torchtitan lays out its 2-D mesh.

Which ranks see the same samples follows from that layout: the dimensions a strategy does not count
as data-parallel (`tp`) are innermost, so a rank's data-parallel coordinate is its rank divided by
the ranks of one model-parallel group. The trainer slices the global batch by that coordinate.
"""

from __future__ import annotations

from ..plan.strategies import Strategy

TENSOR_DIM = "tp"  # the mesh dimension whose ranks split layers and see the same samples


def data_coordinate(strategy: Strategy, rank: int, world_size: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel groups): which share of the global
    batch it trains on. The ranks of one tensor-parallel group are adjacent, so they share the index."""
    groups = strategy.data_parallel(world_size)
    return rank // (world_size // groups), groups


def build_mesh(strategy: Strategy, world_size: int, device_type: str):
    """The strategy's DeviceMesh over the joined group; None for a strategy without one (none)."""
    dims = strategy.mesh_dims(world_size)
    if not dims:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    if len(dims) > 1 and hasattr(mesh, "_flatten"):
        # a value reduced over both dimensions (the norm of a gradient split on dp and tp, for clipping)
        # then takes one all-reduce over every rank instead of one per dimension, which torch warns of
        mesh._flatten()
    return mesh


def node_problem(dims: dict[str, int], local_world: int) -> str | None:
    """Why the innermost groups of a 2-D layout (tp's tensor groups, hsdp's shard groups) would span
    machines, where their traffic, every layer's for tp, is slowest; None when each fits on one."""
    if len(dims) < 2 or local_world < 1:
        return None
    name, size = list(dims.items())[-1]
    if local_world % size == 0:
        return None
    return (f"{name} groups of {size} ranks do not fit the {local_world} ranks of a machine: some span machines "
            f"and their collectives cross the network; choose a {name} size that divides {local_world}")


def data_mesh(mesh):
    """The mesh's data-parallel part, which FSDP2 shards over: the whole mesh for fsdp and hsdp (2-D:
    replicate x shard), its `dp` dimension beside tensor parallelism; None when that part is one rank."""
    names = [name for name in mesh.mesh_dim_names if name != TENSOR_DIM]
    if len(names) == len(mesh.mesh_dim_names):
        return mesh
    part = mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]
    return part if part.size() > 1 else None


def tensor_mesh(mesh):
    """The mesh's tensor-parallel dimension; None when the strategy splits no layers."""
    return mesh[TENSOR_DIM] if TENSOR_DIM in mesh.mesh_dim_names else None
