"""Out-of-memory errors told apart from other failures, and said in a few words: the build
(a model too large to create) and the training step (a batch too large) both need it."""

from __future__ import annotations

import re

import torch

from ..problems import first_line
from ..units import format_bytes

_ALLOCATION = re.compile(r"tried to allocate (\d+) bytes")


def is_out_of_memory(err: BaseException) -> bool:
    """True for the allocators' out-of-memory errors (CUDA's OutOfMemoryError, the CPU allocator's
    RuntimeError, Python's MemoryError), whose tracebacks say nothing a user can act on."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text
                                              or "out of memory" in text.lower())


def describe_out_of_memory(err: BaseException) -> str:
    """'could not get 1.1 PB' when the allocator said how much, else its first line."""
    found = _ALLOCATION.search(str(err))
    if found:
        return f"the allocator could not get {format_bytes(int(found.group(1)))}"
    return first_line(err, 160)
