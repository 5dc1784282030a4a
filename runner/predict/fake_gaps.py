"""Ops whose fake-tensor kernels allocate less than the real ones: where an estimate runs them, it is low.

The estimate runs the step on fake tensors and counts the bytes of every tensor the kernels return.
A few fake (meta) kernels return a placeholder of size 0 where the real kernel returns a workspace
that stays alive until backward; those bytes are missing from the estimate. The amount depends on
the library version (oneDNN, cuDNN), so it is not guessed: the estimate names the op instead.

`FAKE_GAPS` is checked against torch's own meta kernels (torch/_meta_registrations.py); a test
runs a tiny LSTM to see the first entry fire.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# op (the overload packet's qualified name) -> what its fake kernel leaves out
FAKE_GAPS = {
    "aten::mkldnn_rnn_layer": "its fake kernel returns a 0-byte workspace where the real one (oneDNN's, kept "
                              "for backward; an LSTM on a CPU) holds every gate of every time step; a CUDA "
                              "estimate runs this CPU kernel too, so cuDNN's reserve is missing there",
    "aten::_cudnn_rnn": "its fake kernel returns a 0-byte cuDNN reserve, which the real RNN keeps for backward",
    "aten::miopen_rnn": "its fake kernel returns a 0-byte MIOpen reserve, which the real RNN keeps for backward",
}


class FakeGapWatch(TorchDispatchMode):
    """Notes which ops of FAKE_GAPS a region runs; everything else passes through untouched."""

    def __init__(self):
        super().__init__()
        self.seen: dict[str, None] = {}  # ordered set: warnings come out in the order the ops ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name  # "aten::mkldnn_rnn_layer" for every overload
        if name in FAKE_GAPS:
            self.seen[name] = None
        return func(*args, **(kwargs or {}))

    def warnings(self) -> list[str]:
        return [f"{name.replace('::', '.')}: {FAKE_GAPS[name]}; this estimate leaves that out and is low"
                for name in self.seen]
