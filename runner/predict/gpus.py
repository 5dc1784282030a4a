"""The GPUs ckrun knows by name: one row each, with the reported names it answers to.

A row is a card's dense datasheet figures (tensor-core rows without 2:4 sparsity), its memory as
`nvidia-smi` shows it where that was seen (else the datasheet's decimal gigabytes, which is the
lower of the two), its links, its streaming multiprocessors (the time model's wave quantisation)
and the patterns of the names `torch.cuda.get_device_name()` reports for it. A name is matched
after upper-casing, dropping everything but letters and digits and a leading "NVIDIA"; rows are
tried in order and the first whose pattern matches wins, so a row that names a variant
(`H100 NVL`, `GH200`) comes before the plain one (`H100`, `H200`), which a test holds.

Links: `host_gbs` is pinned host <-> device copies each way: PCIe 5 x16 cards about 55 GB/s (as
measured on the H100 lent here), PCIe 4 x16 about 25, the GH200's NVLink-C2C 450 (900 GB/s
both ways together). `peer_gbs` is GPU <-> GPU each way, what a ring collective runs at: NVLink
on SXM boards (A100 300, H100/H200 450, B200 900), PCIe on PCIe cards. A PCIe card's NVLink
bridge joins two cards (the H200 NVL's up to four), so a ring over more runs at PCIe rate, the
rate used here; an A100 PCIe has no NVLink peer link unless bridged.

Between hosts: `network_gbs` is each GPU's share of the host-to-host network, from the vendor's reference
system for the SXM boards (one InfiniBand port a GPU: DGX A100 eight 200 Gb/s HDR ports, 25 GB/s a GPU;
DGX H100, DGX H200 and DGX B200 eight 400 Gb/s ConnectX-7 ports, 50 GB/s a GPU), 0 where no reference
system fixes it (PCIe cards: priced at their peer rate); `gpus_per_host` the GPUs of that system (8).
A cluster that differs says so in a facts file (`--gpu FILE.json`, `base` plus the fields that differ).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .efficiency import calibration
from .device_facts import GB, DeviceFacts, MiB


@dataclass(frozen=True)
class GpuRow:
    key: str
    """The short name `--gpu` takes."""
    patterns: tuple[str, ...]
    """Regular expressions over the squeezed reported name (module docstring)."""
    facts: DeviceFacts

    def answers_to(self, reported: str) -> bool:
        squeezed = squeeze(reported)
        return any(re.search(pattern, squeezed) for pattern in self.patterns)


def squeeze(name: str) -> str:
    """`NVIDIA A100-SXM4-40GB` -> `A100SXM440GB`: what a row's patterns read."""
    return re.sub(r"[^A-Z0-9]", "", name.upper()).removeprefix("NVIDIA")


def _row(key: str, patterns: tuple[str, ...], name: str, fp32: float, tf32: float, half: float, memory_gbs: float,
         memory: int, host_gbs: float, peer_gbs: float, capability: tuple[int, int], sms: int,
         source: str, network_gbs: float = 0.0) -> GpuRow:
    entry = calibration().entry_for(key, capability)
    facts = DeviceFacts(name=name, matmul_tflops={"fp32": fp32, "tf32": tf32, "bf16": half, "fp16": half},
                        memory_gbs=memory_gbs, memory_bytes=memory, host_gbs=host_gbs, peer_gbs=peer_gbs,
                        network_gbs=network_gbs, capability=capability, sms=sms, efficiency=entry.efficiency,
                        source=f"{source}; efficiencies: {entry.label()}")
    return GpuRow(key, patterns, facts)


ROWS: tuple[GpuRow, ...] = (
    _row("gh200-144gb", (r"^GH200.*144G",), "NVIDIA GH200 144G HBM3e", 67, 494.7, 989.4, 4900, 144 * GB, 450, 450,
         (9, 0), 132, "NVIDIA GH200 datasheet (dense; the H100's rates with 144 GB HBM3e at 4.9 TB/s)"),
    _row("gh200", (r"^GH200",), "NVIDIA GH200 480GB", 67, 494.7, 989.4, 4000, 96 * GB, 450, 450, (9, 0), 132,
         "NVIDIA GH200 datasheet (dense; the H100's rates with 96 GB HBM3 at 4 TB/s; NVLink-C2C to the "
         "Grace CPU 900 GB/s both ways)"),
    _row("h200-nvl", (r"^H200NVL",), "NVIDIA H200 NVL", 60, 417.5, 835, 4800, 143771 * MiB, 55, 55, (9, 0), 132,
         "NVIDIA H200 NVL datasheet (dense: half its sparse 835/1671 TFLOP/s); PCIe 5 card"),
    _row("h200", (r"^H200",), "NVIDIA H200", 67, 494.7, 989.4, 4800, 143771 * MiB, 55, 450, (9, 0), 132,
         "NVIDIA H200 SXM datasheet (dense); memory as nvidia-smi showed on the H200 lent here; "
         "between hosts 400 Gb/s a GPU (DGX H100/H200 datasheet: 8x ConnectX-7 400 Gb/s)", 50),
    _row("h100-nvl", (r"^H100NVL",), "NVIDIA H100 NVL", 60, 417.5, 835, 3900, 94 * GB, 55, 55, (9, 0), 132,
         "NVIDIA H100 NVL datasheet (dense: half its sparse 835/1671 TFLOP/s; 94 GB HBM3 at 3.9 TB/s); PCIe 5 card"),
    _row("h100-pcie", (r"^H100PCIE",), "NVIDIA H100 PCIe", 51, 378, 756, 2000, 81559 * MiB, 55, 55, (9, 0), 114,
         "NVIDIA H100 PCIe datasheet (dense; 80 GB HBM2e at 2 TB/s); PCIe 5 card"),
    _row("h100", (r"^H100",), "NVIDIA H100 80GB HBM3", 67, 494.7, 989.4, 3350, 81559 * MiB, 55, 450, (9, 0), 132,
         "NVIDIA H100 SXM5 datasheet (dense); memory as nvidia-smi showed on the H100 lent here; "
         "between hosts 400 Gb/s a GPU (DGX H100/H200 datasheet: 8x ConnectX-7 400 Gb/s)", 50),
    _row("a100-pcie-40gb", (r"^A100PCIE40GB", r"^A100.*40GB.*PCIE"), "NVIDIA A100-PCIE-40GB", 19.5, 156, 312, 1555,
         40960 * MiB, 25, 25, (8, 0), 108, "NVIDIA A100 40GB PCIe datasheet (dense); PCIe 4 card"),
    _row("a100-pcie", (r"^A100.*PCIE",), "NVIDIA A100 80GB PCIe", 19.5, 156, 312, 1935, 81920 * MiB, 25, 25, (8, 0),
         108, "NVIDIA A100 80GB PCIe datasheet (dense); PCIe 4 card"),
    _row("a100-40gb", (r"^A100.*40GB",), "NVIDIA A100-SXM4-40GB", 19.5, 156, 312, 1555, 40960 * MiB, 25, 300, (8, 0),
         108, "NVIDIA A100 40GB SXM datasheet (dense); between hosts 200 Gb/s a GPU (DGX A100 datasheet: 8x "
         "ConnectX-6 200 Gb/s HDR)", 25),
    _row("a100", (r"^A100",), "NVIDIA A100-SXM4-80GB", 19.5, 156, 312, 2039, 81920 * MiB, 25, 300, (8, 0), 108,
         "NVIDIA A100 80GB SXM datasheet (dense); between hosts 200 Gb/s a GPU (DGX A100 datasheet: 8x ConnectX-6 "
         "200 Gb/s HDR)", 25),
    _row("b200", (r"^B200",), "NVIDIA B200", 75, 1125, 2250, 8000, 180 * GB, 55, 900, (10, 0), 148,
         "NVIDIA HGX B200 datasheet, per GPU (dense: half its sparse figures; 180 GB HBM3e at 8 TB/s, NVLink 5); "
         "between hosts 400 Gb/s a GPU (DGX B200 datasheet: 8x ConnectX-7 400 Gb/s)", 50),
    _row("l40s", (r"^L40S$",), "NVIDIA L40S", 91.6, 183, 362, 864, 46068 * MiB, 25, 25, (8, 9), 142,
         "NVIDIA L40S datasheet (dense: half its sparse 366/733 TFLOP/s); PCIe 4 card, no NVLink"),
    _row("l40", (r"^L40$",), "NVIDIA L40", 90.5, 90.5, 181, 864, 46068 * MiB, 25, 25, (8, 9), 142,
         "NVIDIA L40 datasheet (dense: half its sparse 181/362 TFLOP/s); PCIe 4 card, no NVLink"),
    _row("l4", (r"^L4$",), "NVIDIA L4", 30.3, 60, 121, 300, 23034 * MiB, 25, 25, (8, 9), 58,
         "NVIDIA L4 datasheet (dense: half its sparse 120/242 TFLOP/s)"),
    _row("a40", (r"^A40$",), "NVIDIA A40", 37.4, 74.8, 149.7, 696, 46068 * MiB, 25, 25, (8, 6), 84,
         "NVIDIA A40 datasheet (dense: half its sparse figures); PCIe 4 card"),
    _row("a10", (r"^A10$",), "NVIDIA A10", 31.2, 62.5, 125, 600, 23028 * MiB, 25, 25, (8, 6), 72,
         "NVIDIA A10 datasheet (dense)"),
)
GPUS: dict[str, DeviceFacts] = {row.key: row.facts for row in ROWS}


def row_for_name(reported: str) -> GpuRow | None:
    """The first row whose patterns match a reported name (module docstring), or None."""
    return next((row for row in ROWS if row.answers_to(reported)), None)
