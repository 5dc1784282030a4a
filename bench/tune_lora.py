"""`ckrun tune --predict` on the LoRA recipe at full size: does the tuner plan a LoRA fine-tune, and how
do its bytes compare with full fine-tuning of the same model under the same plan?

    python bench/tune_lora.py                                   # llama_1b_lora, 22GB, l4, 8 trials
    python bench/tune_lora.py --max-mem 12GB --gpu a10 --trials 4

Runs `ckrun tune recipes/llama_1b_lora.yaml --max-mem CAP --predict --gpu GPU` as a user would (timed,
a fresh study), then `ckrun estimate` of the tuned plan with and without model.lora (the full
fine-tune of the same model), and writes the section `tune_lora` of docs/benchmarks_tune.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.doc_sections import write_section
from ckrun.runner.cli import main as ckrun

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/llama_1b_lora.yaml"


def _estimate(recipe: Path, gpu: str, *overrides: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ckrun(["estimate", str(recipe), "--gpu", gpu, "--json", *overrides])
    if code:
        raise SystemExit(f"ckrun estimate {recipe} {' '.join(overrides)} ended with {code}")
    return json.loads(out.getvalue())


def run(cap: str, gpu: str, trials: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        started = time.monotonic()
        code = ckrun(["tune", RECIPE, "--max-mem", cap, "--predict", "--gpu", gpu, "--trials", str(trials),
                      "--output", f"{directory}/tune", f"output.dir={directory}/run"])
        seconds = time.monotonic() - started
        report = json.loads(Path(f"{directory}/tune/report.json").read_text())
        tuned = Path(f"{directory}/tune/tuned.yaml")
        lora = _estimate(tuned, gpu)
        full = _estimate(tuned, gpu, "model.lora=null")
    winner = next(t for t in report["trials"] if t["number"] == report["winner"])
    predicted = sum(1 for t in report["trials"] if t.get("probe_s") is not None and t["state"] != "duplicate")
    return {"cap": cap, "gpu": gpu, "exit": code, "seconds": seconds, "predicted": predicted, "winner": winner,
            "lora": lora, "full": full}


def markdown(r: dict, started: str) -> str:
    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
    row = lambda name, e: (f"| {name} | {gb(e['peak_bytes'])} | " + " | ".join(  # noqa: E731
        gb(e["breakdown"].get(k, 0)) for k in ("parameters", "gradients", "optimizer_state", "activations"))
        + f" | {e['time']['samples_per_s']:.2f} |")
    return "\n".join([
        "## `ckrun tune --predict` of a LoRA recipe", "",
        f"`ckrun tune {RECIPE} --max-mem {r['cap']} --predict --gpu {r['gpu']}` on {started} (torch "
        f"{torch.__version__}, on a 2-core CPU shared with other jobs): exit {r['exit']} in {r['seconds'] / 60:.1f} "
        f"min, {r['predicted']} plans predicted; the tuned plan: {r['winner']['label']}, predicted peak "
        f"{gb(r['winner']['measured_peak'])} (with the CUDA context).", "",
        "The tuned plan's estimate (`ckrun estimate tuned.yaml --gpu ...`), beside the full fine-tune of the same "
        "model under the same plan (`model.lora=null`):", "",
        "| training | peak | parameters | gradients | optimizer state | activations | samples/s |",
        "|---|---|---|---|---|---|---|",
        row("LoRA rank 16, all-linear, bf16 base", r["lora"]), row("full fine-tune", r["full"]), "",
        "All figures are the predictor's (fake tensors; the allocator model; roofline time on the datasheet "
        "facts), not measurements.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-mem", default="22GB")
    parser.add_argument("--gpu", default="l4")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    text = markdown(run(args.max_mem, args.gpu, args.trials), started)
    if not args.no_docs:
        write_section(ROOT / "docs/benchmarks_tune.md", "tune_lora", text)
    print(text)


if __name__ == "__main__":
    main()
