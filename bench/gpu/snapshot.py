"""Recorded CUDA training steps as the caching allocator saw them, replayed through ckrun's allocator model.

The prediction's error has two sources: events the fake-tensor step does not produce (kernel
workspaces, different kernels) and the allocator model itself. Replaying the real step's own
alloc/free events through `CachingAllocatorModel` isolates the second: whatever differs between
the model's reserved peak and the real one is the model's error alone.

    start, end, result = record_step(run_steps, device)
    compact = reduce(start, end, device.index)      # small enough to bring home (gzip'd JSON)
    found = replay(compact)                          # real vs modelled reserved peak

Snapshot format (torch/cuda/memory.py `_snapshot` docstring, torch 2.11 and 2.14 alike):
`segments` (address, total_size, segment_type small|large, blocks with size and state) and
`device_traces[device]`, a list of events with action, addr, size (the requested bytes for
alloc and free) and stream. `alloc` takes a block, `free_requested` marks it free, and
`free_completed` returns it to the pool once every stream that used it is done (at once on a
single stream). `segment_alloc`/`segment_free` are cudaMalloc/cudaFree of whole segments.
"""

from __future__ import annotations

import gzip
import inspect
import json
from collections import Counter
from pathlib import Path

import torch

from ckrun.runner.predict.cuda_model import SMALL_SIZE, CachingAllocatorModel

MAX_ENTRIES = 200_000  # the ring buffer's size: a BERT-large step makes ~50k events; more would wrap
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")


def record_options() -> dict:
    """Keywords for `_record_memory_history`, those this torch has: no stack traces (they would make
    the snapshot hundreds of MB and slow every allocation), the history cleared at start."""
    wanted = {"context": None, "stacks": "python", "max_entries": MAX_ENTRIES, "clear_history": True}
    accepted = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    return {name: value for name, value in wanted.items() if name in accepted}


def record_step(run_step, device: torch.device):
    """(snapshot at start, snapshot at end, run_step's result), recording every allocator event between."""
    memory = torch.cuda.memory
    torch.cuda.synchronize(device)
    memory._record_memory_history("all", **record_options())
    try:
        start = memory._snapshot()  # the segments (and live blocks) the step starts from
        result = run_step()
        torch.cuda.synchronize(device)
        end = memory._snapshot()
    finally:
        memory._record_memory_history(None)
    return start, end, result


def reduce(start: dict, end: dict, device_index: int) -> dict:
    """The step's events as [action, addr, size, stream] rows and the segments at start, nothing else."""
    already = len(start["device_traces"][device_index])  # events recorded before the start snapshot
    trace = end["device_traces"][device_index]
    events = [[e["action"], e.get("addr", 0), e.get("size", 0), e.get("stream", 0)] for e in trace[already:]]
    segments = [_segment(s) for s in start["segments"] if s.get("device", device_index) == device_index]
    return {"torch": torch.__version__, "device_index": device_index, "start_segments": segments,
            "events": events, "trace_entries": len(trace), "max_entries": MAX_ENTRIES,
            "maybe_wrapped": len(trace) >= MAX_ENTRIES}


def _segment(segment: dict) -> dict:
    blocks, address = [], segment["address"]
    for block in segment["blocks"]:
        at = block.get("address", address)  # newer torch lists it; older ones imply it by order
        blocks.append([at, block["size"], block["state"]])
        address = at + block["size"]
    return {"address": segment["address"], "total_size": segment["total_size"],
            "segment_type": segment.get("segment_type", "large"), "stream": segment.get("stream", 0),
            "blocks": blocks}


def write(compact: dict, path: Path) -> int:
    """gzip'd JSON; returns its size in bytes."""
    with gzip.open(path, "wt", encoding="utf-8") as out:
        json.dump(compact, out, separators=(",", ":"))
    return path.stat().st_size


# --- replay -------------------------------------------------------------------------------------


def real_reserved(compact: dict) -> tuple[int, int]:
    """(reserved at start, reserved peak) from the segments at start and the step's cudaMalloc/cudaFree."""
    start = reserved = sum(s["total_size"] for s in compact["start_segments"])
    peak = reserved
    for action, _, size, _ in compact["events"]:
        if action == "segment_alloc":
            reserved += size
            peak = max(peak, reserved)
        elif action == "segment_free":
            reserved -= size
    return start, peak


def seed_model(segments: list[dict]) -> CachingAllocatorModel:
    """The model holding the same segments, split into the same blocks, live or free, as at start.

    Each segment is built whole before the next, so best fit has nowhere else to go: a large one
    by reserving it with one request of its size and splitting that again block by block (large
    blocks are over 1 MiB, so the model splits exactly there), a small one (2 MiB) block by
    block. Free blocks are taken by placeholders and given back once every segment stands; a live
    block stays taken under its address, which the step's free events name."""
    model, placeholders = CachingAllocatorModel(), []
    for segment in sorted(segments, key=lambda s: s["address"]):
        small = segment["segment_type"] == "small"
        if not small:
            model.alloc(("segment", segment["address"]), segment["total_size"])
            model.free(("segment", segment["address"]))
        for address, size, state in segment["blocks"]:
            pieces = _small_pieces(size) if small else [size]  # a small pool's request is at most 1 MiB
            for number, piece in enumerate(pieces):
                key = address if state != "inactive" and len(pieces) == 1 else ("free", address, number)
                model.alloc(key, piece)
                if state == "inactive":
                    placeholders.append(key)
    for key in placeholders:
        model.free(key)
    model.peak_allocated = model.allocated  # the placeholders were never real
    return model


def _small_pieces(size: int) -> list[int]:
    return [SMALL_SIZE, size - SMALL_SIZE] if size > SMALL_SIZE else [size]


def replay(compact: dict) -> dict:
    """Real and modelled reserved peaks of the recorded step, and the model's error on them."""
    actions = Counter(e[0] for e in compact["events"])
    free_on = "free_completed" if actions["free_completed"] else "free_requested"  # skip_actions may drop one
    model = seed_model(compact["start_segments"])
    start, real_peak = real_reserved(compact)
    seeded = model.reserved
    for action, address, size, _ in compact["events"]:
        if action == "alloc":
            model.alloc(address, size)
        elif action == free_on:
            model.free(address)
    streams = Counter(e[3] for e in compact["events"] if e[0] == "alloc")
    return {"real_reserved_start_bytes": start, "real_reserved_peak_bytes": real_peak,
            "model_reserved_start_bytes": seeded, "model_reserved_peak_bytes": model.reserved,
            "model_peak_allocated_bytes": model.peak_allocated,
            "replay_error": (model.reserved - real_peak) / real_peak if real_peak else None,
            "events": len(compact["events"]), "actions": dict(actions), "freed_on": free_on,
            "alloc_streams": len(streams), "other_actions": sorted(set(actions) - set(ACTIONS)),
            "maybe_wrapped": compact.get("maybe_wrapped", False)}
