"""The CUDA context counts this process only: NVML's per-process list where it names us, else the
card's use less what other processes held before this one started CUDA, else (no NVML) the card's
use, said once. Checked on the CPU with NVML and the CUDA queries stood in for; on a GPU, against
a second process that holds memory on the card while this one measures."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types

import children
import pytest
import torch

from ckrun.runner.memory import measure, nvml

GB = 10**9
DEVICE = torch.device("cuda", 0)


class FakeNvml(types.SimpleNamespace):
    """pynvml's calls ckrun makes, over a card whose use and process list a test sets."""

    def __init__(self, used: int, listed: dict[int, int | None] | None):
        super().__init__(used=used, listed=listed)

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=self.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in (self.listed or {}).items()]


@pytest.fixture
def card(monkeypatch):
    """A 80 GB card: this process reserves 10 GB and its context is 0.8 GB; another process holds 3 GB."""
    fake = FakeNvml(used=3 * GB, listed=None)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda index: index, raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GB)
    monkeypatch.setattr(measure, "_OTHERS_BEFORE", {})
    monkeypatch.setattr(measure, "_WARNED", set())

    def start_cuda():  # this process's context and reserve join the other process's 3 GB
        fake.used = 3 * GB + 800 * 10**6 + 10 * GB
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GB - fake.used, 80 * GB))
    fake.start_cuda = start_cuda
    return fake


def test_nvml_naming_this_process_gives_its_own_bytes(card):
    card.start_cuda()
    card.listed = {os.getpid(): 10 * GB + 800 * 10**6, os.getpid() + 1: 3 * GB}
    assert measure.cuda_context_bytes(DEVICE) == 800 * 10**6
    assert nvml.others(0) == 1


def test_without_a_process_list_the_others_at_start_are_left_out(card, caplog):
    measure.note_card_before_cuda()  # the trainer calls it before it picks the device
    card.start_cuda()
    card.listed = {12345678: None}  # a host pid, no bytes: a container's view
    assert nvml.own_bytes(0) is None and nvml.others(0) is None
    assert measure.cuda_context_bytes(DEVICE) == 800 * 10**6  # was 3.8 GB: the other process counted as ours
    assert not caplog.records


def test_with_no_nvml_at_all_the_card_is_counted_and_that_is_said_once(card, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` now fails
    measure.note_card_before_cuda()
    card.start_cuda()
    for _ in range(2):
        assert measure.cuda_context_bytes(DEVICE) == 3 * GB + 800 * 10**6
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "counts any other process on the card too" in warnings[0]


def test_a_note_after_cuda_started_notes_nothing(card, monkeypatch):
    card.start_cuda()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    measure.note_card_before_cuda()
    assert measure._OTHERS_BEFORE == {}  # our own context is in the card's use by now


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_another_process_on_the_card_is_not_counted_as_ours(tmp_path):
    """A second process holds 2 GiB on the card before and while this one measures its context."""
    holder = subprocess.Popen([sys.executable, "-c", "import torch, sys, time\n"
                               "x = torch.empty(2 << 30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()\n"
                               "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code = ("from ckrun.runner.memory.measure import note_card_before_cuda, context_after_kernels\n"
                "import torch; note_card_before_cuda(); print(context_after_kernels(torch.device('cuda', 0)))")
        done = children.run([sys.executable, "-c", code])
        assert done.returncode == 0, done.stderr[-2000:]
        context = int(done.stdout.split()[-1])
        assert 200 << 20 < context < 1500 << 20  # a context, not a context plus the other process's 2 GiB
    finally:
        holder.kill()
        holder.wait()
