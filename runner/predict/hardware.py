"""A device's facts by name, from a facts file, or measured here.

`resolve_device("h100")`, `resolve_device("NVIDIA H100 80GB HBM3")` or a JSON file of measured
facts gives a `DeviceFacts`; `this_cpu()` measures the CPU this runs on.

Where the figures come from. ckrun keeps its own table of the GPUs it names (runner/predict/gpus.py:
dense datasheet figures, each row with its source and the reported names it answers to) rather than reading torch's
`torch._inductor.analysis.device_info` at run time, because that table changes under us: torch
2.11 lists the H100's bf16 peak with 2:4 sparsity (1979 TFLOP/s, twice the dense 989) and its
tf32 as 156; torch 2.15 marks the sparsity but then also halves the H100's fp32; both give the L4
the H100's 3350 GB/s (the L4 has 300) and its sparse bf16 figure. The same recipe would be
predicted 2x apart on two installs. A test checks this table against torch's wherever torch marks
its figures dense, and a GPU ckrun does not list is read from torch's table where that torch has
one (`datasheet_tops(..., device_name=)`, torch 2.15 and later), with a note.

The achievable share of each peak comes per class of kernel from the calibration table
(runner/predict/efficiency.py, calibration.json: literature figures until a GPU campaign measures
a card). A measured facts file (`python -m ckrun.runner.predict.hardware OUT.json`, or
`bench/gpu/facts.py`) gives achieved figures with efficiencies of 1.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode

from ..problems import CkrunError
from .device_facts import MiB, DeviceFacts
from .gpus import GPUS, row_for_name

__all__ = ["GPUS", "DeviceFacts", "UnknownDevice", "known_names", "load_facts", "resolve_device", "this_cpu",
           "this_gpu", "measure_gpu"]


class UnknownDevice(CkrunError, ValueError):
    """A --gpu name this table and torch's do not know, or a facts file that does not read."""


def resolve_device(name: str) -> DeviceFacts:
    """Facts for a short name (`h100`), a reported name (`NVIDIA A100-SXM4-40GB`), `cpu`, or a JSON file."""
    text = name.strip()
    if text.lower() == "cpu":
        return this_cpu()
    if text.lower().endswith(".json"):
        return load_facts(Path(text))
    if text.lower() in GPUS:
        return GPUS[text.lower()]
    row = row_for_name(text)
    if row is not None:
        return row.facts
    found = _from_torch_table(text)
    if found is not None:
        return found
    raise UnknownDevice(f"unknown GPU {name!r}; known: {', '.join(known_names())} (or a facts .json file)")


def known_names() -> list[str]:
    return [*GPUS, "cpu"]


def load_facts(path: Path) -> DeviceFacts:
    """Measured facts: `python -m ckrun.runner.predict.hardware OUT.json`, a GPU campaign's (`python bench/gpu/calibrate.py
    OUT/calibration.json --facts-json FILE`), or written by hand with the same fields. A file with `base` (a
    `--gpu` name) gives only what differs from that row (a cluster's network, a card's power limit); the rest,
    its calibration included, is the row's."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "base" in data:
            data = _over_base(data)
        return DeviceFacts.model_validate(data)
    except OSError as err:
        raise UnknownDevice(f"cannot read device facts {path}: {err.strerror}") from None
    except (ValueError, ValidationError) as err:
        first = str(err).strip().splitlines()
        raise UnknownDevice(f"{path}: not a device facts file ({' '.join(first[:3])})") from None


def _over_base(data: dict) -> dict:
    """A facts file's fields over those of the row it names as `base` (load_facts)."""
    own = {key: value for key, value in data.items() if key != "base"}
    base = resolve_device(str(data["base"]))
    source = f"{own.pop('source', '')}; otherwise ckrun's {data['base']!r} row: {base.source}".lstrip("; ")
    return {**base.model_dump(), **own, "source": source}


def _from_torch_table(name: str) -> DeviceFacts | None:
    """A GPU only torch's datasheet table knows, where that torch reports dense figures by name."""
    device_info = _torch_device_table()
    if device_info is None:
        return None
    info = getattr(device_info, "lookup_device_info", lambda _: None)(name)
    if info is None or "tops_sparsity_factor" not in getattr(type(info), "__dataclass_fields__", {}):
        return None  # older tables mix sparse and dense figures: not trusted
    dense = {key: device_info.datasheet_tops(dtype, is_tf32=tf32, device_name=name)
             for key, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                      ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False))}
    dense = {key: value for key, value in dense.items() if value}
    if not dense or "fp32" not in dense:
        return None
    return DeviceFacts(name=name, matmul_tflops=dense, memory_gbs=info.dram_bw_gbs,
                       memory_bytes=int(info.dram_gb * 1e9),
                       source=f"torch {torch.__version__.split('+')[0]} datasheet table (not in ckrun's own)")


@functools.cache
def _torch_device_table():
    """torch's datasheet table (torch._inductor.analysis.device_info), where it says which figures are sparse
    (`tops_sparsity_factor`; older tables mix sparse and dense: not trusted); None otherwise. Its file needs only
    torch, so it is loaded by itself: importing it through torch._inductor takes seconds (dynamo, distributed
    tensors), which a mistyped --gpu name should not cost; where that cannot be done, it is imported."""
    import importlib.util

    table = Path(torch.__file__).parent / "_inductor" / "analysis" / "device_info.py"
    try:
        if "tops_sparsity_factor" not in table.read_text(encoding="utf-8"):
            return None
        spec = importlib.util.spec_from_file_location("_ckrun_torch_device_info", table)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, AttributeError):  # no sources beside the install: the package's own import
        try:
            from torch._inductor.analysis import device_info
        except ImportError:
            return None
        return device_info if hasattr(device_info.DeviceInfo, "tops_sparsity_factor") else None


def this_gpu() -> DeviceFacts | None:
    """The local GPU's facts by its reported name; None without a GPU or when its name is unknown."""
    if not torch.cuda.is_available():
        return None
    try:
        return resolve_device(torch.cuda.get_device_name())
    except UnknownDevice:
        return None


@functools.cache
def this_cpu() -> DeviceFacts:
    """This CPU's figures, measured once per process (~0.5 s): the best of a few fp32 and bf16
    products, a copy larger than the caches, and the cost of one small op with and without a
    Python dispatch mode."""
    threads = torch.get_num_threads()
    matmul = {"fp32": _matmul_tflops(torch.float32), "bf16": _matmul_tflops(torch.bfloat16)}
    plain = _op_overhead_us()
    with _PassThrough():
        moded = _op_overhead_us()
    return DeviceFacts(name=f"cpu ({threads} thread{'s' if threads != 1 else ''})", kind="cpu",
                       matmul_tflops={**matmul, "tf32": matmul["fp32"], "fp16": matmul["bf16"]},
                       memory_gbs=_copy_gbs(), matmul_efficiency=1.0, memory_efficiency=1.0,
                       launch_us=plain, python_mode_us=max(0.0, moded - plain), source="measured on this CPU at start")


def _best_of(work, repeats: int = 7) -> float:
    """The fastest of `repeats` runs after one warm-up: other work on the machine only slows a run."""
    work()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def _matmul_tflops(dtype: torch.dtype, size: int = 512) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / _best_of(lambda: a @ b) / 1e12


def _copy_gbs(nbytes: int = 64 * MiB) -> float:
    source, target = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    source.fill_(1)
    return 2 * nbytes / _best_of(lambda: target.copy_(source)) / 1e9  # bytes read and written


def measure_gpu(device: int = 0) -> DeviceFacts:
    """This GPU's achievable figures (about 20 s): large products per dtype, a device copy, pinned host
    copies, the least an op costs. Efficiencies are 1: the figures are what was reached. The table's
    entry for the card, where there is one, gives the peer link and the datasheet name."""
    torch.cuda.set_device(device)
    known = this_gpu()
    matmul = {dtype: _cuda_matmul_tflops(torch_dtype) for dtype, torch_dtype in
              (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16))}
    with _tf32():
        matmul["tf32"] = _cuda_matmul_tflops(torch.float32)
    properties = torch.cuda.get_device_properties(device)
    return DeviceFacts(name=torch.cuda.get_device_name(device), matmul_tflops=matmul, memory_gbs=_cuda_copy_gbs(),
                       memory_bytes=properties.total_memory, host_gbs=_cuda_host_gbs(),
                       peer_gbs=known.peer_gbs if known else 0.0, capability=(properties.major, properties.minor),
                       matmul_efficiency=1.0, memory_efficiency=1.0, launch_us=_cuda_launch_us(),
                       source=f"measured on this GPU with torch {torch.__version__} on {time.strftime('%Y-%m-%d')}")


def _cuda_seconds(work, repeats: int = 10) -> float:
    for _ in range(3):
        work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def _cuda_matmul_tflops(dtype: torch.dtype, size: int = 8192) -> float:
    a, b = (torch.randn(size, size, dtype=dtype, device="cuda") for _ in range(2))
    return 2 * size**3 / _cuda_seconds(lambda: a @ b) / 1e12


def _cuda_copy_gbs(nbytes: int = 1 << 30) -> float:
    source, target = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
    return 2 * nbytes / _cuda_seconds(lambda: target.copy_(source)) / 1e9  # read and written


def _cuda_host_gbs(nbytes: int = 256 << 20) -> float:
    device, host = torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.empty(nbytes, dtype=torch.uint8,
                                                                                      pin_memory=True)
    return nbytes / _cuda_seconds(lambda: host.copy_(device, non_blocking=True)) / 1e9


def _cuda_launch_us(ops: int = 1000) -> float:
    x = torch.ones(8, device="cuda", requires_grad=True)

    def work():
        for _ in range(ops):
            torch.add(x, x)
    return _cuda_seconds(work, repeats=3) / ops * 1e6


class _tf32:
    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def main(argv: list[str] | None = None) -> int:
    """`python -m ckrun.runner.predict.hardware OUT.json`: this GPU's measured facts, for `--gpu OUT.json`."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not torch.cuda.is_available():
        print("usage: python -m ckrun.runner.predict.hardware OUT.json   (on a machine with a GPU)", file=sys.stderr)
        return 2
    facts = measure_gpu()
    Path(args[0]).write_text(facts.model_dump_json(indent=1), encoding="utf-8")
    print(f"{args[0]}: {facts.name}: bf16 {facts.matmul_tflops['bf16']:.0f} TFLOP/s, {facts.memory_gbs:.0f} GB/s, "
          f"host {facts.host_gbs:.0f} GB/s, {facts.launch_us:.1f} us an op")
    return 0


class _PassThrough(TorchDispatchMode):
    """The cheapest Python dispatch mode: what any such mode costs an op, at least."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _op_overhead_us(ops: int = 400) -> float:
    x = torch.ones(8, requires_grad=True)  # a training step's ops record autograd: that is part of their cost

    def work():
        for _ in range(ops):
            torch.add(x, x)
    return _best_of(work) / ops * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
