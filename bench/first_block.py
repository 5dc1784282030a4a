"""The README's first block, once installed, as a new user runs it: `ckrun tune recipes/bert_tiny.yaml
--max-mem 100MB --time-budget 40s` (the search, then training the winner), in a fresh folder each run.

Issue 36: on a 2-core CPU with one other job's load it must finish within the time the README states
and its tuned.yaml must compare at least two measured plans. `--load N` starts N busy loops (`python -c
"while True: pass"`) for the runs: the "other job". Per run: the wall-clock time of the search (to
tuned.yaml) and of the whole command, the CPU seconds of ckrun and its children (which the other job
cannot inflate), the plans measured, and what tuned.yaml warns of. The machine's load average is
printed with each run: on a shared machine other people's jobs come on top of --load.

    python bench/first_block.py --runs 3 --load 1     # about 5 minutes on 2 quiet cores
    python bench/first_block.py --runs 1 --no-train --no-docs

Writes the section `first_block` of docs/benchmarks.md (unless --no-docs) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from bench.doc_sections import write_section

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["tune", str(ROOT / "recipes" / "bert_tiny.yaml"), "--max-mem", "100MB", "--time-budget", "40s"]


def one_run(train: bool) -> dict:
    """The block in a new folder: times, CPU, and what the study found."""
    with tempfile.TemporaryDirectory(prefix="first-block-") as folder:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        started = time.monotonic()
        process = subprocess.Popen([sys.executable, "-m", "ckrun", *COMMAND, *([] if train else ["--no-train"])],
                                   cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
        tuned_at, said = None, []
        for line in process.stdout:  # the search ends where tuned.yaml is written or training starts
            said = [*said[-30:], line]
            if tuned_at is None and (" train: " in line or "tune: wrote" in line):
                tuned_at = time.monotonic() - started
        code = process.wait()
        if code:
            print(f"ckrun exited with status {code}; its last lines:\n{''.join(said)}", file=sys.stderr)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        study = Path(folder) / "runs" / "bert_tiny" / "tune"
        report = json.loads((study / "report.json").read_text()) if (study / "report.json").exists() else {}
        tuned = (study / "tuned.yaml").read_text() if (study / "tuned.yaml").exists() else ""
    measured = {t["key"] for t in report.get("trials", []) if t.get("measured_peak") and t["state"] != "duplicate"}
    return {"code": code, "search_s": tuned_at, "wall_s": wall, "load": load,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "plans": len(measured), "warning": "WARNING" in tuned, "caveats": report.get("caveats", [])}


def busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def table(runs: list[dict], load: int, train: bool) -> str:
    rows = ["| run | exit | search (wall) | whole command (wall) | CPU, ckrun and children | load average at start "
            "| plans measured | tuned.yaml warns |", "|---|---|---|---|---|---|---|---|"]
    for n, run in enumerate(runs, 1):
        warns = "; ".join(c.split(":")[0] for c in run["caveats"]) or "no"
        rows.append(f"| {n} | {run['code']} | {run['search_s'] or 0:.0f} s | {run['wall_s']:.0f} s | {run['cpu_s']:.0f} s "
                    f"| {run['load']:.1f} | {run['plans']} | {warns} |")
    median = lambda key: statistics.median(r[key] or 0 for r in runs)  # noqa: E731
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("torch", "transformers", "optuna"))
    return "\n".join([
        "## The README's first block on a loaded 2-core CPU",
        "",
        f"`python bench/first_block.py --runs {len(runs)} --load {load}{'' if train else ' --no-train'}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.machine()}, {os.cpu_count()} cores shared "
        f"with other jobs, {load} busy loop(s) started beside it (the \"one other job\"), Python "
        f"{platform.python_version()}, {versions}. The command: `ckrun {' '.join(COMMAND).replace(str(ROOT) + '/', '')}`"
        f"{'' if train else ' --no-train'}, in a fresh folder each run, once installed. Search: start to tuned.yaml; "
        "CPU: user + sys of ckrun and every process it started.",
        "",
        *rows,
        "",
        f"Medians: search {median('search_s'):.0f} s, whole command {median('wall_s'):.0f} s, CPU {median('cpu_s'):.0f} s, "
        f"{median('plans'):.0f} plans measured.",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load", type=int, default=1, help="busy loops beside the runs (default 1)")
    parser.add_argument("--no-train", action="store_true", help="stop at tuned.yaml")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    loops = busy_loops(args.load)
    try:
        runs = []
        for _ in range(args.runs):
            runs.append(one_run(not args.no_train))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    text = table(runs, args.load, not args.no_train)
    print(text)
    if not args.no_docs:
        write_section(ROOT / "docs" / "benchmarks.md", "first_block", text)


if __name__ == "__main__":
    main()
