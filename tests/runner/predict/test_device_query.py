"""A fake tensor's device reads (prim.device, which C++ asks for most ops of a fake step) are answered by the
outermost of the estimator's modes: none reaches a mode below it, and the answers are the fake tensor's own.
Counted, not timed."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ckrun.runner.predict.device_query import DEVICE_QUERY, META, fake_device
from ckrun.runner.predict.roofline import OpClock


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.device_reads = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.device_reads += func is DEVICE_QUERY
        return func(*args, **(kwargs or {}))


def _step(outer: TorchDispatchMode | None) -> tuple[_Counting, torch.Tensor, torch.Tensor]:
    """A small forward and backward on fake tensors, `outer` above a counting mode."""
    counting = _Counting()
    with FakeTensorMode():
        weight = torch.randn(8, 8, requires_grad=True)
        with counting, (outer or contextlib.nullcontext()):
            out = (torch.randn(4, 8) @ weight).relu().sum()
            out.backward()
    return counting, out, weight.grad


def test_no_device_read_reaches_a_mode_below_the_op_clock_and_the_step_is_the_same():
    alone, out_alone, grad_alone = _step(None)
    clocked, out, grad = _step(OpClock())
    assert alone.device_reads > 0  # without the clock above, the counting mode is asked: the test can fail
    assert clocked.device_reads == 0 and clocked.ops == alone.ops - alone.device_reads
    assert (out.device, grad.device, grad.shape) == (out_alone.device, grad_alone.device, grad_alone.shape) \
        == (torch.device("cpu"), torch.device("cpu"), torch.Size([8, 8]))


def test_the_answer_is_the_fake_tensors_own_and_other_tensors_are_left_to_dispatch():
    with FakeTensorMode() as mode:
        fake = torch.empty(2)
        assert fake_device((fake,)) == torch.device("cpu")
        mode.in_kernel_invocation = True  # inside a fake kernel a fake tensor says meta, as torch's handler does
        try:
            assert fake_device((fake,)) == META
        finally:
            mode.in_kernel_invocation = False
    assert fake_device((torch.empty(2),)) is None  # a real tensor
    assert fake_device((fake, fake)) is None
