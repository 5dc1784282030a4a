"""The newer and private torch APIs ckrun calls, detected once, so every torch pyproject allows works.

pyproject allows torch from 2.11: the lent GPU machines run 2.11, CPU machines resolve 2.14, users
get newer. Each entry below says what happens when this torch lacks the API; nothing here is
guessed from version numbers, only from what the installed torch actually has.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils import checkpoint as _checkpoint

CHECKPOINT_RESPECTS_HOOKS = "respect_saved_tensors_hooks" in inspect.signature(_checkpoint.checkpoint).parameters
"""torch >= 2.14: selective checkpointing's cached outputs can pass through saved-tensor hooks around
the checkpoint (activation offload). Older torch has no such keyword (it would reach the block's
forward) and always bypasses the hooks: those outputs then stay on the device."""

_GENERATOR = getattr(_checkpoint, "_checkpoint_without_reentrant_generator", None)
_GENERATOR_POSITIONAL = ("fn", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


def checkpoint_options() -> dict:
    """Keywords for `torch.utils.checkpoint.checkpoint` beyond the ones every allowed torch has."""
    return {"respect_saved_tensors_hooks": True} if CHECKPOINT_RESPECTS_HOOKS else {}


def segment_generator():
    """torch's private generator behind non-reentrant checkpoint, which the sqrt policy drives
    across several blocks; None when this torch lacks it or changed its positional parameters."""
    if _GENERATOR is None:
        return None
    names = list(inspect.signature(_GENERATOR).parameters)[:len(_GENERATOR_POSITIONAL)]
    return _GENERATOR if tuple(names) == _GENERATOR_POSITIONAL else None


def missing_for_sqrt() -> str | None:
    """Why policy sqrt cannot run on this torch, or None."""
    if segment_generator() is None:
        return (f"memory.checkpointing: policy sqrt needs torch.utils.checkpoint's "
                f"_checkpoint_without_reentrant_generator, which torch {torch.__version__} does not have in the "
                f"form ckrun drives; use policy every (every: k keeps one in k blocks) or full")
    return None


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of a tensor's storage that fake tensors have too (their data pointers are all 0):
    the storage's C++ address where torch exposes it (`_cdata`, every torch so far), else the id of
    its Python object, which torch keeps for the storage's lifetime."""
    storage = tensor.untyped_storage()
    return getattr(storage, "_cdata", None) or id(storage)


def missing_budget() -> str | None:
    """Why memory.activation_memory_budget cannot be set on this torch, or None."""
    if not hasattr(functorch_config(), "activation_memory_budget"):
        return (f"memory.activation_memory_budget: torch {torch.__version__} has no "
                "torch._functorch.config.activation_memory_budget; leave memory.activation_memory_budget unset")
    return None


def functorch_config():
    """torch._functorch.config (the AOT partitioner's settings), or None when this torch lacks it."""
    try:
        import torch._functorch.config as config
    except ImportError:
        return None
    return config
