"""A recipe's fingerprint: what a checkpoint must agree with to be resumed, saved inside every
checkpoint (store.py's state, sharded.py's trainer.json) and compared by resume.py."""

from __future__ import annotations

import json

from ...recipe.recipe import Recipe


def fingerprint(recipe: Recipe) -> dict[str, str]:
    """What a checkpoint must agree with to be resumed, as JSON strings (torch.load(weights_only) reads those)."""
    # initial weights only, moot once trained; but a LoRA checkpoint holds the adapter, whose frozen base they are
    model = recipe.model.model_dump(mode="json", exclude=set() if recipe.model.lora else {"pretrained", "revision"})
    return {"model": json.dumps(model, sort_keys=True),
            "train.optimizer": json.dumps(recipe.train.optimizer.model_dump(mode="json"), sort_keys=True),
            "memory": json.dumps(_optimizer_layout(recipe), sort_keys=True),
            RUN: json.dumps(run_settings(recipe), sort_keys=True)}


def _optimizer_layout(recipe: Recipe) -> dict[str, str]:
    """The memory plan's pool policies that change what the weights and the optimizer state are saved as
    (the parameters' dtype, the moments' precision, which of them the host holds), each as its `saved_as`:
    the update in the backward, the cast cache and the loss's pieces save the same state and may change
    on resume."""
    return {policy.section: saved for policy in recipe.memory.pool_policies() if (saved := policy.saved_as()) is not None}


RUN = "run"  # the fingerprint's section of settings --resume-changed may accept


def run_settings(recipe: Recipe) -> dict:
    """The settings besides model and optimizer that decide what the coming steps compute."""
    train = recipe.train.model_dump(mode="json", include={"batch_size", "seed", "grad_clip", "scheduler"})
    data = recipe.data.model_dump(mode="json", exclude={"workers", "prefetch"})  # decoding speed only
    return {**{f"train.{key}": value for key, value in train.items()}, "precision": recipe.precision, "data": data}
