"""How a plan's knobs are written as the space's choices, and read back.

Each knob is one string (or int) per choice, so optuna stores a proposal as plain data:
`every:3` and `layers:0,2,5` for checkpointing, `layers:1,3` for offload, `same` for no
short-batch bucket, `bf16` for a compression policy. The solver's per-block plans get labels of
the same form (`space.add_proposals`).
"""

from __future__ import annotations

from runner.plan import MemoryPlan


def parse_checkpointing(value: str) -> dict:
    policy, _, every = value.partition(":")
    if policy == "layers":  # a solver's per-block plan: "layers:0,2,5"
        return {"policy": policy, "layers": [int(i) for i in every.split(",")]}
    return {"policy": policy, "every": int(every)} if every else {"policy": policy}


def parse_offload(value: str) -> dict:
    policy, _, layers = value.partition(":")
    return {"policy": policy, "layers": [int(i) for i in layers.split(",")]} if layers else {"policy": policy}


def adaptive_buckets(values: dict) -> list[dict]:
    """memory.adaptive of a point: the recipe's when pinned, else one bucket of short batches with
    their own checkpointing ("same": no bucket, one plan for every length)."""
    if "adaptive" in values:
        return values["adaptive"]
    short = values.get("short_checkpointing", "same")
    return [] if short == "same" else [{"max_len": values["short_len"], "checkpointing": parse_checkpointing(short)}]


def compression_fields(policy: str) -> dict:
    """A plan's compression keys: a lossy policy carries its opt-in, so tuned.yaml shows it."""
    return {} if policy == "none" else {"compression": {"policy": policy}, "allow_lossy": True}


def checkpointing_label(plan: MemoryPlan) -> str:
    policy = plan.checkpointing
    if policy.policy == "layers":
        return "layers:" + ",".join(map(str, policy.layers))
    return f"every:{policy.every}" if policy.policy == "every" else policy.policy


def offload_label(plan: MemoryPlan) -> str:
    return "layers:" + ",".join(map(str, plan.offload.layers)) if plan.offload.policy == "layers" else plan.offload.policy
