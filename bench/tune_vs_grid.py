"""`ckrun tune` against an exhaustive grid over the same space, on the CPU.

For a small BERT, a small GPT-2 and a small ResNet (with BatchNorm): measure every plan of the
space (the grid), set the cap so that its limit lies halfway between the smallest peak and the
no-plan peak, then run `ckrun tune` with a quarter of the grid's probes (the re-runs of its best
plan included). The questions: does the tuner's plan reach >= 0.98 of the grid-best feasible
throughput, and how fast is the solver's first proposal (the tuner's first probe) against it?
One measurement per plan is noisy on a shared CPU, so the tuner's plan, the solver's first plan,
the grid's best and the plan one writes by hand (every block checkpointed, the largest
micro-batch that fits) are then measured again side by side, interleaved, CONFIRM times each; the
ratios use those medians. Probes run single-threaded (OMP_NUM_THREADS=1) so that they fight less
with other jobs.

    python bench/tune_vs_grid.py                       # three models: 15 minutes idle, over an hour busy
    python bench/tune_vs_grid.py --cases bert --out runs/bench_tune
    python bench/tune_vs_grid.py --quick --out /tmp/bench_quick   # tiny models, one step, one re-run: a smoke run

Writes OUT/CASE/{grid,tune,confirm}/, OUT/CASE/results.json and a markdown section to
docs/benchmarks_tune.md (`--report-only` rewrites the section from OUT).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

from ckrun.autotune.cap import Cap
from ckrun.autotune.probes.child import device_info
from ckrun.autotune.probes.probe import ProbeRunner, ProbeSettings
from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space, describe
from ckrun.autotune.search.tuner import FINALIST_RUNS
from ckrun.runner.cli import main as ckrun
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
MARGIN = 0.05
# (recipe, overrides, tune flags); batch 32 gives 6 micro-batches x 6 checkpointing rules = 36 plans, so a
# quarter of the grid (9 probes) is a real search. ResNet has BatchNorm, so the tuner keeps its micro_batch
# unless told otherwise: --search-micro-batch (BatchNorm then normalises over a micro-batch) gives 4 x 8 plans.
# (bf16 instead would double the grid but runs ten times slower on a CPU without bf16 units.)
CASES = {
    "bert": (ROOT / "recipes/bert_tiny.yaml", [
        "model.config.num_hidden_layers=4", "model.config.hidden_size=64", "model.config.intermediate_size=256",
        "model.config.vocab_size=2048", "data.seq_len=64", "train.batch_size=32", "train.device=cpu"], []),
    "gpt2": (ROOT / "recipes/gpt2.yaml", [
        "model.config.n_layer=4", "model.config.n_embd=64", "model.config.n_head=2", "model.config.vocab_size=2048",
        "model.config.n_positions=64", "data.seq_len=64", "train.batch_size=32", "train.device=cpu",
        "precision=fp32", "memory.micro_batch=null"], []),
    "resnet": (ROOT / "recipes/resnet50.yaml", [  # resnet18 has BatchNorm: micro_batch stays the recipe's
        "model.name=resnet18", "model.config.num_classes=10", "data.image_size=112", "train.batch_size=8",
        "train.device=cpu", "precision=fp32", "memory.micro_batch=null"], ["--search-micro-batch"]),
}
QUICK = {  # appended for --quick: later overrides win
    "bert": ["model.config.num_hidden_layers=2", "model.config.hidden_size=32", "model.config.intermediate_size=64",
             "model.config.vocab_size=256", "data.seq_len=32", "train.batch_size=2"],
    "gpt2": ["model.config.n_layer=2", "model.config.n_embd=32", "model.config.vocab_size=256",
             "model.config.n_positions=32", "data.seq_len=32", "train.batch_size=2"],
    "resnet": ["train.batch_size=2", "data.image_size=64"],
}
SETTINGS = ProbeSettings()  # the tuner's defaults
CONFIRM = 3
FINALISTS = 1  # the tuner's best plan is measured FINALIST_RUNS times, within the quarter of the grid
SHARE = 4  # the tuner gets 1/SHARE of the grid's probes
MIN_SEARCH = 4  # new plans the search needs at least; below it the finalists' re-runs are dropped


def _space(path: Path, overrides: list[str], flags: list[str]):
    recipe = load_recipe(path, overrides)
    facts = ModelFacts.from_json(model_facts(recipe))
    if "resnet" in recipe.model.name and not facts.batchnorm:
        raise SystemExit(f"{recipe.model.name}: no BatchNorm found; the ResNet case is meant to have it")
    device = Device.from_json(device_info(recipe))
    return recipe, build_space(recipe, facts, device, search_precision="--search-precision" in flags,
                               search_micro_batch="--search-micro-batch" in flags)


def run_grid(path: Path, overrides: list[str], flags: list[str], directory: Path) -> list[dict]:
    """Every plan of the space, measured the way the tuner measures (one child per plan)."""
    recipe, space = _space(path, overrides, flags)
    probe_runner, rows = ProbeRunner(directory, SETTINGS), []
    for number, params in enumerate(space.all_params()):
        candidate = space.candidate(params)
        result = probe_runner.probe(candidate.recipe(recipe, 10**12), number)  # no cap: measure everything
        rows.append({"key": candidate.key, "label": describe(candidate), "micro_batch": candidate.plan.micro_batch,
                     "checkpointing": candidate.plan.checkpointing.label(), "precision": candidate.precision,
                     "status": result.status, "peak": result.measured_peak_bytes, "speed": result.samples_per_s,
                     "reason": result.reason})
        logging.info("grid %d/%d: %s: %s", number + 1, space.size, describe(candidate), _row_text(rows[-1]))
    return rows


def _row_text(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']} ({row['reason']})"
    return f"{format_bytes(row['peak'])}, {row['speed']:.2f} samples/s"


def choose_cap(rows: list[dict], batch_size: int, precision: str) -> int:
    """The cap whose limit (cap minus margin) lies halfway between the smallest and the no-plan peak."""
    ok = [r for r in rows if r["status"] == "ok"]
    no_plan = next(r for r in ok if r["label"] == f"micro_batch {batch_size}, checkpointing none, {precision}")
    return int((no_plan["peak"] + min(r["peak"] for r in ok)) / 2 / (1 - MARGIN))


def run_tuner(path: Path, overrides: list[str], flags: list[str], directory: Path, cap: int, probes: int) -> dict:
    """`ckrun tune` held to `probes` in all: the search gets what the finalists' re-runs can take at most
    (Tuner.confirm stops after 2 x finalists x (runs - 1): a re-run can change which plans are the finalists)."""
    finalists = FINALISTS if probes - 2 * FINALISTS * (FINALIST_RUNS - 1) >= MIN_SEARCH else 0
    extra = 2 * finalists * (FINALIST_RUNS - 1)
    code = ckrun(["tune", str(path), *overrides, *flags, f"output.dir={directory}", "--output", str(directory),
                  "--max-mem", str(cap), "--trials", str(max(1, probes - extra)), "--finalists", str(finalists),
                  "--no-train", "--seed", "0", "--warmup-steps", str(SETTINGS.warmup_steps),
                  "--timed-steps", str(SETTINGS.timed_steps)])
    report = json.loads((directory / "report.json").read_text())
    report["exit"] = code
    launched = (directory / "probes" / "probes.log").read_text().splitlines()
    report["probes"] = sum(1 for line in launched if json.loads(line)["what"] == "probe")
    return report


def confirm(path: Path, overrides: list[str], directory: Path, plans: dict[str, str]) -> dict[str, dict]:
    """Each named plan (by key) probed CONFIRM times, interleaved so that they share the machine's moods."""
    recipe = load_recipe(path, overrides)
    candidates = {key: _candidate(key) for key in plans.values()}  # the solver's plans are not in the grid
    probe_runner, speeds = ProbeRunner(directory, SETTINGS), {name: [] for name in plans}
    for round_ in range(CONFIRM):
        for index, (name, key) in enumerate(plans.items()):
            result = probe_runner.probe(candidates[key].recipe(recipe, 10**12), round_ * len(plans) + index)
            speeds[name].append(result.samples_per_s or 0.0)
    return {name: {"median": statistics.median(values), "runs": values} for name, values in speeds.items()}


def _candidate(key: str) -> Candidate:
    data = json.loads(key)
    return Candidate(MemoryPlan.model_validate(data["memory"]), data["precision"])


def compare(rows: list[dict], report: dict, cap: int, precision: str) -> dict:
    limit = Cap(cap, MARGIN).limit
    feasible = [r for r in rows if r["status"] == "ok" and r["peak"] <= limit]
    trials = {t["number"]: t for t in report["trials"]}
    # the plan one writes by hand: checkpoint every block, then lower the micro-batch until it fits
    full = max((r for r in feasible if r["checkpointing"] == "full" and r["precision"] == precision),
               key=lambda r: r["micro_batch"], default=None)
    return {
        "cap": cap, "grid_probes": len(rows), "feasible_in_grid": len(feasible),
        "tuner_probes": report["probes"],
        "grid_best": max(feasible, key=lambda r: r["speed"]),
        "winner": trials[report["winner"]] if report["winner"] is not None else None,
        "solver": next((t for t in report["trials"] if t.get("proposed_by") == "solver"), None),
        "full": full,
    }


def markdown(results: dict[str, dict], run: dict) -> str:
    lines = [
        "## `ckrun tune` vs an exhaustive grid (CPU)", "",
        f"`python bench/tune_vs_grid.py` on {run['started']}: {platform.machine()}, {os.cpu_count()} cores shared "
        f"with other jobs (load average {run['load']:.1f} at the end), single-threaded probes of {SETTINGS.warmup_steps} warm-up + {SETTINGS.timed_steps} timed "
        f"steps, {run['minutes']:.0f} min in all. Cap: its limit (cap minus the {MARGIN:.0%} margin) halfway between "
        f"the grid's smallest peak and the no-plan peak. Samples/s: the median of {CONFIRM} interleaved "
        f"re-measurements of each plan (the runs in brackets); a plan is chosen by the grid's or the tuner's own "
        f"single measurement.", "",
        "| model | grid probes | tuner probes | feasible | grid-best plan | tuner's plan | tuner / best | "
        f"<= 1/{SHARE} probes | >= 0.98 | solver's first plan | solver first / best "
        "| full checkpointing, largest micro-batch that fits | tuned / full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in results.items():
        best, won, again = c["grid_best"], c["winner"], c["confirmed"]
        same = won["key"] == best["key"]  # then the two series differ only by noise: the ratio is 1
        ratio = 1.0 if same else again["tuner"]["median"] / again["grid best"]["median"]
        full = c["full"]
        if full is None:
            full_text, vs_full = "no micro-batch fits", "n/a"
        else:
            full_text = f"{full['label']}: {_speeds(again['full'])}"
            vs_full = "same plan" if won["key"] == full["key"] else \
                f"{again['tuner']['median'] / again['full']['median']:.2f}x"
        lines.append(
            f"| {name} (cap {format_bytes(c['cap'])}) | {c['grid_probes']} | {c['tuner_probes']} "
            f"| {c['feasible_in_grid']} | {best['label']}: {_speeds(again['grid best'])} "
            f"| {'the same plan' if same else won['label']}: {_speeds(again['tuner'])} | {ratio:.2f} "
            f"| {'yes' if SHARE * c['tuner_probes'] <= c['grid_probes'] else 'no'} | {'yes' if ratio >= 0.98 else 'no'} "
            f"| {_solver_text(c, again)} | {full_text} | {vs_full} |")
    lines += ["", *(f"- {name}: `{CASES[name][0].relative_to(ROOT)}` {' '.join(CASES[name][1] + CASES[name][2])}"
                    for name in results)]
    lines += ["", "Caveat: on a shared 2-core machine the same plan measures differently from run to run (the "
              "runs in brackets show how much), so the grid's best is the best of single noisy measurements and "
              "a ratio near 1 is within the noise either way.", ""]
    return "\n".join(lines)


def _solver_text(case: dict, again: dict) -> str:
    """The solver's first plan and its throughput over the grid's best (re-measured medians)."""
    solver = case.get("solver")
    if solver is None or "solver first" not in again:
        return "none proposed | n/a"
    ratio = again["solver first"]["median"] / again["grid best"]["median"]
    return f"{solver['label']}: {_speeds(again['solver first'])} | {ratio:.2f}"


def _speeds(confirmed: dict) -> str:
    return f"{confirmed['median']:.2f}/s (runs {', '.join(f'{v:.2f}' for v in confirmed['runs'])})"


def measure_case(name: str, out: Path, quick: bool = False) -> dict:
    path, overrides, flags = CASES[name]
    overrides = overrides + (QUICK[name] if quick else [])
    recipe = load_recipe(path, overrides)
    shutil.rmtree(out / name, ignore_errors=True)  # a study directory must be new without --resume
    rows = run_grid(path, overrides, flags, out / name / "grid")
    (out / name / "grid.json").write_text(json.dumps(rows, indent=1))
    cap = choose_cap(rows, recipe.train.batch_size, recipe.precision)
    report = run_tuner(path, overrides, flags, out / name / "tune", cap, len(rows) // SHARE)
    result = compare(rows, report, cap, recipe.precision)
    if result["winner"] is None:
        raise SystemExit(f"{name}: the tuner found no plan under {cap} bytes; see {out / name / 'tune'}")
    plans = {"tuner": result["winner"]["key"], "grid best": result["grid_best"]["key"]}
    if result["full"] is not None:
        plans["full"] = result["full"]["key"]
    if result["solver"] is not None:
        plans["solver first"] = result["solver"]["key"]
    result["confirmed"] = confirm(path, overrides, out / name / "confirm", plans)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench_tune")
    parser.add_argument("--report-only", action="store_true", help="rewrite the markdown from OUT/*/results.json")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, 1 warm-up + 1 timed step, one re-run: a smoke run whose numbers mean "
                             "nothing; the markdown goes to OUT, not docs/")
    args = parser.parse_args()
    global SETTINGS, CONFIRM
    if args.quick:
        SETTINGS, CONFIRM = ProbeSettings(warmup_steps=1, timed_steps=1), 1
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every probe child
    if not args.report_only:
        started, clock = time.strftime("%Y-%m-%d %H:%M %Z"), time.monotonic()
        for name in args.cases:
            (args.out / name / "results.json").write_text(json.dumps(measure_case(name, args.out, args.quick), indent=1))
        run = {"started": started, "minutes": (time.monotonic() - clock) / 60, "load": os.getloadavg()[0]}
        (args.out / "run.json").write_text(json.dumps(run))
    results = {path.parent.name: json.loads(path.read_text()) for path in sorted(args.out.glob("*/results.json"))}
    text = markdown(results, json.loads((args.out / "run.json").read_text()))
    (args.out / "benchmarks_tune.md" if args.quick else ROOT / "docs/benchmarks_tune.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
