"""How a plan's knobs are written as the space's choices, and read back.

Each knob is one string (or int) per choice, so optuna stores a proposal as plain data. The
policies write and read their own labels (`every:3`, `layers:0,2,5`, `bf16`: runner/policies.py);
this module adds the knobs that are not policies: `same` for no short-batch bucket, and the
opt-in a lossy compression carries.
"""

from __future__ import annotations

from runner.choices import choice_class, choice_fields
from runner.policies import CHECKPOINTING, COMPRESSION, OFFLOAD


def parse_checkpointing(value: str) -> dict:
    return choice_fields(CHECKPOINTING, value)


def parse_offload(value: str) -> dict:
    return choice_fields(OFFLOAD, value)


def adaptive_buckets(values: dict) -> list[dict]:
    """memory.adaptive of a point: the recipe's when pinned, else one bucket of short batches with
    their own checkpointing ("same": no bucket, one plan for every length)."""
    if "adaptive" in values:
        return values["adaptive"]
    short = values.get("short_checkpointing", "same")
    return [] if short == "same" else [{"max_len": values["short_len"], "checkpointing": parse_checkpointing(short)}]


def compression_fields(label: str) -> dict:
    """A plan's compression keys: a lossy policy carries its opt-in, so tuned.yaml shows it."""
    return {"compression": choice_fields(COMPRESSION, label), "allow_lossy": True} \
        if choice_class(COMPRESSION, label).lossy else {}
