"""`ckrun tune --predict` on the Llama shapes people squeeze onto GPUs: how long it takes, how many plans
it prices, what it picks (issue 42).

Each row runs `ckrun tune ... --predict --no-train` as a user would, in a child process: its wall time, the
CPU seconds it used (user + system, from the child's rusage) and the machine's load average beside them,
since a shared machine's wall time is not a benchmark figure; then from its report.json the plans priced
(trials answered by a prediction, those ruled out by the pools' lower bound apart) and the winner with its
predicted peak and step. With `--exhaustive`, the 8B row's whole space is searched for its best plan that
fits (bench/ordered_oracle.py: plans ordered by their composed step times, memory priced in that order;
plans whose pools' bound is over the limit are over without a prediction) and the winner is compared with
it: the issue's "within 2 %".

    python bench/tune_shapes.py                      # every row (tens of minutes on a busy machine)
    python bench/tune_shapes.py --rows 8b 7b-lora    # some of them
    python bench/tune_shapes.py --rows 8b --exhaustive
    python bench/tune_shapes.py --rows --exhaustive --keep rows.json   # the oracle alone, the 8B row kept

Writes the section `tune_shapes` of docs/benchmarks.md and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.doc_sections import write_section  # noqa: E402

LLAMA2_7B = ["model.config.vocab_size=32000", "model.config.hidden_size=4096", "model.config.intermediate_size=11008",
             "model.config.num_hidden_layers=32", "model.config.num_attention_heads=32",
             "model.config.num_key_value_heads=32", "model.config.max_position_embeddings=4096", "data.seq_len=2048",
             "train.batch_size=8"]
LLAMA3_70B = ["model.config.hidden_size=8192", "model.config.intermediate_size=28672",
              "model.config.num_hidden_layers=80", "model.config.num_attention_heads=64",
              "model.config.num_key_value_heads=8"]
ROWS = {  # name: (what, recipe, overrides, flags); --nproc rows price each plan by a whole rank's step (not composed):
    # their budget is 2 minutes here, enough to see the first plan priced
    "1b": ("Llama 3.2 1B, one H100", "recipes/llama3_2_1b.yaml", [], ["--max-mem", "80GB", "--gpu", "h100"]),
    "3b": ("Llama 3.2 3B, one H100", "recipes/llama3_2_3b.yaml", [], ["--max-mem", "80GB", "--gpu", "h100"]),
    "8b": ("Llama 3 8B, one H100 (issue 42's done-when)", "recipes/llama3_8b.yaml", [],
           ["--max-mem", "80GB", "--gpu", "h100", "--allow-lossy"]),
    "8b-nproc8": ("Llama 3 8B, 8 H100", "recipes/llama3_8b.yaml", [],
                  ["--max-mem", "80GB", "--gpu", "h100", "--nproc", "8", "--time-budget", "120s"]),
    "70b-nproc8": ("Llama 3 70B shape, 8 H100", "recipes/llama3_8b.yaml", LLAMA3_70B,
                   ["--max-mem", "80GB", "--gpu", "h100", "--nproc", "8", "--time-budget", "120s"]),
    "70b-nproc64": ("Llama 3 70B shape, 64 H100", "recipes/llama3_8b.yaml", [*LLAMA3_70B, "train.batch_size=64"],
                    ["--max-mem", "80GB", "--gpu", "h100", "--nproc", "64", "--time-budget", "120s"]),
    "7b-lora": ("Llama 2 7B LoRA (rank 16, all linear, bf16 base), batch 8, seq 2048, 24 GB", "recipes/llama_1b_lora.yaml",
                LLAMA2_7B, ["--max-mem", "24GB", "--gpu", "a100", "--time-budget", "60s"]),
    "7b-full": ("Llama 2 7B full fine-tune, batch 8, seq 2048, 24 GB", "recipes/llama3_8b.yaml", LLAMA2_7B,
                ["--max-mem", "24GB", "--gpu", "a100", "--allow-lossy"]),
    "7b-full-b2": ("Llama 2 7B full fine-tune as torchtune's low-memory config (batch 2), 24 GB",
                   "bench/published/llama2_7b_full.yaml", [], ["--max-mem", "24GB", "--gpu", "a100", "--allow-lossy"]),
}


def run_row(name: str) -> dict:
    what, recipe, overrides, flags = ROWS[name]
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "ckrun", "tune", str(ROOT / recipe), *overrides, *flags, "--predict",
                   "--no-train", "--output", f"{directory}/tune", f"output.dir={directory}/run"]
        load_before, before = os.getloadavg()[0], resource.getrusage(resource.RUSAGE_CHILDREN)
        started, clock = time.monotonic(), time.time()
        done = subprocess.run(command, capture_output=True, text=True, cwd=directory,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        wall = time.monotonic() - started
        after, load_after = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
        report_path = Path(directory) / "tune" / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else {}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    trials = report.get("trials", [])
    priced = [t for t in trials if t.get("probe_s") is not None and t["state"] != "duplicate"]
    bounded = [t for t in trials if t["state"] == "screened" and "lower bound" in (t.get("reason") or "")]
    winner = next((t for t in trials if t["number"] == report.get("winner")), None)
    first = _first_priced(done.stderr, clock)
    first_cpu = next((float(line.split(" CPU s since")[0].rsplit("(", 1)[1]) for line in done.stderr.splitlines()
                      if "first plan priced" in line and " CPU s since" in line), None)
    return {"name": name, "what": what, "command": " ".join(["ckrun", "tune", recipe, *overrides, *flags, "--predict",
                                                                 "--no-train"]),
            "exit": done.returncode, "wall": wall, "cpu": cpu, "load": (load_before, load_after),
            "priced": len(priced), "screened_out": len([t for t in trials if t["state"] == "screened"]) - len(bounded),
            "bounded": len(bounded), "winner": winner, "first_priced_s": first, "first_priced_cpu": first_cpu,
            "screening": report.get("screening", {}), "tail": done.stderr.strip().splitlines()[-2:]}


def _first_priced(log: str, started: float) -> float | None:
    """Seconds from the tune's start (`started`, a time.time()) to the log line of its first plan priced (the
    screening's, else the first trial line that reports one), to the second of the log's stamps: the process's
    start and imports included, as a user waits for them."""
    priced = [line[:8] for line in log.splitlines() if "first plan priced" in line or
              ("trial " in line and ("predicted" in line or "screened" in line))]
    if not priced:
        return None
    stamp = priced[0]
    day = time.localtime(started)
    at = time.mktime((*day[:3], int(stamp[:2]), int(stamp[3:5]), int(stamp[6:8]), 0, 0, day.tm_isdst))
    return max(at - started, 0.0)


def exhaustive(name: str, cap_text: str) -> dict:
    """The best plan of the row's whole space that fits (bench/ordered_oracle.py: every plan under the pools'
    bound ordered by its composed step time, memory priced in that order): what the search is judged by."""
    from ckrun.autotune.cap import Cap
    from ckrun.autotune.probes.model_child import model_facts
    from ckrun.autotune.search.predicted import CONTEXT_BYTES, predicted_device
    from ckrun.autotune.space.facts import ModelFacts
    from ckrun.autotune.space.knobs import build_space, describe
    from ckrun.autotune.space.pool_knobs import bound_space
    from ckrun.autotune.space.validity import invalid_reason
    from ckrun.runner.recipe.load import load_recipe
    from ckrun.runner.predict.compose import Composer
    from ckrun.runner.predict.hardware import resolve_device
    from ckrun.runner.predict.parts import PartsEstimator
    from pydantic import ByteSize, TypeAdapter

    from bench.ordered_oracle import ordered_optimum

    _, recipe_path, overrides, flags = ROWS[name]
    recipe = load_recipe(ROOT / recipe_path, overrides)
    facts = resolve_device(flags[flags.index("--gpu") + 1])
    device = predicted_device(facts, 1)
    model = ModelFacts.from_json({"status": "ok", **model_facts(recipe)})
    space = build_space(recipe, model, device, 1, allow_lossy="--allow-lossy" in flags)
    cap = Cap(int(TypeAdapter(ByteSize).validate_python(cap_text)), 0.05)
    bound_space(space, recipe, model, device, cap)
    composer = Composer(PartsEstimator(recipe, "cuda", facts))
    candidates = []
    for params in space.all_params():
        candidate = space.candidate(params)
        if invalid_reason(candidate, space) or space.bound.over(candidate) is not None:
            continue
        try:
            composer.estimator.check(candidate.plan, candidate.precision)
        except ValueError:
            continue
        candidates.append(candidate)
    cpu = time.process_time()
    found = ordered_optimum(composer, candidates, cap.limit, CONTEXT_BYTES, describe,
                            lambda line: print(f"oracle: {line}", file=sys.stderr, flush=True))
    return {"best": found.best, "space": space.size, "plans": found.plans, "figures": found.figures,
            "priced": found.priced, "traces": found.traces, "seconds": found.seconds,
            "cpu": time.process_time() - cpu, "load": os.getloadavg()[0], "violations": found.violations}


def markdown(rows: list[dict], checks: dict, started: str) -> str:
    lines = ["## Predicted tunes of the Llama shapes, priced from parts (issue 42)", "",
             f"`python bench/tune_shapes.py` on {started}: {platform.machine()}, {os.cpu_count()} CPU cores shared with "
             f"other jobs (the load average before and after each row is beside it), Python {platform.python_version()}, "
             f"torch {torch.__version__}, no GPU: every figure is the predictor's (peak with the CUDA context, roofline "
             "step time on the named GPU's datasheet facts). Wall time on this busy machine is not a benchmark figure: "
             "the CPU seconds are what the tune cost, and a row marked *re-measure* needs 2 idle cores for its wall "
             "time.", "",
             "| row | command | exit | wall | CPU s | load | plans priced (bound / over) | first plan priced | winner | predicted peak, step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        winner = row["winner"]
        won = (f"{winner['label']}", f"{winner['measured_peak'] / 1e9:.1f} GB, {1000 * winner['step_s']:.0f} ms"
               if winner.get("step_s") else f"{winner['measured_peak'] / 1e9:.1f} GB") if winner else ("none", "-")
        busy = max(row["load"]) > 2.5
        first = "-" if row["first_priced_s"] is None else f"{row['first_priced_s']:.0f} s" + (
            f" ({row['first_priced_cpu']:.0f} CPU s)" if row.get("first_priced_cpu") is not None else "")
        when = f" (run {row['date']})" if row.get("date") and row["date"] != started else ""  # a row kept from before
        lines.append(f"| {row['what']}{when} | `{row['command']}` | {row['exit']} | {row['wall']:.0f} s"
                     f"{' (*re-measure*)' if busy else ''} | {row['cpu']:.0f} | {row['load'][0]:.1f} / {row['load'][1]:.1f} "
                     f"| {row['priced']} ({row['bounded']} / {row['screened_out']}) | "
                     f"{first} | {won[0]} | {won[1]} |")
    for name, check in checks.items():
        row = next(r for r in rows if r["name"] == name)
        best = check["best"]
        ratio = row["winner"]["samples_per_s"] / best["samples_per_s"] if best and row["winner"] else 0.0
        how = (f"the whole space ({check['space']} plans; {check['plans']} valid and under the pools' bound) ordered by "
               f"composed step time ({check['figures']} step times), memory priced in that order ({check['priced']} plans), "
               f"{check['traces']} traces, {check['seconds']:.0f} s wall, {check['cpu']:.0f} CPU s, load {check['load']:.1f}"
               + (f"; {len(check['violations'])} step time(s) under their bound, so the order is not proven"
                  if check["violations"] else ""))
        lines += ["", f"{name}: {how}: the best plan that fits is {best['label']} ({best['samples_per_s']:.3f} samples/s, "
                      f"{best['peak'] / 1e9:.1f} GB); the tune's winner has {ratio:.3f} of its throughput "
                      f"({'within' if ratio >= 0.98 else 'outside'} the issue's 2 %)." if best else
                  f"{name}: {how}: no plan fits."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--exhaustive", action="store_true", help="the 8B row's whole space's best plan "
                                                                     "(bench/ordered_oracle.py)")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--keep", type=Path, help="a JSON file of rows measured before: the rows run now replace "
                                                   "theirs, and the section shows them all (rows run one at a time)")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    kept = json.loads(args.keep.read_text()) if args.keep and args.keep.exists() else {"rows": {}, "checks": {}}
    for name in args.rows:
        row = kept["rows"][name] = {**run_row(name), "date": started}
        print(json.dumps({k: v for k, v in row.items() if k != "winner"}, default=str), flush=True)
    if args.exhaustive:  # `--rows --exhaustive --keep rows.json`: the oracle alone, against the kept 8B row
        kept["checks"]["8b"] = exhaustive("8b", "80GB")
    if args.keep:
        args.keep.write_text(json.dumps(kept, indent=1, default=str))
    rows = [kept["rows"][name] for name in ROWS if name in kept["rows"]]
    text = markdown(rows, {k: v for k, v in kept["checks"].items() if k in kept["rows"]}, started)
    if not args.no_docs:
        write_section(ROOT / "docs" / "benchmarks.md", "tune_shapes", text)
    print(text)


if __name__ == "__main__":
    main()
