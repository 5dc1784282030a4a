"""Per-rank peak and samples/s of a small Llama at 1, 2 and 4 ranks under ddp, fsdp, hsdp and tp, on CPU
(gloo), with `ckrun estimate --nproc` against each measured per-rank peak. Writes a markdown table.

    python bench/dist.py OUT_DIR [--steps 6] [--only 4:tp:2 ...] > table.md

Each configuration is a real `ckrun RECIPE --nproc N` run in its own process group of ranks; the peak
is the highest rank's (metrics.jsonl), samples/s the median over the steps after the first two. The
model is recipes/llama_1b.yaml made small from its config (no weights read), so transformers' own
tensor-parallel plan (LlamaConfig.base_model_tp_plan) is what tp splits.
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
sys.path.insert(0, str(ROOT))

from ckrun.runner.plan.strategies import strategy_from_label  # noqa: E402 - after the path that finds it

LLAMA = str(ROOT / "recipes" / "llama_1b.yaml")
# 4 layers x 256, 4 heads (each also its own key/value head, so tp:4 splits them), vocab 8192, seq 128
SMALL = ["model.config={vocab_size: 8192, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 4, "
         "num_attention_heads: 4, num_key_value_heads: 4, max_position_embeddings: 128, tie_word_embeddings: false}",
         "data.seq_len=128", "train.batch_size=8", "memory.micro_batch=null", "train.device=cpu", "precision=fp32",
         "memory.checkpointing={policy: none}", "output.checkpoint_every=0"]
CONFIGS = [(1, "none"), (2, "ddp"), (2, "fsdp"), (2, "hsdp:1"), (2, "tp:2"),
           (4, "ddp"), (4, "fsdp"), (4, "hsdp:2"), (4, "tp:2"), (4, "tp:4")]


def ckrun(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ckrun", *args], env=env, capture_output=True, text=True,
                          check=True, timeout=1800)


def distributed(label: str) -> str:
    """The recipe override for a tuner label: `hsdp:2` -> distributed={"strategy": "hsdp", "shard": 2}."""
    return "distributed=" + json.dumps(strategy_from_label(label).model_dump(exclude_none=True))


def measure(out: Path, nproc: int, label: str, steps: int) -> dict:
    ranks = ["--nproc", str(nproc)] if nproc > 1 else []
    ckrun(LLAMA, *SMALL, distributed(label), f"train.steps={steps}", f"output.dir={out}", *ranks)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "peak_mem_bytes" in r]  # training steps, not evaluations
    estimate = ckrun("estimate", LLAMA, *SMALL, distributed(label), "--device", "cpu", "--json", *ranks)
    peak = max(r["peak_mem_bytes"] for r in records)
    predicted = json.loads(estimate.stdout)["peak_bytes"]
    return {"nproc": nproc, "strategy": label, "peak": peak, "predicted": predicted, "losses": [r["loss"] for r in records],
            "error": (predicted - peak) / peak, "samples_per_s": statistics.median(r["samples_per_s"] for r in records[2:])}


def table(rows: list[dict]) -> str:
    single = next((r["losses"] for r in rows if r["nproc"] == 1), None)
    lines = ["| ranks | strategy | per-rank peak (MB) | predicted (MB) | error | samples/s (global) | last loss vs 1 rank |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        drift = f"{abs(r['losses'][-1] - single[-1]) / single[-1]:.1e}" if single else "-"
        lines.append(f"| {r['nproc']} | {r['strategy']} | {r['peak'] / 1e6:.2f} | {r['predicted'] / 1e6:.2f} | "
                     f"{100 * r['error']:+.2f}% | {r['samples_per_s']:.1f} | {drift} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", nargs="*", metavar="N:LABEL", help="configurations to run, e.g. 1:none 4:tp:2")
    args = parser.parse_args()
    chosen = [(int(n), label) for n, _, label in (item.partition(":") for item in args.only)] if args.only else CONFIGS
    rows = [measure(args.out / f"{nproc}-{label.replace(':', '')}", nproc, label, args.steps) for nproc, label in chosen]
    print(table(rows))


if __name__ == "__main__":
    main()
