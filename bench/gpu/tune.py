"""Step 4 of the GPU campaign: `ckrun tune` on BERT-large under 40 GB, then the tuned plan against
what it is judged by.

    python bench/gpu/tune.py OUT_DIR [--dry-run] [--budget-s 160] [--plans OUT_DIR/plans.json ...] [--max-mem 40GB]

1. `ckrun tune recipes/bert_large.yaml --max-mem 40GB --no-train` (compile not searched: `GPU`), in
   its own process group, killed at its share of the budget; `ckrun report` then writes the study's
   report.json if the tuner could not.
2. The reference P1 is held to, the fastest plan with no cap: where the budget holds a second search
   (`both_searches_s`: a call of its own), the same search with the card's memory as the cap; else
   the fastest eager plan the plans step measured in this call (`--plans`), measured again here as
   the others are. tune.json says which.
3. The tuned plan, that reference, HF's own `gradient_checkpointing_enable()` in a plain HF loop
   (hf_loop.py) at the same batch and precision, and ckrun's full checkpointing of the whole batch in
   one pass, each in a fresh process, interleaved so that drift hits all alike, as many rounds (up to
   --repeats) as the budget leaves. OUT_DIR/tune.json is rewritten after every measurement.

Figures (figures.py): P1 tuned / fastest uncapped >= 0.97; P2 tuned / HF full checkpointing >= 1.25;
P5 the 40 GB tune's wall time <= 10 minutes; the tuned plan's peak under the cap, using >= 90% of it.
Studies go to a directory under /tmp (hundreds of probe files); each study's report.json, tuned.yaml
and the tail of its log are kept inside tune.json (a call brings back at most 8 files).
`--dry-run`: bert_tiny on the CPU under 100MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
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

from ckrun.autotune.probes.probe import ProbeRunner, ProbeSettings  # noqa: E402
from ckrun.autotune.probes.warm import WarmServer, preload_for  # noqa: E402
from bench.gpu import tables, tune_verdict  # noqa: E402
from bench.gpu.budget import Budget, write_json  # noqa: E402
from bench.gpu.facts import versions  # noqa: E402
from bench.gpu.plans import TINY  # noqa: E402
from ckrun.runner.recipe.load import load_recipe  # noqa: E402


@dataclass(frozen=True)
class Setup:
    recipe: str
    base: tuple[str, ...]
    tune_flags: tuple[str, ...]  # `ckrun tune` options beyond cap and budget, the same for both searches
    warmup_steps: int  # per comparison probe, as the tuner's defaults
    timed_steps: int
    probe_s: float  # what one comparison probe usually takes: a round starts only with this left per candidate
    budget_s: float
    search_share: float  # of the budget, for the capped search; the rest compares (and, given room, searches again)
    both_searches_s: float | None  # a budget of at least this holds the uncapped search too; None: never
    cap: str
    uncapped_on_cpu: str  # a CPU has no card to take the cap from


# H100, BERT-large (2026-11-22): a 60-second `ckrun tune --max-mem 40GB` probed several plans; a fresh probe
# process (torch and transformers imported, the model built, 5 steps) takes about 25 s
# Compile is not searched: a cold compile (1-2 minutes) would take the short search's whole share and could not
# be measured again in a comparison probe; the plans step measures compile where its budget leaves time.
GPU = Setup("recipes/bert_large.yaml", ("train.device=cuda",), ("--finalists", "1", "--probe-timeout", "90"),
            2, 3, 25, 160, 0.45, 420, "40GB", "")
# the dry run checks the script, not the search: no model child (--no-screen), one plan per search
DRY_RUN = Setup("recipes/bert_tiny.yaml", (*TINY, "train.device=cpu"),
                ("--finalists", "0", "--warmup-steps", "1", "--timed-steps", "1", "--trials", "1", "--no-screen"),
                1, 1, 60, 900, 0.3, None, "100MB", "100GB")
LIVE: set[subprocess.Popen] = set()  # the searches and HF loops running, each its own group: the watchdog kills them
SLACK_S = 20  # the tuner's imports before its own clock starts, and its first probe, which may end past the budget
LOG_TAIL = 2000  # characters of a search's log kept in tune.json
REPORT_S = 20  # `ckrun report` after a search was killed


# --- the searches ---------------------------------------------------------------------------------


def run_tuner(setup: Setup, cap: str, limit_s: float, study: Path, log_path: Path) -> dict:
    """`ckrun tune ... --no-train` in its own process group, killed at `limit_s`."""
    budget = f"{max(10, int(limit_s - SLACK_S))}s"
    command = [sys.executable, "-m", "ckrun", "tune", setup.recipe, *setup.base, "--max-mem", cap,
               "--time-budget", budget, "--no-train", "--output", str(study), *setup.tune_flags]
    print(f"tune: {' '.join(command[1:])} (hard limit {limit_s:.0f} s)", flush=True)
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        code = bounded(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        cwd=REPO, start_new_session=True), limit_s)
    found = {"command": command[1:], "cap": cap, "exit_code": code, "timed_out": code is None,
             "limit_s": round(limit_s), "seconds": round(time.monotonic() - started, 1)}
    if not (study / "report.json").exists() and (study / "study.journal").exists():
        # killed before it wrote its report: `ckrun report` writes it from the study's journal
        try:
            subprocess.run([sys.executable, "-m", "ckrun", "report", str(study)], cwd=REPO, capture_output=True,
                           timeout=REPORT_S)
        except subprocess.TimeoutExpired:
            found["report_note"] = f"`ckrun report` did not finish in {REPORT_S} s"
    return found


def bounded(process: subprocess.Popen, limit_s: float) -> int | None:
    """The exit status of a child in its own group, or None where it was killed (its whole group) at
    `limit_s`; the watchdog can kill it too while it runs."""
    LIVE.add(process)
    try:
        return process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        kill_group(process)  # a search's probes watch it and take their own groups down
        process.wait()
        return None
    finally:
        LIVE.discard(process)


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def collect(study: Path, log_path: Path, run: dict) -> dict | None:
    """Puts the study's report.json, tuned.yaml and the tail of its log into `run` (they travel inside
    tune.json: a call brings back at most 8 files); returns the report (None when there is none)."""
    log = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    run["log_tail"] = log[-LOG_TAIL:]
    if (study / "tuned.yaml").exists():
        run["tuned_yaml"] = (study / "tuned.yaml").read_text(encoding="utf-8")
    if not (study / "report.json").exists():
        return None
    report = json.loads((study / "report.json").read_text(encoding="utf-8"))
    run["report"] = report
    run["trials"] = len(report.get("trials", []))
    run["winner"] = report.get("winner")
    return report


def winner_candidate(setup: Setup, study: Path, report: dict | None, cap: str, name: str, role: str) -> dict | None:
    """A search's plan: tuned.yaml as written, else report.json's winner (tuned.yaml comes after the
    report and its plot: a failure in between must not lose the winner)."""
    if (study / "tuned.yaml").exists():
        recipe, source = load_recipe(study / "tuned.yaml"), "tuned.yaml"
    elif report and report.get("winner") is not None:
        winner = next(t for t in report["trials"] if t["number"] == report["winner"])
        memory = {k: v for k, v in winner["plan"].items() if v is not None} | {"max_mem": cap}
        overrides = [*setup.base, f"memory={json.dumps(memory)}", f"precision={winner['precision']}"]
        recipe, source = load_recipe(REPO / setup.recipe, overrides), "report.json's winner (no tuned.yaml)"
    else:
        return None
    measured = next((t.get("samples_per_s") for t in (report or {}).get("trials", [])
                     if t.get("number") == (report or {}).get("winner")), None)
    return {"name": name, "role": role, "source": source, "recipe": recipe, "search_samples_per_s": measured}


def full_checkpointing(setup: Setup) -> dict:
    overrides = [*setup.base, "memory.micro_batch=null", "memory.checkpointing={policy: full}",
                 "memory.offload={policy: none}", "memory.max_mem=null"]
    return {"name": "full checkpointing, one pass", "role": "full_checkpointing", "source": "overrides",
            "recipe": load_recipe(REPO / setup.recipe, overrides)}


def hf_candidate(setup: Setup) -> dict:
    return {"name": "HF gradient_checkpointing_enable()", "role": "hf_full_checkpointing", "source": "hf_loop.py",
            "recipe": load_recipe(REPO / setup.recipe, list(setup.base))}


def fastest_measured(paths: list[Path] | None) -> dict | None:
    """The fastest eager plan the plans step measured (compiled ones aside: a cold compile would not
    fit a comparison probe), from the first of `paths` that exists (this call's plans.json, else the
    last call's kept on this machine), as the uncapped reference where no uncapped search fits."""
    plans_path = next((path for path in paths or [] if path.exists()), None)
    if plans_path is None:
        return None
    plans = json.loads(plans_path.read_text(encoding="utf-8"))
    measured = [p for p in plans.get("plans", []) if p.get("status") == "ok" and p.get("samples_per_s")
                and p["name"] != "compile"]
    if not measured:
        return None
    best = max(measured, key=lambda p: p["samples_per_s"])
    recipe = load_recipe(REPO / plans["recipe"], [*best["overrides"], "memory.max_mem=null"])
    return {"name": "fastest uncapped", "role": "uncapped", "recipe": recipe,
            "source": f"the plans step's fastest eager plan ({best['key']}, {best['samples_per_s']:.1f} samples/s "
                      f"there, {plans_path}): no budget for an uncapped search"}


# --- measuring ------------------------------------------------------------------------------------


RUN_KEYS = ("status", "samples_per_s", "step_time_s", "card_peak_bytes", "peak_mem_bytes", "peak_allocated_bytes",
            "cuda_context_bytes", "probe_s", "reason", "device", "other_gpu_processes")


def measure(candidate: dict, setup: Setup, work: Path, number: int, limit_s: float,
            warm: WarmServer | None = None) -> dict:
    if candidate["role"] == "hf_full_checkpointing":
        return measure_hf(setup, work, number, limit_s)
    probe_runner = ProbeRunner(work, ProbeSettings(limit_s, setup.warmup_steps, setup.timed_steps, compile_timeout_s=limit_s),
                               warm)
    # a row of tune.json, as hf_loop.py's result is: the fields the probe set
    return probe_runner.probe(candidate["recipe"], number).model_dump(mode="json", exclude_defaults=True)


def measure_hf(setup: Setup, work: Path, number: int, limit_s: float) -> dict:
    """hf_loop.py in its own process group, as a probe runs; killed at `limit_s`."""
    result = work / f"hf-{number}.json"
    command = [sys.executable, str(REPO / "bench" / "gpu" / "hf_loop.py"), str(result), setup.recipe, *setup.base,
               "--warmup", str(setup.warmup_steps), "--timed", str(setup.timed_steps)]
    started = time.monotonic()
    with open(work / f"hf-{number}.log", "w", encoding="utf-8") as log:
        code = bounded(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                        start_new_session=True), limit_s)
    if code is None:
        return {"status": "timeout", "reason": f"timed out after {limit_s:.0f} s"}
    found = json.loads(result.read_text()) if result.exists() else \
        {"status": "died", "reason": f"exit {code}; see {work / f'hf-{number}.log'}"}
    return {**found, "probe_s": round(time.monotonic() - started, 2)}


def warm_probes(setup: Setup, work: Path, dry_run: bool) -> WarmServer | None:
    """The dry run's comparison probes fork from one process that has imported torch and the model, as a CPU
    tune's probes do (autotune/probes/warm.py: a toy's probe is mostly its imports); on a GPU each starts cold."""
    if not dry_run:
        return None
    server = WarmServer(work, preload_for(load_recipe(REPO / setup.recipe, list(setup.base)).model))
    server.start()
    return server


def measure_all(candidates: list[dict], setup: Setup, args, work: Path, results: dict, budget: Budget) -> None:
    """Every candidate once per round, in the same order each round, while the budget lasts."""
    work.mkdir(parents=True, exist_ok=True)
    warm = warm_probes(setup, work, args.dry_run)
    try:
        measure_rounds(candidates, setup, args, work, results, budget, warm)
    finally:
        if warm is not None:
            warm.stop()


def measure_rounds(candidates: list[dict], setup: Setup, args, work: Path, results: dict, budget: Budget,
                   warm: WarmServer | None) -> None:
    number = 0
    for round_number in range(args.repeats):
        if not budget.allows(setup.probe_s * len(candidates)) and round_number > 0:
            results["rounds_note"] = f"{round_number} round(s): the budget had no room for another"
            break
        for candidate in candidates:
            if not budget.allows(setup.probe_s):
                candidate["runs"].append({"status": "skipped", "reason": "the call's budget ran out"})
                continue
            result = measure(candidate, setup, work, number, budget.limit(4 * setup.probe_s, keep=5), warm)
            number += 1
            candidate["runs"].append({k: result[k] for k in RUN_KEYS if k in result})
            print(f"{candidate['name']} (round {round_number + 1}): {result.get('status')} "
                  f"{result.get('samples_per_s') or result.get('reason')}", flush=True)
            tune_verdict.conclude(results, candidates)
            write_json(args.out / "tune.json", results)


# --- the call -------------------------------------------------------------------------------------


def card_cap(setup: Setup, work: Path, dry_run: bool) -> str:
    """The uncapped search's cap: the card's whole memory (as the device child reads it; this process
    never starts CUDA, so that nothing of it sits beside the probes)."""
    if dry_run:
        return setup.uncapped_on_cpu
    device = ProbeRunner(work, ProbeSettings()).device(load_recipe(REPO / setup.recipe, list(setup.base)), 120)
    return str(device.get("total_bytes") or setup.uncapped_on_cpu or "80GB")


def search(setup: Setup, args, work: Path, results: dict, cap: str, role: str, limit_s: float) -> dict | None:
    """One `ckrun tune` under `cap`, recorded in results; its winner as a candidate (None: none)."""
    study, log_path = work / f"study-{role}", work / f"{role}-search.log"
    run = run_tuner(setup, cap, limit_s, study, log_path)
    results["tune" if role == "tuned" else "uncapped_tune"] = run
    report = collect(study, log_path, run)
    write_json(args.out / "tune.json", results)
    return winner_candidate(setup, study, report, cap, "tuned" if role == "tuned" else "fastest uncapped", role)


def compare(setup: Setup, args, work: Path, results: dict, budget: Budget) -> None:
    total = budget.left()
    both = setup.both_searches_s is not None and total >= setup.both_searches_s
    tuned = search(setup, args, work, results, args.max_mem, "tuned",
                   budget.limit(setup.search_share * total, keep=3 * setup.probe_s))
    if both:
        uncapped = search(setup, args, work, results, card_cap(setup, work, args.dry_run), "uncapped",
                          budget.limit(setup.search_share * total * 0.6, keep=3 * setup.probe_s))
    else:
        uncapped = fastest_measured(args.plans)
        results["uncapped_reference"] = uncapped["source"] if uncapped else \
            "none: no budget for an uncapped search and no measured plan (--plans)"
    # in the order the figures need them, should the budget end a round early: P1, P2, then ckrun's own full
    candidates = [c | {"runs": []} for c in [tuned, uncapped, hf_candidate(setup), full_checkpointing(setup)] if c]
    tune_verdict.conclude(results, candidates)
    write_json(args.out / "tune.json", results)
    measure_all(candidates, setup, args, work / "compare", results, budget)


def at_deadline(out: Path, results: dict, budget: Budget) -> None:
    """The watchdog's: the running search or HF loop killed with its group (a comparison probe watches
    this process and goes with it), what was measured written."""
    for process in list(LIVE):
        kill_group(process)
    write_json(out / "tune.json", {**results, "budget": {
        **budget.record(), "stopped": "at the deadline, in the middle of a search or a measurement"}})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="bert_tiny on the CPU under 100MB")
    parser.add_argument("--budget-s", type=float, help=f"this step's seconds (default {GPU.budget_s:g})")
    parser.add_argument("--plans", type=Path, action="append", help="the plans step's plans.json: the uncapped "
                        "reference where no uncapped search fits (several: the first that exists)")
    parser.add_argument("--max-mem", help="the cap (default 40GB; dry run 100MB)")
    parser.add_argument("--repeats", type=int, help="measurements of each candidate (default 2; dry run 1)")
    args = parser.parse_args(argv)
    setup = DRY_RUN if args.dry_run else GPU
    budget = Budget(args.budget_s or setup.budget_s)
    args.max_mem = args.max_mem or setup.cap
    args.repeats = args.repeats or (1 if args.dry_run else 2)
    args.out.mkdir(parents=True, exist_ok=True)
    # the probes' children import runner and autotune from this checkout, wherever they start
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    work = Path(tempfile.mkdtemp(prefix="ckrun-gpu-tune-"))
    results = {"versions": versions(), "dry_run": args.dry_run, "recipe": setup.recipe, "cap_text": args.max_mem,
               "cap_bytes": int(TypeAdapter(ByteSize).validate_python(args.max_mem)), "candidates": []}
    watchdog = budget.arm(lambda: at_deadline(args.out, results, budget))
    try:
        compare(setup, args, work, results, budget)
        watchdog.set()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the studies' probe files: what matters is in tune.json
        results["budget"] = budget.record()
        write_json(args.out / "tune.json", results)
    print("\n" + tables.tune_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
