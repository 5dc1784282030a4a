"""Per-rank peak and samples/s of a small GPT-2 at 1 and 2 ranks, DDP against FSDP, on CPU (gloo), with
`ckrun estimate --nproc` against each measured per-rank peak. Writes a markdown table to stdout.

    python bench/dist.py OUT_DIR [--steps 6] > docs/benchmarks_dist.md

Each configuration is a real `ckrun RECIPE --nproc N` run in its own process group of ranks; the peak
is the highest rank's (metrics.jsonl), samples/s the median over the steps after the first two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT2 = str(ROOT / "recipes" / "gpt2.yaml")
SMALL = ["model.config={vocab_size: 8192, n_positions: 128, n_embd: 256, n_layer: 4, n_head: 4, resid_pdrop: 0.0, "
         "embd_pdrop: 0.0, attn_pdrop: 0.0}", "data.seq_len=128", "train.batch_size=8", "memory.micro_batch=null",
         "train.device=cpu", "precision=fp32", "memory.checkpointing={policy: none}", "eval=null"]
CONFIGS = [(1, "none"), (2, "ddp"), (2, "fsdp")]


def ckrun(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], env=env, capture_output=True, text=True,
                          check=True, timeout=1800)


def measure(out: Path, nproc: int, strategy: str, steps: int) -> dict:
    run = [GPT2, *SMALL, f"distributed.strategy={strategy}", f"train.steps={steps}", f"output.dir={out}"]
    ckrun(*run, *(["--nproc", str(nproc)] if nproc > 1 else []))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "peak_mem_bytes" in r]  # training steps, not evaluations
    estimate = ckrun("estimate", GPT2, *SMALL, f"distributed.strategy={strategy}", "--device", "cpu", "--json",
                     *(["--nproc", str(nproc)] if nproc > 1 else []))
    peak = max(r["peak_mem_bytes"] for r in records)
    predicted = json.loads(estimate.stdout)["peak_bytes"]
    return {"nproc": nproc, "strategy": strategy, "peak": peak, "predicted": predicted,
            "error": (predicted - peak) / peak, "samples_per_s": statistics.median(r["samples_per_s"] for r in records[2:])}


def table(rows: list[dict]) -> str:
    lines = ["| ranks | strategy | per-rank peak (MB) | predicted (MB) | error | samples/s (global) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['nproc']} | {r['strategy']} | {r['peak'] / 1e6:.2f} | {r['predicted'] / 1e6:.2f} | "
              f"{100 * r['error']:+.1f}% | {r['samples_per_s']:.1f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = [measure(args.out / f"{nproc}-{strategy}", nproc, strategy, args.steps) for nproc, strategy in CONFIGS]
    print(table(rows))


if __name__ == "__main__":
    main()
