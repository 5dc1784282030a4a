"""Call 1 of the GPU campaign: what this GPU, driver and torch do with memory, measured once.

    python bench/gpu/facts.py OUT_DIR [--dry-run]

Writes OUT_DIR/facts.json: versions; the CUDA context at init and after lazy module loading;
the cuBLAS workspace per stream (what the prediction adds per handle); the extra bytes that
flash and memory-efficient attention allocate in backward beyond their gradients; pinned
host<->device bandwidth (what offload's copies can reach). Each probe runs in its own
subprocess, so one process's lazily loaded kernels never count towards another's context.
`--dry-run` runs the same code at toy size on the CPU (the CUDA parts report null) so the
campaign cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

MiB = 1 << 20


def versions() -> dict:
    import transformers

    found = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
             "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
             "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
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
    from runner.memory.measure import context_after_kernels, cuda_context_bytes

    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)
    at_init, ckrun_at_init = _used_beyond_allocator(), cuda_context_bytes(device)
    ckrun_after = context_after_kernels(device)
    return {"context_at_init_bytes": at_init, "context_after_bert_kernels_bytes": _used_beyond_allocator(),
            "ckrun_context_at_init_bytes": ckrun_at_init, "ckrun_context_after_kernels_bytes": ckrun_after}


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


PROBES = {"context": probe_context, "cublas": probe_cublas_workspace, "attention": probe_attention_scratch,
          "bandwidth": probe_pinned_bandwidth}


def run_probe_isolated(name: str) -> dict:
    """One probe in a fresh interpreter; a failure becomes {"error": ...} rather than ending the campaign."""
    code = f"import json, bench.gpu.facts as f; print('RESULT' + json.dumps(f.PROBES[{name!r}]()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    for line in done.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT"):])
    return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1][:300]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="toy size on the CPU: the CUDA probes report null")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = {"versions": versions(), "dry_run": args.dry_run}
    for name in PROBES:
        facts[name] = None if args.dry_run or not torch.cuda.is_available() else run_probe_isolated(name)
        print(f"{name}: {facts[name]}", flush=True)
    (args.out / "facts.json").write_text(json.dumps(facts, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
