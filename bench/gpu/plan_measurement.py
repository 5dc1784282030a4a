"""One plan of the GPU campaign measured on ckrun's own trainer (plans.py picks the plans and their
order, and knobs.py shares it): the median step time of the timed steps after warm-up, samples/s,
the largest reserved and allocated peaks and the CUDA context over all steps, every step's loss, the
FLOPs of one more step counted by torch's FlopCounterMode, and, for one plan, two steps with the
allocator's history on, replayed through ckrun's allocator model (snapshot.py). A plan that runs out
of memory is `oom`, one that fails `error`: the campaign goes on either way.

`campaign` is plans.py's Campaign (its recipe, warm-up and timed steps, whether on CUDA).
"""

from __future__ import annotations

import gc
import statistics
import traceback
from pathlib import Path

import torch

from bench.gpu import snapshot
from bench.gpu.predictions import one_line
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.train.run.memory_cap import MemoryCapExceeded
from ckrun.runner.train.trainer import Trainer

SNAPSHOT_PLAN = "full"  # recorded at the first micro-batch
SNAPSHOT_FILE = "snapshot_full_mb16.json.gz"
SNAPSHOT_STEPS = 2  # from an emptied cache: one that fills it, one that runs in it


def measure(recipe, campaign, out: Path, record_snapshot: bool, count: bool) -> dict:
    trainer = Trainer(recipe)
    records = [trainer.train_step() for _ in range(campaign.warmup_steps + campaign.timed_steps)]
    found = summarise(records, campaign.warmup_steps)
    if record_snapshot:
        found["snapshot"] = snapshot_step(trainer, out)
    if count:
        found.update(count_flops(trainer))
    return found


def summarise(records: list[dict], warmup: int) -> dict:
    timed = records[warmup:]
    largest = lambda key: max((r[key] for r in records if r.get(key) is not None), default=None)  # noqa: E731
    return {"step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "step_times_s": [r["step_time_s"] for r in timed],
            "samples_per_s": statistics.median(r["samples_per_s"] for r in timed),
            "measured_peak_bytes": largest("peak_mem_bytes"), "peak_allocated_bytes": largest("peak_allocated_bytes"),
            "cuda_context_bytes": largest("cuda_context_bytes"), "alloc_retries": largest("alloc_retries"),
            "losses": [r["loss"] for r in records]}


def count_flops(trainer: Trainer) -> dict:
    """FLOPs of one more step, counted by dispatch (recompute included)."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counter = FlopCounterMode(display=False)
        with counter:
            trainer.train_step()
    except Exception as err:  # counting is extra: the step's measurements above stand without it
        return {"flops": None, "flops_error": one_line(err)}
    return {"flops": counter.get_total_flops()}


def snapshot_step(trainer: Trainer, out: Path) -> dict:
    """Steps with the allocator's history on, written small and replayed; never ends the campaign.

    The cache is emptied first: in the steady state every segment already exists, and a replay
    that creates none tests nothing. From the live tensors' segments alone, the first recorded
    step builds the cache again and the second runs in it, as the prediction replays a step twice."""
    torch.cuda.empty_cache()
    run_steps = lambda: [trainer.train_step() for _ in range(SNAPSHOT_STEPS)]  # noqa: E731
    try:
        start, end, records = snapshot.record_step(run_steps, trainer.device)
        compact = snapshot.reduce(start, end, trainer.device.index or 0)
        del start, end
        file_bytes = snapshot.write(compact, out / SNAPSHOT_FILE)
        found = snapshot.replay(compact)
    except Exception as err:
        traceback.print_exc()
        return {"error": one_line(err)}
    if file_bytes > 15 << 20:  # a call brings back files up to 16 MiB
        (out / SNAPSHOT_FILE).unlink()
        found["file_note"] = f"{file_bytes} bytes gzip'd: too large to bring back, deleted"
    return {**found, "file": SNAPSHOT_FILE, "file_bytes": file_bytes,
            "plan": f"{SNAPSHOT_PLAN} @ {trainer.recipe.micro_batch}",
            "steps": SNAPSHOT_STEPS, "steps_peak_reserved_bytes": max(r["peak_mem_bytes"] for r in records),
            "steps_peak_allocated_bytes": max(r.get("peak_allocated_bytes") or 0 for r in records)}


def run_plan(entry: dict, campaign, out: Path, record_snapshot: bool, count: bool) -> dict:
    """The plan's measurements, or status oom / error with the reason; memory is released either way."""
    if campaign.cuda:
        # the cuBLAS handles' workspaces stay allocated (~65 MiB on an H100); more is a leak from the last plan
        entry["allocated_before_bytes"] = torch.cuda.memory_allocated()
    try:
        recipe = load_recipe(campaign.recipe_path, entry["overrides"])
        entry.update(status="ok", **measure(recipe, campaign, out, record_snapshot, count))
    except (MemoryCapExceeded, torch.OutOfMemoryError) as err:
        entry.update(status="oom", reason=one_line(err))
    except Exception as err:  # one broken plan must not cost the others their measurement
        traceback.print_exc()
        entry.update(status="error", reason=one_line(err))
    release(campaign.cuda)
    return entry


def release(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
