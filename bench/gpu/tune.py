"""Call 3 of the GPU campaign (8 minutes): `ckrun tune` on BERT-large under 40 GB and without a cap,
then the tuned plan against what it is judged by.

    python bench/gpu/tune.py OUT_DIR [--dry-run] [--budget-s 460] [--max-mem 40GB] [--repeats 2]

1. The device, in a child (the card's memory: the "no cap" search's cap).
2. `ckrun tune recipes/bert_large.yaml --max-mem 40GB --search-compile --no-train` (compile searched;
   its probes share inductor's disk cache), in its own process group, killed at its share of the
   budget; `ckrun report` then writes the study's report.json if the tuner could not.
3. The same search with the card's own memory as the cap: the fastest plan with no cap that the
   same search finds (not hand-picked plans).
4. The tuned plan, that fastest uncapped plan, HF's own `gradient_checkpointing_enable()` in a plain
   HF loop (hf_loop.py) at the same batch and precision, and ckrun's full checkpointing of the whole
   batch in one pass, each in a fresh process, interleaved so that drift hits all alike, as many rounds
   (up to --repeats) as the budget leaves. OUT_DIR/tune.json is rewritten after every measurement.

Figures (tables.py): P1 tuned / fastest uncapped >= 0.97; P2 tuned / HF full checkpointing >= 1.25;
P5 the 40 GB tune's wall time <= 10 minutes; the tuned plan's peak under the cap, using >= 90% of it.
Studies go to a directory under /tmp (hundreds of probe files: too many to bring back); their
report.json and tuned.yaml are copied to OUT_DIR. `--dry-run`: bert_tiny on the CPU under 100MB.
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

from autotune.probe import ProbeRunner, ProbeSettings  # noqa: E402
from bench.gpu import tables, tune_verdict  # noqa: E402
from bench.gpu.budget import Budget  # noqa: E402
from bench.gpu.facts import versions  # noqa: E402
from bench.gpu.plans import TINY, write_json  # noqa: E402
from runner.load import load_recipe  # noqa: E402


@dataclass(frozen=True)
class Setup:
    recipe: str
    base: tuple[str, ...]
    tune_flags: tuple[str, ...]  # `ckrun tune` options beyond cap and budget, the same for both searches
    warmup_steps: int  # per comparison probe, as the tuner's defaults
    timed_steps: int
    probe_s: float  # what one comparison probe usually takes: a round starts only with this left per candidate
    budget_s: float
    shares: tuple[float, float]  # of the budget: the capped search, the uncapped one; the rest compares
    cap: str
    uncapped_on_cpu: str  # a CPU has no card to take the cap from


GPU = Setup("recipes/bert_large.yaml", ("train.device=cuda",),
            ("--search-compile", "--finalists", "1", "--probe-timeout", "150"), 2, 3, 35, 460, (0.40, 0.24),
            "40GB", "")
# the dry run checks the script, not the search: no model child (--no-screen), one plan per search
DRY_RUN = Setup("recipes/bert_tiny.yaml", (*TINY, "train.device=cpu"),
                ("--search-compile", "--finalists", "0", "--warmup-steps", "1", "--timed-steps", "1", "--trials", "1",
                 "--no-screen"), 1, 1, 8, 240, (0.35, 0.3), "100MB", "100GB")
STARTUP_S = 45  # the tuner's own start before its budget counts: the device child, the model child, the solver


# --- the searches ---------------------------------------------------------------------------------


def run_tuner(setup: Setup, cap: str, limit_s: float, study: Path, log_path: Path) -> dict:
    """`ckrun tune ... --no-train` in its own process group, killed at `limit_s`."""
    budget = f"{max(10, int(limit_s - STARTUP_S))}s"
    command = [sys.executable, "-m", "runner", "tune", setup.recipe, *setup.base, "--max-mem", cap,
               "--time-budget", budget, "--no-train", "--output", str(study), *setup.tune_flags]
    print(f"tune: {' '.join(command[1:])} (hard limit {limit_s:.0f} s)", flush=True)
    started = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=REPO, start_new_session=True)
        try:
            code, timed_out = process.wait(timeout=limit_s), False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its probes watch it and take their own groups down
            code, timed_out = process.wait(), True
    found = {"command": command[1:], "cap": cap, "exit_code": code, "timed_out": timed_out, "limit_s": round(limit_s),
             "seconds": round(time.monotonic() - started, 1)}
    if not (study / "report.json").exists() and (study / "study.journal").exists():
        # killed before it wrote its report: `ckrun report` writes it from the study's journal
        subprocess.run([sys.executable, "-m", "runner", "report", str(study)], cwd=REPO, capture_output=True,
                       timeout=60)
    return found


def collect(study: Path, out: Path, run: dict, prefix: str) -> dict | None:
    """Copies the study's small results to OUT (PREFIXreport.json, PREFIXtuned.yaml); returns its
    report.json (None when there is none)."""
    for name in ("report.json", "tuned.yaml"):
        if (study / name).exists():
            shutil.copyfile(study / name, out / f"{prefix}{name}")
    if not (study / "report.json").exists():
        return None
    report = json.loads((study / "report.json").read_text(encoding="utf-8"))
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


# --- measuring ------------------------------------------------------------------------------------


RUN_KEYS = ("status", "samples_per_s", "step_time_s", "card_peak_bytes", "peak_mem_bytes", "peak_allocated_bytes",
            "cuda_context_bytes", "probe_s", "reason", "device", "other_gpu_processes")


def measure(candidate: dict, setup: Setup, work: Path, number: int, limit_s: float) -> dict:
    if candidate["role"] == "hf_full_checkpointing":
        return measure_hf(setup, work, number, limit_s)
    runner = ProbeRunner(work, ProbeSettings(limit_s, setup.warmup_steps, setup.timed_steps, compile_timeout_s=limit_s))
    # a row of tune.json, as hf_loop.py's result is: the fields the probe set
    return runner.probe(candidate["recipe"], number).model_dump(mode="json", exclude_defaults=True)


def measure_hf(setup: Setup, work: Path, number: int, limit_s: float) -> dict:
    """hf_loop.py in its own process group, as a probe runs; killed at `limit_s`."""
    result = work / f"hf-{number}.json"
    command = [sys.executable, str(REPO / "bench" / "gpu" / "hf_loop.py"), str(result), setup.recipe, *setup.base,
               "--warmup", str(setup.warmup_steps), "--timed", str(setup.timed_steps)]
    started = time.monotonic()
    with open(work / f"hf-{number}.log", "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"status": "timeout", "reason": f"timed out after {limit_s:.0f} s"}
    found = json.loads(result.read_text()) if result.exists() else \
        {"status": "died", "reason": f"exit {process.returncode}; see {work / f'hf-{number}.log'}"}
    return {**found, "probe_s": round(time.monotonic() - started, 2)}


def measure_all(candidates: list[dict], setup: Setup, args, work: Path, results: dict, budget: Budget) -> None:
    """Every candidate once per round, in the same order each round, while the budget lasts."""
    work.mkdir(parents=True, exist_ok=True)
    number = 0
    for round_number in range(args.repeats):
        if not budget.allows(setup.probe_s * len(candidates)) and round_number > 0:
            results["rounds_note"] = f"{round_number} round(s): the budget had no room for another"
            break
        for candidate in candidates:
            if not budget.allows(setup.probe_s / 2):
                candidate["runs"].append({"status": "skipped", "reason": "the call's budget ran out"})
                continue
            result = measure(candidate, setup, work, number, budget.limit(4 * setup.probe_s, keep=5))
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


def compare(setup: Setup, args, work: Path, results: dict, budget: Budget) -> None:
    total = budget.left()
    searches = []
    for index, (cap, name, role) in enumerate(((args.max_mem, "tuned", "tuned"),
                                               (card_cap(setup, work, args.dry_run), "fastest uncapped", "uncapped"))):
        study, prefix = work / f"study-{role}", f"{role}_"
        run = run_tuner(setup, cap, budget.limit(setup.shares[index] * total, keep=60), study,
                        args.out / f"{prefix}search.log")
        results["tune" if role == "tuned" else "uncapped_tune"] = run
        report = collect(study, args.out, run, prefix)
        searches.append(winner_candidate(setup, study, report, cap, name, role))
    # in the order the figures need them, should the budget end a round early: P1, P2, then ckrun's own full
    candidates = [c | {"runs": []} for c in [*searches, hf_candidate(setup), full_checkpointing(setup)] if c]
    tune_verdict.conclude(results, candidates)
    write_json(args.out / "tune.json", results)
    measure_all(candidates, setup, args, work / "compare", results, budget)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="bert_tiny on the CPU under 100MB")
    parser.add_argument("--budget-s", type=float, help="this call's share of the GPU in seconds (default 460)")
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
    try:
        compare(setup, args, work, results, budget)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the studies' probe files: what matters is in OUT_DIR
        results["budget"] = budget.record()
        write_json(args.out / "tune.json", results)
    print("\n" + tables.tune_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
