"""What the time model needs to know about a device: peak FLOP/s, memory bandwidth, links, and the
share of each peak each class of kernel reaches (`efficiency.Efficiency`)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .efficiency import Dtype, Efficiency

MiB = 1 << 20
GB = 10**9


class DeviceFacts(BaseModel):
    """One device's figures for the roofline time model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """The name torch reports (`torch.cuda.get_device_name()`), or `cpu (...)`."""
    kind: Literal["cuda", "cpu"] = "cuda"
    matmul_tflops: dict[Dtype, float]
    """Dense peak TFLOP/s of matrix products per compute dtype (tf32: fp32 inputs on tensor cores)."""
    memory_gbs: float = Field(gt=0)
    """Device memory bandwidth, GB/s."""
    memory_bytes: int = 0
    """The card's memory as the driver reports it (0: unknown, or a CPU)."""
    host_gbs: float = 0.0
    """Pinned host <-> device copies, GB/s each way: what activation offload moves over."""
    host_adamw_per_s: float = Field(0.0, ge=0)
    """Parameters a second the host's fused CPU AdamW updates (memory.optimizer_offload's host step);
    0: the time model's assumption for a GPU machine's host (runner/predict/roofline.py HOST_ADAMW_PER_S)."""
    peer_gbs: float = 0.0
    """GPU <-> GPU within a host, GB/s each way (NVLink, else PCIe): what collectives move over there."""
    network_gbs: float = Field(0.0, ge=0)
    """Each GPU's share of the host-to-host network, GB/s each way (InfiniBand or RoCE: 400 Gb/s a GPU is
    50): what a collective whose ranks span hosts moves over; 0: not known (priced at `peer_gbs`)."""
    gpus_per_host: int = Field(8, gt=0)
    """GPUs a host holds: ranks beyond them are on other hosts (torchrun's --nproc-per-node)."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (sizes the cuBLAS workspace the memory estimate counts)."""
    sms: int = Field(0, ge=0)
    """Streaming multiprocessors, for the wave quantisation of products (0: not modelled)."""
    efficiency: Efficiency | None = None
    """Per-op-class shares of the peaks (runner/predict/calibration.json); unset: `matmul_efficiency`
    for every kernel's FLOPs and `memory_efficiency` for every kernel's bytes (a measured facts file,
    torch's table, a CPU)."""
    matmul_efficiency: float = Field(0.7, gt=0, le=1)
    """Share of `matmul_tflops` every kernel reaches where `efficiency` is unset."""
    memory_efficiency: float = Field(0.75, gt=0, le=1)
    """Share of `memory_gbs` every kernel reaches where `efficiency` is unset."""
    launch_us: float = Field(5.0, ge=0)
    """The least an op costs: eager dispatch plus kernel launch, microseconds."""
    python_mode_us: float = Field(26.0, ge=0)
    """What an op adds on the host when a Python dispatch mode handles it (selective checkpointing's
    cache, in forward and recompute), microseconds; a kernel that outlasts it hides it (the op's
    floor). From the H100 run of 2026-11-22: BERT-large's selective at micro-batch 16 took 0.118 s
    more than no plan, which this model reproduces at 26 us (its recompute alone: 0.037 s; 5,184 ops
    run under the mode, 4 micro-batches of 1,296). An earlier count of about 2,000 ops, with the mode's
    cost taken as additive, had made it 50 us."""
    source: str = ""
    """Where the figures come from."""

    def peak_flops(self, dtype: str) -> float:
        """The datasheet peak of `dtype`: what MFU and HFU are stated against."""
        tflops = self.matmul_tflops.get(dtype) or self.matmul_tflops.get("fp32") or min(self.matmul_tflops.values())
        return tflops * 1e12

    def compute_rate(self, op_class: str, dtype: str, family: str = "", backward: bool = False,
                     causal: bool = False) -> float:
        """Achievable FLOP/s of an op of `op_class` (efficiency.OP_CLASSES) computed in `dtype`."""
        share = self.efficiency.compute(op_class, dtype, family, backward, causal) if self.efficiency \
            else self.matmul_efficiency
        return self.peak_flops(dtype) * share

    def traffic_rate(self, op_class: str, backward: bool = False) -> float:
        """Achievable device-memory bytes per second of an op of `op_class` (`norm` too)."""
        share = self.efficiency.traffic(op_class, backward) if self.efficiency else self.memory_efficiency
        return self.memory_gbs * 1e9 * share

    def fill_seconds(self, dtype: str) -> float:
        """A product's fixed time beside its FLOPs (efficiency.matmul_fill_us), seconds."""
        return (self.efficiency.matmul_fill_us.get(dtype, 0.0) if self.efficiency else 0.0) * 1e-6

    def floor_seconds(self) -> float:
        """The least an op costs: the calibration's launch floor where it gives one, else `launch_us`."""
        given = self.efficiency.launch_us if self.efficiency else None
        return (self.launch_us if given is None else given) * 1e-6

    def ring_rate(self, ranks: int, ranks_per_host: int) -> float:
        """Bytes per second each rank of a ring collective over `ranks` ranks, `ranks_per_host` of them on each
        host, moves: the peer link within one host; across hosts, each host's rails together (its ranks'
        network shares: NCCL spreads its rings over the rails) unless the peer link is slower. 0 when the device
        has no peer link (a CPU)."""
        peer = self.peer_gbs * 1e9
        if ranks <= ranks_per_host or not self.network_gbs:
            return peer
        return min(peer, ranks_per_host * self.network_gbs * 1e9)

    def wave_share(self, outputs: tuple[int, int, int] | None, flops: float = 0.0) -> float:
        """The share of the SMs a product of `outputs` (batch, rows, columns) keeps busy. Its output tiles run
        `sms` at a time and a last partial wave leaves the rest idle (wave quantisation); a product with
        few tiles and a deep inner dimension (a weight gradient) is split along it as cuBLAS's split-K and
        stream-K kernels do, into the number of parts, up to 16 of at least 512 deep, that fills the waves
        best (Osama et al. 2023, Stream-K, https://arxiv.org/abs/2301.03598)."""
        if not outputs or not self.sms or self.efficiency is None:
            return 1.0
        batch, rows, columns = outputs
        edge = self.efficiency.tile
        tiles = batch * math.ceil(rows / edge) * math.ceil(columns / edge)
        if not tiles:
            return 1.0
        depth = int(flops / (2 * batch * rows * columns)) if flops else 0
        splits = range(1, max(1, min(16, depth // 512)) + 1)
        return max(units / (math.ceil(units / self.sms) * self.sms) for units in (tiles * k for k in splits))
