"""Call 3 of the GPU campaign: `ckrun tune` on BERT-large under 40 GB, then its plan against the others.

    python bench/gpu/tune.py OUT_DIR [--dry-run] [--time-budget 3m] [--max-mem 40GB] [--repeats 2]

First `ckrun tune recipes/bert_large.yaml --max-mem 40GB --no-train` runs as a subprocess with a
hard time limit, its study in a directory under /tmp (hundreds of probe files: too many to bring
back); report.json and tuned.yaml are copied to OUT_DIR as tune_report.json and tuned.yaml.
Then the tuned plan, full checkpointing of the whole batch in one pass (what HF's
`gradient_checkpointing_enable()` does) and the uncapped candidates (none at micro-batch 64 and
32, every 2 at 64) are measured with the tuner's own probe (a fresh subprocess each), interleaved
so that drift hits all alike, `--repeats` times. OUT_DIR/tune.json, rewritten after every probe,
has the medians and the two ratios the issue sets goals for: tuned / fastest uncapped >= 0.97 and
tuned / full checkpointing >= 1.25, and the tuned plan's measured peak (reserve + CUDA context)
against the cap.

Time on an H100 (torch 2.11): a BERT-large probe takes ~20 s (imports, building the model, 5 steps);
the tuner needs ~40 s to start and ~80 s for its finalists after the budget, the ten comparison
probes ~200 s. So the default budget is 3m: about 9 minutes in all, inside a call's 10.

`--dry-run`: the tiny bert_tiny on the CPU under 100MB, a 20 s budget, 4 trials, one round of probes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is no installed package: `python bench/gpu/tune.py` must find it too
    sys.path.insert(0, str(REPO))

from pydantic import ByteSize, TypeAdapter  # noqa: E402

from autotune.cli_tune import parse_duration  # noqa: E402
from autotune.probe import ProbeRunner, ProbeSettings  # noqa: E402
from bench.gpu import tables  # noqa: E402
from bench.gpu.facts import versions  # noqa: E402
from bench.gpu.plans import TINY, write_json  # noqa: E402
from runner.load import load_recipe  # noqa: E402

FASTEST_GOAL = 0.97  # tuned / fastest uncapped plan: the cap should cost at most 3%
FULL_GOAL = 1.25  # tuned / full checkpointing in one pass: what tuning buys over the usual default


@dataclass(frozen=True)
class Setup:
    recipe: str
    base: tuple[str, ...]
    tune_flags: tuple[str, ...]  # `ckrun tune` options beyond cap and budget
    warmup_steps: int  # per comparison probe, as the tuner's defaults
    timed_steps: int
    probe_timeout_s: float


GPU = Setup("recipes/bert_large.yaml", ("train.device=cuda",), (), 2, 3, 300.0)
DRY_RUN = Setup("recipes/bert_tiny.yaml", (*TINY, "train.device=cpu"),
                ("--finalists", "0", "--warmup-steps", "1", "--timed-steps", "1"), 1, 1, 120.0)


# --- the tuner ------------------------------------------------------------------------------------


def run_tuner(setup: Setup, args, study: Path, out: Path) -> dict:
    """`ckrun tune ... --no-train` in its own process group, killed at the hard limit; its log goes to OUT."""
    command = [sys.executable, "-m", "runner", "tune", setup.recipe, *setup.base, "--max-mem", args.max_mem,
               "--time-budget", args.time_budget, "--no-train", "--output", str(study), *setup.tune_flags,
               *(["--trials", str(args.trials)] if args.trials else [])]
    limit = args.tune_timeout or parse_duration(args.time_budget) * 1.2 + 150  # finalists are measured after it
    print(f"tune: {' '.join(command[1:])} (hard limit {limit:.0f} s)", flush=True)
    started = time.monotonic()
    with open(out / "tune.log", "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=REPO, start_new_session=True)
        try:
            code, timed_out = process.wait(timeout=limit), False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its probes watch it and take their own groups down
            code, timed_out = process.wait(), True
    log_text = (out / "tune.log").read_text(encoding="utf-8", errors="replace")
    return {"command": command[1:], "exit_code": code, "timed_out": timed_out, "limit_s": limit,
            "seconds": round(time.monotonic() - started, 1), "log_tail": log_text[-3000:]}


def collect(study: Path, out: Path, run: dict) -> dict | None:
    """Copies the study's small results to OUT; returns report.json (None when the tuner wrote none)."""
    for name, target in (("report.json", "tune_report.json"), ("tuned.yaml", "tuned.yaml")):
        if (study / name).exists():
            shutil.copyfile(study / name, out / target)
    if not (study / "report.json").exists():
        return None
    report = json.loads((study / "report.json").read_text(encoding="utf-8"))
    run["trials"] = len(report.get("trials", []))
    run["winner"] = report.get("winner")
    return report


# --- the candidates -------------------------------------------------------------------------------


def tuned_candidate(setup: Setup, args, study: Path, report: dict | None) -> dict | None:
    """The tuned plan: tuned.yaml as written, else report.json's winner (tuned.yaml comes after the
    report and its plot: a failure in between must not lose the winner)."""
    if (study / "tuned.yaml").exists():
        recipe, source = load_recipe(study / "tuned.yaml"), "tuned.yaml"
    elif report and report.get("winner") is not None:
        winner = next(t for t in report["trials"] if t["number"] == report["winner"])
        memory = {k: v for k, v in winner["plan"].items() if v is not None} | {"max_mem": args.max_mem}
        overrides = [*setup.base, f"memory={json.dumps(memory)}", f"precision={winner['precision']}"]
        recipe, source = load_recipe(REPO / setup.recipe, overrides), "report.json's winner (no tuned.yaml)"
    else:
        return None
    return {"name": "tuned", "role": "tuned", "source": source, "recipe": recipe}


def other_candidates(setup: Setup) -> list[dict]:
    batch = load_recipe(REPO / setup.recipe, list(setup.base)).train.batch_size
    plain = ["memory.offload={policy: none}", "memory.max_mem=null"]
    wanted = [("full checkpointing, one pass", "full_checkpointing", None, "{policy: full}"),
              (f"none @ {batch}", "uncapped", None, "{policy: none}"),
              (f"none @ {batch // 2}", "uncapped", batch // 2, "{policy: none}"),
              (f"every 2 @ {batch}", "uncapped", None, "{policy: every, every: 2}")]
    return [{"name": name, "role": role, "source": "overrides",
             "recipe": load_recipe(REPO / setup.recipe, [*setup.base, f"memory.micro_batch={micro or 'null'}",
                                                         f"memory.checkpointing={checkpointing}", *plain])}
            for name, role, micro, checkpointing in wanted]


RUN_KEYS = ("status", "samples_per_s", "step_time_s", "card_peak_bytes", "peak_mem_bytes", "peak_allocated_bytes",
            "cuda_context_bytes", "probe_s", "reason", "device")


def measure_all(candidates: list[dict], setup: Setup, args, work: Path, results: dict, out: Path) -> None:
    """Every candidate once per round, in the same order each round; tune.json after every probe."""
    runner = ProbeRunner(work, ProbeSettings(setup.probe_timeout_s, setup.warmup_steps, setup.timed_steps))
    for round_number in range(args.repeats):
        for index, candidate in enumerate(candidates):
            result = runner.probe(candidate["recipe"], round_number * len(candidates) + index)
            candidate["runs"].append({k: result[k] for k in RUN_KEYS if k in result})
            print(f"{candidate['name']} (round {round_number + 1}): {result.get('status')} "
                  f"{result.get('samples_per_s') or result.get('reason')}", flush=True)
            conclude(results, candidates)
            write_json(out / "tune.json", results)


def as_json(candidate: dict) -> dict:
    recipe = candidate["recipe"]
    memory = recipe.memory.model_dump(mode="json")
    label = tables.plan_label({**memory, "micro_batch": recipe.micro_batch})  # `null` and the batch size alike
    return {"name": candidate["name"], "role": candidate["role"], "source": candidate["source"],
            "label": label, "memory": memory, "runs": candidate["runs"]}


# --- the verdict ----------------------------------------------------------------------------------


def conclude(results: dict, candidates: list[dict]) -> None:
    results["candidates"] = [as_json(c) for c in candidates]
    for candidate in results["candidates"]:
        ok = [r for r in candidate["runs"] if r.get("status") == "ok"]
        candidate["median_samples_per_s"] = statistics.median(r["samples_per_s"] for r in ok) if ok else None
        peaks = [r["card_peak_bytes"] for r in candidate["runs"] if r.get("card_peak_bytes") is not None]
        candidate["max_card_peak_bytes"] = max(peaks, default=None)
    by_role = lambda role: [c for c in results["candidates"] if c["role"] == role  # noqa: E731
                            and c["median_samples_per_s"] is not None]
    tuned, full, uncapped = by_role("tuned"), by_role("full_checkpointing"), by_role("uncapped")
    fastest = max(uncapped, key=lambda c: c["median_samples_per_s"], default=None)
    speed = lambda c: c[0]["median_samples_per_s"] if c else None  # noqa: E731
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    results["ratios"] = {
        "tuned_vs_fastest_unconstrained": ratio(speed(tuned), fastest and fastest["median_samples_per_s"]),
        "fastest_unconstrained": fastest and fastest["name"], "fastest_goal": FASTEST_GOAL,
        "tuned_vs_full_checkpointing": ratio(speed(tuned), speed(full)), "full_goal": FULL_GOAL}
    peak = next((c["max_card_peak_bytes"] for c in results["candidates"] if c["role"] == "tuned"), None)
    results["tuned_peak"] = {"card_peak_bytes": peak, "cap_bytes": results["cap_bytes"],
                             "within_cap": None if peak is None else peak <= results["cap_bytes"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="bert_tiny on the CPU, 100MB, 20 s, 4 trials")
    parser.add_argument("--time-budget", help="the tuner's --time-budget (default 3m; dry run 20s)")
    parser.add_argument("--max-mem", help="the cap (default 40GB; dry run 100MB)")
    parser.add_argument("--trials", type=int, help="the tuner's --trials (default its own, 20; dry run 4)")
    parser.add_argument("--tune-timeout", type=float, help="hard limit of the tuner in seconds "
                                                           "(default: 1.2x the budget + 150 s)")
    parser.add_argument("--repeats", type=int, help="measurements of each candidate (default 2; dry run 1)")
    args = parser.parse_args(argv)
    setup = DRY_RUN if args.dry_run else GPU
    args.time_budget = args.time_budget or ("20s" if args.dry_run else "3m")
    args.max_mem = args.max_mem or ("100MB" if args.dry_run else "40GB")
    args.trials = args.trials or (4 if args.dry_run else None)
    args.repeats = args.repeats or (1 if args.dry_run else 2)  # a CPU probe is mostly imports: one round will do
    args.out.mkdir(parents=True, exist_ok=True)
    # the probes' children import runner and autotune from this checkout, wherever they start
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    work = Path(tempfile.mkdtemp(prefix="ckrun-gpu-tune-"))
    results = {"versions": versions(), "dry_run": args.dry_run, "recipe": setup.recipe, "cap_text": args.max_mem,
               "cap_bytes": int(TypeAdapter(ByteSize).validate_python(args.max_mem)),
               "time_budget": args.time_budget, "candidates": []}
    try:
        compare(setup, args, work, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the studies' probe files: what matters is in OUT_DIR
    print("\n" + tables.tune_table(results))
    return 0


def compare(setup: Setup, args, work: Path, results: dict) -> None:
    results["tune"] = run_tuner(setup, args, work / "tune", args.out)
    report = collect(work / "tune", args.out, results["tune"])
    tuned = tuned_candidate(setup, args, work / "tune", report)
    candidates = [c | {"runs": []} for c in ([tuned] if tuned else []) + other_candidates(setup)]
    conclude(results, candidates)
    results["tune"]["tuned_label"] = results["candidates"][0]["label"] if tuned else "none: the tuner found no plan"
    write_json(args.out / "tune.json", results)
    measure_all(candidates, setup, args, work / "compare", results, args.out)


if __name__ == "__main__":
    sys.exit(main())
