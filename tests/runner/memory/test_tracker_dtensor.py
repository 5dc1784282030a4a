"""The tracker counts what this rank holds of a DTensor (FSDP2's parameters, gradients and optimizer
state are DTensors): its local shard, not the whole tensor the DTensor stands for. Run in one process
on torch's fake process group of 2 ranks (a testing API: skipped where this torch lacks it)."""

from __future__ import annotations

import pytest
import torch

from ckrun.runner.memory.tracker import LiveBytesTracker

pytest.importorskip("torch.testing._internal.distributed.fake_pg")  # two_rank_mesh (tests/conftest.py)


@pytest.mark.parametrize("rows", [2, 64, 1000])
def test_a_sharded_tensor_counts_its_local_shard(two_rank_mesh, rows):
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.zeros(rows, 16), two_rank_mesh, [Shard(0)])
    local_bytes = sharded.to_local().untyped_storage().nbytes()
    assert local_bytes == rows // 2 * 16 * 4
    tracker = LiveBytesTracker("cpu")
    tracker.count_existing([sharded], "parameters")
    assert tracker.current_bytes == local_bytes
    with tracker:
        doubled = sharded * 2  # an op on the DTensor: its output is this rank's shard too
    assert tracker.peak_bytes == 2 * local_bytes
    del doubled
    tracker.close()
