"""`ckrun tune --predict` on a library recipe, against the predicted fastest plan of its whole grid.

Runs `ckrun tune RECIPE --max-mem CAP --predict --gpu GPU` as a user would (timed, a fresh study),
then reads the predictor's answer for every plan of the same space, uncapped, from the oracle
cache `bench/tune_oracle.py` writes (computing what is missing), and reports the tuned plan's
predicted throughput over the predicted fastest plan with no cap, and over the fastest plan that
fits the cap's limit (cap minus the margin).

    python bench/tune_predicted.py                       # BERT-large, 40GB, h100
    python bench/tune_predicted.py --recipe recipes/llama_1b.yaml --max-mem 80GB --gpu h100

Writes the section `tune_predicted` of docs/benchmarks_tune.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ckrun.autotune.cap import Cap
from bench.doc_sections import write_section
from bench.tune_oracle import Oracle, grid_answers, problem_space
from ckrun.runner.cli import main as ckrun
from ckrun.runner.recipe.load import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def run(recipe_path: str, cap_text: str, gpu: str, oracle_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        started = time.monotonic()
        code = ckrun(["tune", recipe_path, "--max-mem", cap_text, "--predict", "--gpu", gpu, "--output",
                      str(Path(directory) / "tune"), f"output.dir={directory}/run"])
        seconds = time.monotonic() - started
        report = json.loads((Path(directory) / "tune" / "report.json").read_text())
    recipe = load_recipe(ROOT / recipe_path, [])
    name = Path(recipe_path).stem
    oracle = Oracle(recipe, oracle_dir / f"oracle-{name}.json", (gpu,))
    rows = grid_answers(oracle, problem_space(recipe, {})[1])
    cap = Cap(report["cap_bytes"], report["margin"])
    speed = lambda row: row["times"][gpu]["samples_per_s"]  # noqa: E731
    fastest = max((r for r in rows if "peak" in r), key=speed)
    fitting = max((r for r in rows if "peak" in r and r["peak"] <= cap.limit), key=speed)
    winner = next(t for t in report["trials"] if t["number"] == report["winner"])
    return {"recipe": recipe_path, "cap": cap_text, "gpu": gpu, "exit": code, "seconds": seconds,
            "probes": sum(1 for t in report["trials"] if t.get("probe_s") is not None and t["state"] != "duplicate"),
            "grid": len(rows), "winner": winner, "fastest": fastest, "fitting": fitting,
            "limit": cap.limit, "vs_fastest": winner["samples_per_s"] / speed(fastest),
            "vs_fitting": winner["samples_per_s"] / speed(fitting)}


def markdown(r: dict, started: str) -> str:
    w, f, g = r["winner"], r["fastest"], r["fitting"]
    gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
    goal = "met" if r["vs_fastest"] >= 0.97 else "missed"
    return "\n".join([
        "## `ckrun tune --predict` against the predicted fastest plan", "",
        f"`ckrun tune {r['recipe']} --max-mem {r['cap']} --predict --gpu {r['gpu']}` on {started} "
        f"(torch {torch.__version__}, on a 2-core CPU shared with other jobs): exit {r['exit']} in "
        f"{r['seconds'] / 60:.1f} min, {r['probes']} plans predicted of the {r['grid']} in its space.", "",
        "| plan | peak | samples/s | tuned / it |", "|---|---|---|---|",
        f"| tuned: {w['label']} | {gb(w['measured_peak'])} | {w['samples_per_s']:.1f} | 1 |",
        f"| fastest, no cap: {f['label']} | {gb(f['peak'])} | {f['times'][r['gpu']]['samples_per_s']:.1f} "
        f"| {r['vs_fastest']:.3f} |",
        f"| fastest within the limit {gb(r['limit'])} (cap less the margin): {g['label']} | {gb(g['peak'])} "
        f"| {g['times'][r['gpu']]['samples_per_s']:.1f} | {r['vs_fitting']:.3f} |", "",
        f"Goal: tuned / fastest uncapped >= 0.97: {goal} ({r['vs_fastest']:.3f}). All figures are the predictor's "
        "(peak with the CUDA context; roofline step time on the datasheet facts), not measurements.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/bert_large.yaml")
    parser.add_argument("--max-mem", default="40GB")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--oracle", type=Path, default=ROOT / "runs/bench_oracle", help="the oracle cache folder")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    args.oracle.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    text = markdown(run(args.recipe, args.max_mem, args.gpu, args.oracle), started)
    if not args.no_docs:
        write_section(ROOT / "docs/benchmarks_tune.md", "tune_predicted", text)
    print(text)


if __name__ == "__main__":
    main()
