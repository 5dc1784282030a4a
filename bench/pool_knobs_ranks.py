"""The pool knobs on ranks (CPU, gloo): each knob alone and all at once, in one process and under ddp and
fsdp at 2 ranks (hsdp:2 at 4 with --hsdp): the highest rank's measured peak against `ckrun estimate
--nproc N`, and the last step's loss against one process's run of the same plan and against exact
training. Writes a markdown table (docs/benchmarks_dist.md, "Pool knobs on ranks").

    PYTHONPATH=. python bench/pool_knobs_ranks.py OUT_DIR [--hsdp] > table.md

The model is tests/runner/parallel/test_pool_knobs_ranks.py's (BERT tiny without dropout, 32 wide with a
256-wide feed-forward, 64 positions, global batch 32, 3 steps, AdamW, no clipping), so the table shows
what that test holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from bench.dist import ckrun

ROOT = Path(__file__).resolve().parents[1]
BERT = str(ROOT / "recipes" / "bert_tiny.yaml")
TINY = ["model.config.hidden_size=32", "model.config.intermediate_size=256", "model.config.vocab_size=256",
        "model.config.max_position_embeddings=64", "data.seq_len=64", "train.batch_size=32", "train.device=cpu",
        "train.grad_clip=null", "model.config.hidden_dropout_prob=0.0", "model.config.attention_probs_dropout_prob=0.0",
        "train.steps=3", "output.log_every=1", "output.checkpoint_every=0"]
BF16 = ["memory.weights={policy: bf16}", "precision=bf16"]
LOSSY = "memory.allow_lossy=true"
ALL = [*BF16, "memory.optimizer_state={policy: 8bit}", "memory.loss={policy: chunked}",
       "memory.checkpointing={policy: full}", LOSSY]
KNOBS = {  # name: (overrides, the exact plan a lossy one is compared with; None: exact itself)
    "8bit": (["memory.optimizer_state={policy: 8bit}", LOSSY], []),
    "4bit": (["memory.optimizer_state={policy: 4bit}", LOSSY], []),
    "fp8": (["memory.optimizer_state={policy: fp8}", LOSSY], []),
    "bf16": ([*BF16, LOSSY], ["precision=bf16"]),
    "chunked": (["memory.loss={policy: chunked}"], None),
    "in_backward": (["memory.optimizer_step={policy: in_backward}"], None),
    "all": (ALL, ["precision=bf16", "memory.loss={policy: chunked}", "memory.checkpointing={policy: full}"]),
}
IN_BACKWARD = "memory.optimizer_step={policy: in_backward}"


def layouts(hsdp: bool) -> list[tuple[int, list[str], str]]:
    """(ranks, the strategy's overrides, its label)."""
    chosen = [(2, ["distributed.strategy=ddp"], "ddp"), (2, ["distributed.strategy=fsdp"], "fsdp")]
    return chosen + ([(4, ["distributed.strategy=hsdp", "distributed.shard=2"], "hsdp:2")] if hsdp else [])


def plan_of(knob: str, label: str) -> list[str]:
    """The knob's overrides under `label`; all at once includes the update in the backward where it runs."""
    args = KNOBS[knob][0]
    return [*args, IN_BACKWARD] if knob == "all" and label not in ("ddp",) else args


_TRAINED: dict[tuple[str, ...], list[dict]] = {}


def trained(out: Path, args: list[str], ranks: list[str]) -> list[dict]:
    """The records of `ckrun BERT ARGS`, each plan trained once (one process's runs repeat across layouts)."""
    key = (*args, *ranks)
    if key not in _TRAINED:
        run = out / f"run{len(_TRAINED)}"
        try:
            ckrun(BERT, *TINY, *args, f"output.dir={run}", *ranks)
        except subprocess.CalledProcessError as err:  # what the run said, not only that it failed
            raise SystemExit(f"{' '.join(err.cmd)}\nended with status {err.returncode}:\n{err.stderr[-4000:]}") from None
        _TRAINED[key] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return _TRAINED[key]


def measure(out: Path, knob: str, nproc: int, strategy: list[str], label: str) -> dict:
    ranks = ["--nproc", str(nproc)]
    args = [*plan_of(knob, label), *strategy]
    records, single = trained(out, args, ranks), trained(out, plan_of(knob, label), [])
    exact = trained(out, KNOBS[knob][1], []) if KNOBS[knob][1] is not None else single
    estimate = ckrun("estimate", BERT, *TINY, *args, "--device", "cpu", "--json", *ranks)
    peak, predicted = max(r["peak_mem_bytes"] for r in records), json.loads(estimate.stdout)["peak_bytes"]
    one, ours, true = single[-1]["loss"], records[-1]["loss"], exact[-1]["loss"]
    return {"knob": knob, "layout": f"{label} x{nproc}", "peak": peak, "predicted": predicted,
            "vs_one": abs(ours - one) / one, "one_vs_exact": abs(one - true) / true}


def table(rows: list[dict]) -> str:
    lines = ["| knob | layout | per-rank peak (kB) | predicted (kB) | error | last loss vs 1 process | 1 process vs exact |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['knob']} | {r['layout']} | {r['peak'] / 1e3:.1f} | {r['predicted'] / 1e3:.1f} | "
                     f"{100 * (r['predicted'] - r['peak']) / r['peak']:+.2f}% | {r['vs_one']:.1e} | "
                     f"{r['one_vs_exact']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hsdp", action="store_true", help="also hsdp:2 at 4 ranks")
    parser.add_argument("--only", nargs="*", choices=list(KNOBS), help="these knobs only")
    args = parser.parse_args()
    rows = [measure(args.out, knob, nproc, strategy, label) for knob in (args.only or KNOBS)
            for nproc, strategy, label in layouts(args.hsdp) if not (label == "ddp" and knob == "in_backward")]
    print(table(rows))


if __name__ == "__main__":
    main()
