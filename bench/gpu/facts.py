"""Step 1 of the GPU campaign: what this GPU, driver and torch do, and the time model's calibration.

    python bench/gpu/facts.py OUT_DIR [--dry-run] [--budget-s 55]

Writes, each rewritten as soon as a part is measured (a call cut short keeps what was measured):
- OUT_DIR/facts.json: versions and the allocator settings torch reports in effect; the CUDA context
  at init and after lazy module loading (in a fresh process, first, before this one starts CUDA);
  the cuBLAS workspace per stream (what the prediction adds per handle; measured before any other
  product here); the extra bytes flash and memory-efficient attention allocate in backward beyond
  their gradients; pinned host<->device bandwidth; the bf16 matrix rate (from the calibration).
- OUT_DIR/calibration.json: every per-op-class rate and its share of the datasheet peak
  (bench/gpu/kernel_rates.py: products by shape and dtype, convolutions, attention per kernel family,
  memory-bound ops, the optimizer step, host link, launch floor) and the entry they make for the time
  model's calibration table (bench/gpu/calibrate.py).
  It also holds the card's measured facts (ckrun.runner.predict.hardware.measure_gpu), which
  `python bench/gpu/calibrate.py OUT_DIR/calibration.json --facts-json gpu.json` writes out for
  `ckrun estimate --gpu gpu.json`.
`--dry-run` runs the same code at toy size on the CPU (the CUDA-only parts report null; gpu.json
the device facts are this CPU's), so the campaign cannot rot between GPU sessions.
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

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package: `python bench/gpu/facts.py` must find it too
    sys.path.insert(0, str(REPO))

from bench.gpu import calibrate, kernel_rates  # noqa: E402
from bench.gpu.budget import Budget, write_json  # noqa: E402

MiB = 1 << 20


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
    from ckrun.runner.memory.allocator import settings_in_effect

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
    from ckrun.runner.memory import nvml
    from ckrun.runner.memory.measure import context_after_kernels, cuda_context_bytes, note_card_before_cuda

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
    copies = {"h2d": lambda: device.copy_(host, non_blocking=True), "d2h": lambda: host.copy_(device, non_blocking=True)}
    return {f"pinned_{name}_bytes_per_s": mib * MiB / kernel_rates.seconds(copy, cuda=True, repeats=5, warmup=1)
            for name, copy in copies.items()}


PROBES = {"context": probe_context, "cublas": probe_cublas_workspace, "attention": probe_attention_scratch,
          "bandwidth": probe_pinned_bandwidth}
CONTEXT_S = 20  # the context probe's fresh process (importing torch, a CUDA context, a step's kernels): ~10 s
PART_S = 10  # one in-process part (each takes seconds on an H100)
CALIBRATION_S = 25  # every calibration row (about 10 s on an H100, allocation included)


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


def run_part(part) -> dict:
    """An in-process part; its failure is its result, not the end of the step."""
    try:
        return part()
    except Exception as err:  # noqa: BLE001 - reported in facts.json
        return {"error": f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"}


def device_facts(cuda: bool) -> tuple[object, str, object]:
    """(the peaks the calibration's shares are of, what they are, this card's measured facts: this
    CPU's in a dry run)."""
    from ckrun.runner.predict import hardware

    measured = hardware.measure_gpu() if cuda else hardware.this_cpu()
    datasheet = hardware.this_gpu() if cuda else None
    if datasheet is not None:
        return datasheet, f"datasheet ({datasheet.source})", measured
    return measured, "measured here (ckrun's GPU table does not list this card)" if cuda else "this CPU, measured", \
        measured


def calibration(cuda: bool, out: Path, found: dict) -> dict:
    """OUT/calibration.json, rewritten after every row; returns the headline bf16 rate for facts.json.
    It carries the measured device facts too (`calibrate.py --facts-json gpu.json` writes them out for
    `--gpu gpu.json`): a call brings back at most 8 files."""
    peaks, peaks_from, measured = device_facts(cuda)
    versions_found = found["versions"]
    results = {"dry_run": not cuda, "versions": versions_found, "peaks_from": peaks_from,
               "device_facts": measured.model_dump(mode="json"), "rows": [], "entry": None}
    path = out / "calibration.json"
    key = calibrate.applies_to(versions_found.get("device", ""), versions_found.get("capability"))

    def landed(row: dict) -> None:
        results["rows"].append(row)
        results["entry"] = calibrate.calibration_entry(results["rows"], versions_found, key, peaks)
        results["entry_problem"] = calibrate.check_entry(results["entry"])
        write_json(path, results)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    kernel_rates.measure(kernel_rates.GPU if cuda else kernel_rates.DRY_RUN, device, peaks, landed)
    large = next((r for r in results["rows"] if r["kernel"] == "large" and r["dtype"] == "bf16" and r.get("rate")), None)
    return None if large is None else {"shape": large["shape"], "bf16_flops_per_s": large["rate"],
                                       "seconds": large["seconds"], "datasheet_share": large.get("share")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="toy size on the CPU: the CUDA probes report null")
    parser.add_argument("--budget-s", type=float, default=55.0, help="this step's share of the call (default 55)")
    args = parser.parse_args(argv)
    budget = Budget(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = not args.dry_run and torch.cuda.is_available()  # asks the driver; starts no context here
    if args.dry_run:
        torch.set_num_threads(1)  # toy sizes gain nothing from threads; spinning ones slow a shared 2-core box
    facts = {"dry_run": args.dry_run, "versions": None, **dict.fromkeys((*PROBES, "matmul"))}
    write = lambda **extra: write_json(args.out / "facts.json", {**facts, "budget": {**budget.record(), **extra}})  # noqa: E731
    watchdog = budget.arm(lambda: write(stopped="at the deadline, in the middle of a part"))
    if cuda and budget.allows(CONTEXT_S):  # first: this process must hold no context while it is measured
        facts["context"] = run_probe_isolated("context", budget.limit(CONTEXT_S))
    facts["versions"] = versions()
    write()
    for name in ("cublas", "attention", "bandwidth"):  # cuBLAS first: no product has run in this process yet
        if cuda and budget.allows(PART_S):
            facts[name] = run_part(PROBES[name])
            print(f"{name}: {facts[name]}", flush=True)
            write()
    if budget.allows(CALIBRATION_S if cuda else 1):
        facts["matmul"] = run_part(lambda: calibration(cuda, args.out, facts))
        print(f"bf16 matrix rate: {facts['matmul']}", flush=True)
    else:
        facts["matmul"] = {"error": f"skipped: {budget.left():.0f} s left, the calibration takes ~{CALIBRATION_S} s"}
    write()
    watchdog.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
