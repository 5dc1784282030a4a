"""A probe child for tests: ckrun.autotune.probes.child itself (its arguments, parent watchdog, fault hook and
atomic result) with only the measurement replaced by a formula, so that a study's outcome does
not depend on how busy the machine is. The tuner runs it when CKRUN_PROBE_CHILD=fake_child and
this folder is on PYTHONPATH. FAKE_PROBE_SECONDS makes each probe take that long."""

import json
import os
import time

from ckrun.autotune.probes import child
from ckrun.autotune.records import ProbeResult

# activation memory kept, and step time, relative to no checkpointing
KEPT = {"none": 1.0, "full": 0.25, "sqrt": 0.5, "selective": 0.55}
SLOWER = {"none": 1.0, "full": 1.35, "sqrt": 1.2, "selective": 1.1}


def measure(recipe: dict, warmup: int, timed: int) -> ProbeResult:
    time.sleep(float(os.environ.get("FAKE_PROBE_SECONDS", "0")))
    memory, batch = recipe["memory"], recipe["train"]["batch_size"]
    micro, checkpointing = memory["micro_batch"], memory["checkpointing"]
    every = checkpointing.get("every")
    if checkpointing["policy"] == "layers":  # a per-block plan: as every k-th with the same share of blocks
        every = recipe["model"]["config"].get("num_hidden_layers", 4) / len(checkpointing["layers"])
    kept = 1 - 0.75 / every if every else KEPT[checkpointing["policy"]]
    slower = 1 + 0.35 / every if every else SLOWER[checkpointing["policy"]]
    peak = 1_000_000 + int(micro * 400_000 * kept)  # parameters and optimizer state, then activations
    speed = batch / (0.01 * batch / micro + 0.02 * batch * slower)  # a fixed cost per micro-batch
    device = {"device": "fake", "device_total_bytes": 0, "torch": "fake", "cuda": None}
    if peak > memory["max_mem"]:
        return ProbeResult(status="over_cap", peak_mem_bytes=peak, measured_peak_bytes=peak, **device,
                           reason=f"memory cap exceeded: step 1 peaked at {peak} B")
    return ProbeResult(status="ok", peak_mem_bytes=peak, measured_peak_bytes=peak, samples_per_s=speed, **device)


if __name__ == "__main__":
    child.measure = measure
    child.recipe_from_json = json.loads  # plain data: validating the recipe would import transformers in every probe
    child.finish(child.main())
