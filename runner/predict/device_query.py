"""A fake tensor's device, answered by the first of the estimator's dispatch modes to be asked.

C++ asks a fake tensor its device (`prim.device`) through the whole Python mode stack: about two of every
three ops the 8B's traces dispatch are such reads, each a Python call in every mode (the parts' cutter, the
op clock, the kernels' mends, the tracker) before the fake tensor answers. None of those modes acts on a
read of metadata, so the outermost answers it as the fake tensor would (torch's own `FakeTensor` handler:
the meta device inside a fake kernel, its fake device outside) and the rest are not called.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

DEVICE_QUERY = torch.ops.prim.device.default
META = torch.device("meta")


def fake_device(args) -> torch.device | None:
    """The answer to `prim.device(args)` where it asks a fake tensor; None otherwise (let it dispatch)."""
    tensor = args[0] if len(args) == 1 else None
    if type(tensor) is not FakeTensor:  # a subclass (DTensor, torchao's states) answers for itself
        return None
    return META if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
