"""Call 1 of the GPU campaign (4 minutes): what this GPU, driver and torch do, measured once.

    python bench/gpu/facts.py OUT_DIR [--dry-run] [--budget-s 230]

Writes OUT_DIR/facts.json: versions and the allocator settings torch reports in effect; the CUDA
context at init and after lazy module loading; the cuBLAS workspace per stream (what the prediction
adds per handle); the extra bytes that flash and memory-efficient attention allocate in backward
beyond their gradients; pinned host<->device bandwidth (what offload's copies can reach); the bf16
matrix-product rate this card reaches (MFU's peak is the datasheet's; this says how much of it a
kernel can get); then `pytest -m cuda` with what is left of the budget (its log in
OUT_DIR/pytest-cuda.log; no CPU suite here: CI runs that). Each probe runs in its own subprocess, so
one process's lazily loaded kernels never count towards another's context. `--dry-run` runs the
same code at toy size on the CPU (the CUDA parts report null) so the campaign cannot rot between
GPU sessions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package: `python bench/gpu/facts.py` must find it too
    sys.path.insert(0, str(REPO))

from bench.gpu.budget import Budget  # noqa: E402

MiB = 1 << 20
PROBE_S = 90  # the most one probe may take (each is seconds on an H100)


def versions() -> dict:
    import transformers

    found = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
             "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
             "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
             "alloc_conf_generic": os.environ.get("PYTORCH_ALLOC_CONF", ""),
             "alloc_in_effect": _allocator_in_effect(),
             "module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default: LAZY)")}
    for name in ("torchvision", "optuna", "pydantic"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found.update(device=props.name, total_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                     multiprocessors=props.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                     driver=_driver())
    else:
        found.update(device=f"cpu ({platform.machine()})", total_bytes=0)
    return found


def _allocator_in_effect() -> str | None:
    from runner.memory.allocator import settings_in_effect

    return settings_in_effect()


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# --- probes, each in a fresh process ----------------------------------------------------------


def _used_beyond_allocator() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def probe_context() -> dict:
    """Context right after init, then after the kernels a BERT step needs have been loaded, both as
    the card's used memory and as ckrun measures it (NVML per process where it can)."""
    from runner.memory import nvml
    from runner.memory.measure import context_after_kernels, cuda_context_bytes, note_card_before_cuda

    note_card_before_cuda()  # as the trainer does: what else holds the card, before our context joins it
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    at_init, ckrun_at_init = _used_beyond_allocator(), cuda_context_bytes(device)
    ckrun_after = context_after_kernels(device)
    return {"context_at_init_bytes": at_init, "context_after_bert_kernels_bytes": _used_beyond_allocator(),
            "ckrun_context_at_init_bytes": ckrun_at_init, "ckrun_context_after_kernels_bytes": ckrun_after,
            "nvml_lists_this_process": nvml.own_bytes(0) is not None, "nvml_other_processes": nvml.others(0)}


def probe_cublas_workspace() -> dict:
    """Allocator bytes that matmuls keep (one workspace per cuBLAS handle and stream): after a
    forward, after its backward (autograd's thread has its own handle), and on a side stream."""
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = x @ w
    torch.cuda.synchronize()
    first = torch.cuda.memory_allocated() - before - y.nbytes
    y.float().sum().backward()
    del y
    torch.cuda.synchronize()
    after_backward = torch.cuda.memory_allocated() - before - w.grad.nbytes
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        before = torch.cuda.memory_allocated()
        z = x @ x
        side.synchronize()
        second = torch.cuda.memory_allocated() - before - z.nbytes
    return {"cublas_workspace_bytes": first, "cublas_workspaces_after_backward_bytes": after_backward,
            "cublas_workspace_side_stream_bytes": second,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")}


def probe_attention_scratch(batch: int = 16, heads: int = 16, seq: int = 512, head_dim: int = 64) -> dict:
    """Peak bytes an attention backward allocates beyond its input gradients, per kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    found = {"shape": [batch, heads, seq, head_dim]}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        grad = torch.randn_like(out)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.backward(out, grad)
        torch.cuda.synchronize()
        grads = 3 * q.nbytes
        found[f"{name}_backward_scratch_bytes"] = torch.cuda.max_memory_allocated() - base - grads
        del q, k, v, out, grad
    return found


def probe_pinned_bandwidth(mib: int = 512) -> dict:
    """Pinned host<->device copy rates, median of 5 timed copies after a warm-up."""
    host = torch.empty(mib * MiB, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(mib * MiB, dtype=torch.uint8, device="cuda")
    rates = {}
    for name, copy in (("h2d", lambda: device.copy_(host, non_blocking=True)),
                       ("d2h", lambda: host.copy_(device, non_blocking=True))):
        copy()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        rates[f"pinned_{name}_bytes_per_s"] = mib * MiB / sorted(times)[2]
    return rates


def probe_matmul(n: int = 8192, warmup: int = 3, timed: int = 10) -> dict:
    """bf16 [n, n] @ [n, n] on random data (zeros run faster), median of `timed` products timed with
    events after `warmup`: the matrix rate a step's kernels can reach on this card."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(warmup):
        a @ b
    times = []
    for _ in range(timed):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    seconds = sorted(times)[len(times) // 2]
    return {"shape": [n, n, n], "bf16_flops_per_s": 2 * n**3 / seconds, "seconds": seconds}


PROBES = {"context": probe_context, "cublas": probe_cublas_workspace, "attention": probe_attention_scratch,
          "bandwidth": probe_pinned_bandwidth, "matmul": probe_matmul}


def run_probe_isolated(name: str, timeout_s: float) -> dict:
    """One probe in a fresh interpreter; a failure becomes {"error": ...} rather than ending the campaign."""
    code = f"import json, bench.gpu.facts as f; print('RESULT' + json.dumps(f.PROBES[{name!r}]()))"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT"):])
    return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]}


def cuda_tests(out: Path, budget: Budget, dry_run: bool) -> dict:
    """`pytest -m cuda` in what is left of the budget; the summary line and the failed tests' names."""
    if dry_run or not torch.cuda.is_available():
        return {"status": "not run", "reason": "dry run" if dry_run else "no CUDA GPU"}
    limit = budget.limit(budget.left(), keep=5)
    command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rf"]
    log_path = out / "pytest-cuda.log"
    with open(log_path, "w", encoding="utf-8") as log:  # a file: what ran before a timeout is kept
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            status = "passed" if process.wait(timeout=limit) == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the tests' own subprocesses too
            process.wait()
            status = "timed out"
    text = log_path.read_text(encoding="utf-8", errors="replace")
    lines = text.strip().splitlines()
    return {"status": status, "limit_s": round(limit), "summary": lines[-1] if lines else "",
            "failed": [line.split(" ", 2)[1] for line in lines if line.startswith("FAILED ")]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="toy size on the CPU: the CUDA probes report null")
    parser.add_argument("--budget-s", type=float, default=230.0, help="this call's share of the GPU (default 230)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = {"versions": versions(), "dry_run": args.dry_run}
    for name in PROBES:
        run = not args.dry_run and torch.cuda.is_available() and budget.allows(PROBE_S)
        facts[name] = run_probe_isolated(name, budget.limit(PROBE_S)) if run else None
        print(f"{name}: {facts[name]}", flush=True)
    facts["cuda_tests"] = cuda_tests(args.out, budget, args.dry_run)
    print(f"pytest -m cuda: {facts['cuda_tests']}", flush=True)
    facts["budget"] = budget.record()
    (args.out / "facts.json").write_text(json.dumps(facts, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
