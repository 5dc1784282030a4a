"""A fake tensor's device, answered by the first of the estimator's dispatch modes to be asked.

C++ asks a fake tensor its device (`prim.device`) through the whole Python mode stack: about two of every
three ops the 8B's traces dispatch are such reads, each a Python call in every mode (the parts' cutter, the
op clock, the kernels' mends, the tracker) before the fake tensor answers. None of those modes acts on a
read of metadata, so the outermost answers it with torch's own handler for fake tensors (the meta device
inside a fake kernel, its fake device outside) and the rest are not called. A torch without that (private)
handler dispatches the read as before.
"""

from __future__ import annotations

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor

DEVICE_QUERY = torch.ops.prim.device.default
META = torch.device("meta")
_ANSWER = getattr(fake_tensor, "_DISPATCH_META_HANDLERS", {}).get(DEVICE_QUERY)


def fake_device(args) -> torch.device | None:
    """The answer to `prim.device(args)` where it asks a fake tensor; None otherwise (let it dispatch)."""
    if _ANSWER is None or len(args) != 1 or type(args[0]) is not FakeTensor:  # a subclass (DTensor, torchao's
        return None  # states) answers for itself
    return _ANSWER(args)
