"""What share of this card's datasheet peaks each class of kernel reaches, measured for the time
model's calibration (calibrate.py makes the table's entry of it): matrix products by shape and
dtype, convolutions, fused attention by kernel family, memory-bound ops, the optimizer step, the host
link and the least an op costs.

    rows = measure(GPU, device, facts)   # one dict per measurement (below)

A row: {"op_class", "kernel", "dtype", "shape", "seconds", "flops" or "bytes", "rate" (FLOP/s or
bytes/s reached), "peak" (the datasheet's, from ckrun's GPU table), "share" (rate / peak)} or, for a
kernel this card or torch lacks, {"op_class", "kernel", ..., "error"}. FLOPs are what torch's
FlopCounterMode counts, which is what the time model prices; for causal attention, which that
counter prices as full (it ignores `is_causal`), `flops` is halved and `counted_flops` keeps the
counter's figure. Bytes: each input read once, each output written once.

On a CPU (the campaign's dry run) the same code runs at toy sizes (DRY_RUN), timed by the host
clock, against this CPU's own measured figures: numbers that say nothing about a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


@dataclass(frozen=True)
class Sizes:
    """What is measured: the GPU's sizes fill an H100; the dry run's take milliseconds on one core."""

    large: int  # the large square product per dtype (8192: 31 waves of 128x128 tiles on 132 SMs)
    products: tuple[tuple[int, int, int], ...]  # (m, n, k) of a transformer's products, bf16
    fp32_product: tuple[int, int, int]  # one of them again in tf32 and fp32
    convs: tuple[tuple[int, int, int, int, int], ...]  # (batch, in, out, size, kernel) of a ResNet-50
    attention: tuple[tuple[int, int, int, int, bool], ...]  # (batch, heads, seq, head_dim, causal)
    elements: int  # memory-bound ops' tensors
    rows: int  # layer norm and softmax: rows of `width`
    width: int
    optimizer: tuple[tuple[int, ...], ...]  # parameter shapes, repeated `layers` times
    layers: int
    host_bytes: int
    repeats: int


GPU = Sizes(large=8192,
            # BERT-large at micro-batch 16 x 512 tokens (attention projection, FFN up, FFN down, MLM head),
            # GPT-2's FFN at 8 x 1024, Llama-3-8B's FFN at 4 x 4096, and a small one that cannot fill the chip
            products=((8192, 1024, 1024), (8192, 4096, 1024), (8192, 1024, 4096), (8192, 30522, 1024),
                      (8192, 3072, 768), (16384, 14336, 4096), (2048, 768, 768), (1024, 1024, 1024),
                      (512, 512, 512), (4096, 4096, 4096)),
            fp32_product=(8192, 4096, 1024),
            convs=((64, 64, 64, 56, 3), (64, 256, 256, 14, 3), (64, 1024, 256, 14, 1)),
            attention=((16, 16, 512, 64, False), (8, 12, 1024, 64, True), (2, 32, 4096, 128, True),
                       (2, 32, 4096, 128, False)),
            elements=1 << 28, rows=1 << 16, width=1024,
            optimizer=((1024, 1024),) * 4 + ((4096, 1024), (1024, 4096)) + ((1024,),) * 13, layers=24,
            host_bytes=512 << 20, repeats=10)
DRY_RUN = Sizes(large=64, products=((64, 32, 32), (16, 16, 16)), fp32_product=(64, 32, 32),
                convs=((2, 4, 4, 8, 3),), attention=((1, 2, 16, 8, False), (1, 2, 16, 8, True)),
                elements=1 << 12, rows=64, width=32, optimizer=((32, 32), (32,)), layers=2, host_bytes=1 << 12,
                repeats=2)


# --- timing ---------------------------------------------------------------------------------------


def seconds(work: Callable[[], object], cuda: bool, repeats: int, warmup: int = 3) -> float:
    """Median seconds of one `work()` after `warmup` runs: CUDA events on a GPU (device work is
    asynchronous), the host clock on a CPU."""
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def counted_flops(work: Callable[[], object]) -> int:
    """FLOPs of one `work()` as torch's FlopCounterMode counts them (what the time model prices)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        work()
    return counter.get_total_flops()


class _Precision:
    """fp32 products and convolutions on tensor cores (tf32) or not, restored afterwards."""

    def __init__(self, tf32: bool):
        self.tf32 = tf32

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved


def _row(op_class: str, kernel: str, dtype: str, shape, measure: Callable[[], dict]) -> dict:
    """A row, or the row with the error that kept it from being measured (one kernel missing on this
    card or torch must not cost the others)."""
    row = {"op_class": op_class, "kernel": kernel, "dtype": dtype, "shape": list(shape)}
    try:
        row.update(measure())
    except Exception as err:  # noqa: BLE001 - reported in the row
        row["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
    return row


def _rows(op_class: str, kernel: str, dtype: str, shape, measure: Callable[[], list[dict]]) -> list[dict]:
    """Several rows from one measurement (attention's forward and backward), or one row with the error."""
    base = {"op_class": op_class, "kernel": kernel, "dtype": dtype, "shape": list(shape)}
    try:
        return [{**base, **found} for found in measure()]
    except Exception as err:  # noqa: BLE001 - reported in the row
        return [{**base, "error": f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"}]


def _rated(amount_key: str, amount: float, took: float, peak: float | None) -> dict:
    """The amount (FLOPs or bytes) over the time, and its share of the peak; no rate where the
    amount is unknown (FlopCounterMode counts no FLOPs for a CPU's fused attention)."""
    rate = amount / took if amount else None
    return {amount_key: amount, "seconds": took, "rate": rate, "peak": peak,
            "share": rate / peak if rate and peak else None}


# --- the classes ----------------------------------------------------------------------------------


class Measurer:
    """Measures every class on one device against that device's datasheet peaks (`facts`)."""

    def __init__(self, sizes: Sizes, device: torch.device, facts):
        self.sizes, self.device, self.facts = sizes, device, facts
        self.cuda = device.type == "cuda"

    def time(self, work) -> float:
        return seconds(work, self.cuda, self.sizes.repeats)

    def flops_peak(self, dtype: str) -> float:
        return self.facts.peak_flops(dtype)

    def bytes_peak(self) -> float:
        return self.facts.memory_gbs * 1e9

    def randn(self, *shape, dtype=torch.float32, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=dtype, requires_grad=grad)  # never zeros: faster

    def matmul(self, dtype: str, m: int, n: int, k: int) -> dict:
        a, b = self.randn(m, k, dtype=DTYPES[dtype]), self.randn(k, n, dtype=DTYPES[dtype])
        with _Precision(tf32=dtype == "tf32"):
            took = self.time(lambda: a @ b)
        return _rated("flops", 2 * m * n * k, took, self.flops_peak(dtype))

    def conv(self, dtype: str, batch: int, channels: int, out: int, size: int, kernel: int) -> dict:
        """Forward and backward of one convolution (input and weight gradients), as a step runs it."""
        x = self.randn(batch, channels, size, size, dtype=DTYPES[dtype], grad=True)
        weight = self.randn(out, channels, kernel, kernel, dtype=DTYPES[dtype], grad=True)
        grad = self.randn(batch, out, size, size, dtype=DTYPES[dtype])

        def step():
            y = torch.nn.functional.conv2d(x, weight, padding=kernel // 2)
            torch.autograd.grad(y, (x, weight), grad)
        with _Precision(tf32=dtype == "tf32"):
            took = self.time(step)
            flops = counted_flops(step)
        return _rated("flops", flops, took, self.flops_peak(dtype))

    def attention(self, family: str, batch: int, heads: int, seq: int, head_dim: int, causal: bool,
                  dtype: str = "bf16") -> list[dict]:
        """scaled_dot_product_attention on one kernel family: a forward row and a backward row (the forward and
        backward together less the forward), as the time model prices them apart. FLOPs as torch counts them
        (a causal call's halved: the kernels skip the masked half, as the model counts it)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                   "cudnn": getattr(SDPBackend, "CUDNN_ATTENTION", None)}[family]
        if backend is None:
            raise RuntimeError(f"torch {torch.__version__} has no {family} attention backend")
        q, k, v = (self.randn(batch, heads, seq, head_dim, dtype=DTYPES[dtype], grad=True) for _ in range(3))
        grad = self.randn(batch, heads, seq, head_dim, dtype=DTYPES[dtype])

        def forward():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def step():
            torch.autograd.grad(forward(), (q, k, v), grad)
        with torch.no_grad():
            forward_s = self.time(forward)
            forward_flops = counted_flops(forward)
        both_s, both_flops = self.time(step), counted_flops(step)
        half = 2 if causal else 1
        peak = self.flops_peak("bf16")  # fp32 runs as 3xTF32 on sm80+: its slowdown is read against bf16's row
        return [{**_rated("flops", forward_flops // half, forward_s, peak), "direction": "forward", "causal": causal},
                {**_rated("flops", (both_flops - forward_flops) // half, max(both_s - forward_s, 1e-9), peak),
                 "direction": "backward", "causal": causal}]

    def memory_ops(self) -> list[dict]:
        """Memory-bound kernels: a copy, an elementwise add and GELU, layer norm and softmax (which reduce)."""
        n, rows, width = self.sizes.elements, self.sizes.rows, self.sizes.width
        bf16 = torch.bfloat16
        found = []
        for kernel, make, passes in (
                ("copy", lambda: (torch.empty(n, dtype=torch.uint8, device=self.device),) * 2, None),
                ("add", lambda: (self.randn(n // 2, dtype=bf16), self.randn(n // 2, dtype=bf16)), 3),
                ("gelu", lambda: (self.randn(n // 2, dtype=bf16),), 2),
                ("layer_norm", lambda: (self.randn(rows * 4, width, dtype=bf16),), 2),
                ("softmax", lambda: (self.randn(rows * 4, width, dtype=bf16),), 2)):
            op_class = "norm" if kernel == "layer_norm" else "memory"
            found.append(_row(op_class, kernel, "bf16" if passes else "uint8", [n], lambda k=kernel, m=make, p=passes:
                              {**self._memory_op(k, m, p), "direction": "forward"}))
        found.append(_row("norm", "layer_norm", "bf16", [rows * 4, width], lambda: self.norm_backward(rows * 4, width)))
        return found

    def norm_backward(self, rows: int, width: int) -> dict:
        """Layer norm's backward kernel: the output's gradient and the input read, the input's gradient written
        (the weight and bias gradients are a row each)."""
        x = self.randn(rows, width, dtype=torch.bfloat16, grad=True)
        weight = self.randn(width, dtype=torch.bfloat16, grad=True)
        y = torch.nn.functional.layer_norm(x, (width,), weight)
        grad = self.randn(rows, width, dtype=torch.bfloat16)
        took = self.time(lambda: torch.autograd.grad(y, (x, weight), grad, retain_graph=True))
        return {**_rated("bytes", 3 * x.nbytes, took, self.bytes_peak()), "direction": "backward"}

    def _memory_op(self, kernel: str, make, passes: int | None) -> dict:
        tensors = make()
        if kernel == "copy":
            target, source = torch.empty_like(tensors[0]), tensors[0].random_(0, 255)
            work, nbytes = (lambda: target.copy_(source)), 2 * source.nbytes  # read and written
        else:
            ops = {"add": lambda t: torch.add(*t), "gelu": lambda t: torch.nn.functional.gelu(t[0]),
                   "layer_norm": lambda t: torch.nn.functional.layer_norm(t[0], t[0].shape[-1:]),
                   "softmax": lambda t: torch.softmax(t[0], -1)}
            work, nbytes = (lambda: ops[kernel](tensors)), passes * tensors[0].nbytes
        return _rated("bytes", nbytes, self.time(work), self.bytes_peak())

    def optimizer(self, kernel: str) -> dict:
        """One AdamW step (fused, or foreach: torch's default) or one global-norm clip over a
        BERT-large-shaped set of fp32 parameters. Bytes: AdamW reads parameter, gradient and two
        moments and writes three (28 per parameter); clipping reads each gradient twice (norm, scale)
        and writes it once (12)."""
        params = [self.randn(*shape, grad=True) for _ in range(self.sizes.layers) for shape in self.sizes.optimizer]
        for p in params:
            p.grad = torch.randn_like(p)
        count = sum(p.numel() for p in params)
        if kernel == "clip_grad_norm":
            work, per_param = (lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)), 12
        else:
            adamw = torch.optim.AdamW(params, lr=1e-4, fused=kernel == "adamw_fused" or None,
                                      foreach=kernel == "adamw_foreach" or None)
            work, per_param = adamw.step, 28
        return {**_rated("bytes", per_param * count, self.time(work), self.bytes_peak()), "params": count}

    def host_link(self, direction: str) -> dict:
        host = torch.empty(self.sizes.host_bytes, dtype=torch.uint8, pin_memory=self.cuda)
        device = torch.empty(self.sizes.host_bytes, dtype=torch.uint8, device=self.device)
        work = (lambda: device.copy_(host, non_blocking=True)) if direction == "h2d" else \
            (lambda: host.copy_(device, non_blocking=True))
        peak = self.facts.host_gbs * 1e9 or None
        return _rated("bytes", self.sizes.host_bytes, self.time(work), peak)

    def host_adamw(self) -> dict:
        """The host's fused CPU AdamW over fp32 parameters (memory.optimizer_offload's update): parameters a
        second, what the time model reads as `host_adamw_per_s` (28 bytes a parameter: parameter, gradient and
        both moments read, three written)."""
        count = self.sizes.host_bytes // 4
        param = torch.randn(count, requires_grad=True)
        param.grad = torch.randn(count)
        adamw = torch.optim.AdamW([param], lr=1e-4, fused=True)
        took = seconds(adamw.step, False, self.sizes.repeats, 1)  # a CPU op: the host clock
        return {**_rated("bytes", 28 * count, took, None), "params": count, "params_per_s": count / took,
                "threads": torch.get_num_threads()}

    def launch(self, ops: int = 200) -> dict:
        """The least an op costs: many tiny adds that record autograd, as a step's small ops do."""
        x = self.randn(8, grad=True)

        def work():
            for _ in range(ops):
                torch.add(x, x)
        return {"seconds": self.time(work) / ops, "ops": ops}


def measure(sizes: Sizes, device: torch.device, facts, on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Every row, in the order of what the time model leans on most; `on_row` sees each as it lands
    (the caller writes them out, so a call cut short keeps what was measured)."""
    m, rows = Measurer(sizes, device, facts), []

    def add(row: dict) -> None:
        rows.append(row)
        on_row(row)
        _release(m.cuda)

    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        add(_row("matmul", "large", dtype, [sizes.large] * 3, lambda d=dtype: m.matmul(d, *[sizes.large] * 3)))
    for shape in sizes.products:
        add(_row("matmul", "product", "bf16", shape, lambda s=shape: m.matmul("bf16", *s)))
    for dtype in ("tf32", "fp32"):
        add(_row("matmul", "product", dtype, sizes.fp32_product, lambda d=dtype: m.matmul(d, *sizes.fp32_product)))
    for family in ("flash", "efficient", "cudnn"):
        for shape in sizes.attention:
            for row in _rows("attention", family, "bf16", shape, lambda f=family, s=shape: m.attention(f, *s)):
                add(row)
    for shape in sizes.attention[:1]:  # fp32 goes to the memory-efficient kernel (3xTF32): its slowdown
        for row in _rows("attention", "efficient", "fp32", shape, lambda s=shape: m.attention("efficient", *s, "fp32")):
            add(row)
    for row in m.memory_ops():
        add(row)
    for kernel in ("adamw_fused", "adamw_foreach", "clip_grad_norm"):
        add(_row("optimizer", kernel, "fp32", [sizes.layers, len(sizes.optimizer)], lambda k=kernel: m.optimizer(k)))
    for dtype in DTYPES:
        for shape in sizes.convs:
            add(_row("conv", "conv2d", dtype, shape, lambda d=dtype, s=shape: m.conv(d, *s)))
    for direction in ("h2d", "d2h"):
        add(_row("host", direction, "uint8", [sizes.host_bytes], lambda d=direction: m.host_link(d)))
    add(_row("host", "adamw", "fp32", [sizes.host_bytes // 4], m.host_adamw))
    add(_row("launch", "add", "fp32", [8], m.launch))
    return rows


def _release(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
