"""How long ckrun's read-only commands take, as a user meets them: each a fresh process.

Each command runs as `python -m ckrun ARGS` (the code the `ckrun` script runs, from the checkout
named by --code), the rounds interleaved so that the commands share the machine's moods. The user
cache folder (XDG_CACHE_HOME: ls's parameter counts, validate's passed model checks) is what makes
a command fast or slow, so each row says which it had: "cold", a new empty folder for every run
(a first run after installing or upgrading); "warm", a folder filled by one untimed run of the same
command first. Wall: the median over runs. CPU: user + sys of the process and its children
(resource.getrusage(RUSAGE_CHILDREN) before and after), which other jobs on the machine cannot
inflate. The goal (issue 26): `ls` under 1 s and `validate` of a library recipe under 2 s, wall.

    python bench/read_only.py                               # about 3 minutes on 2 idle cores
    python bench/read_only.py --code /tmp/old-checkout --no-docs   # the same commands on other code
    python bench/read_only.py --quick --docs /tmp/read_only.md     # bert_tiny, one run: a smoke run

Writes the section `read_only` of docs/benchmarks.md (unless --no-docs) and prints it.
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
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from bench.doc_sections import write_section

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"ls": 1.0, "validate": 2.0}  # seconds of wall time, issue 26 point 3


@dataclass
class Command:
    args: list[str]
    cache: str  # "cold", "warm" or "-" (reads no cache)
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "ckrun " + " ".join(self.args)

    @property
    def goal(self) -> float | None:
        return GOALS.get(self.args[0])


def commands(recipe: str, python_recipe: str, quick: bool) -> list[Command]:
    if quick:
        return [Command(["--help"], "-"), Command(["validate", recipe], "cold"), Command(["validate", recipe], "warm")]
    return [Command(["--help"], "-"), Command(["ls"], "cold"), Command(["ls"], "warm"),
            Command(["validate", recipe], "cold"), Command(["validate", recipe], "warm"),
            Command(["validate", python_recipe], "warm"), Command(["show", recipe], "warm"),
            Command(["show", recipe, "--blocks"], "warm"), Command(["estimate", recipe], "warm")]


def run_once(args: list[str], code: Path, cache: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `python -m ckrun ARGS`; a failure stops the benchmark."""
    env = {**os.environ, "PYTHONPATH": str(code), "XDG_CACHE_HOME": str(cache)}
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ckrun", *args], cwd=code, env=env, capture_output=True, text=True)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"ckrun {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(rows: list[Command], runs: int, code: Path, scratch: Path) -> None:
    """Every command `runs` times, round by round; a warm command's folder is filled by one untimed run."""
    warm = {}
    for index, row in enumerate(rows):
        if row.cache == "warm":
            warm[index] = scratch / f"warm-{index}"
            run_once(row.args, code, warm[index])
    for round_number in range(runs):
        for index, row in enumerate(rows):
            cache = warm.get(index, scratch / f"cold-{index}-{round_number}")  # a new, empty one when cold
            wall, cpu = run_once(row.args, code, cache)
            row.walls.append(wall)
            row.cpus.append(cpu)


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


def versions() -> str:
    found = [f"Python {platform.python_version()}"]
    for package in ("torch", "transformers", "torchvision"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def code_version(code: Path) -> str:
    """The commit measured, marked when the code that runs has changes beyond it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=code, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return f"code at {code} (not a git checkout)"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "runner", "recipes")  # the code that runs
    return f"commit {commit}" + (" with uncommitted changes to runner/ or recipes/" if changed else "")


def verdict(row: Command) -> str:
    if row.goal is None:
        return "-"
    return f"< {row.goal:.0f} s: {'met' if statistics.median(row.walls) < row.goal else 'missed'}"


def markdown(rows: list[Command], run: dict) -> str:
    lines = ["## Read-only commands: wall and CPU time", "",
             f"`{run['command']}` on {run['started']}, {code_version(Path(run['code']))}: {cpu_model()}, "
             f"{os.cpu_count()} cores (load average {run['load'][0]:.1f} at the start, {run['load'][1]:.1f} at the "
             f"end), {versions()}. Each command a fresh `python -m ckrun` process, runs: {run['runs']}, interleaved; "
             "wall and CPU (user + sys, children included) are medians. Cache: the user cache folder "
             "(XDG_CACHE_HOME) was new and empty for every run (cold), or filled by one untimed run of the same "
             "command first (warm). Goal (issue 26): `ls` under 1 s, `validate` of a library recipe under 2 s.", "",
             "| command | cache | wall | CPU | goal | runs (wall, s) |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row.label}` | {row.cache} | {statistics.median(row.walls):.2f} s | "
                     f"{statistics.median(row.cpus):.2f} s | {verdict(row)} | "
                     f"{', '.join(f'{w:.2f}' for w in row.walls)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    args = _arguments(argv)
    rows = commands("bert_tiny" if args.quick else args.recipe, args.python_recipe, args.quick)
    runs = 1 if args.quick else args.runs
    run = {"command": " ".join(["python bench/read_only.py", *(argv if argv is not None else sys.argv[1:])]),
           "started": time.strftime("%Y-%m-%d %H:%M %Z"), "code": str(args.code), "runs": runs}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckrun-read-only-") as scratch:
        measure(rows, runs, args.code.resolve(), Path(scratch))
    run["load"] = (load_before, os.getloadavg()[0])
    text = markdown(rows, run)
    if not args.no_docs:
        write_section(args.docs, "read_only", text)
    print(text)
    results = [{"command": row.label, "cache": row.cache, "walls": row.walls, "cpus": row.cpus, "goal": row.goal}
               for row in rows]
    print(json.dumps({"run": run, "results": results}))
    return results


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each command (the median is reported)")
    parser.add_argument("--recipe", default="bert_large", help="the library recipe validate, show and estimate read")
    parser.add_argument("--python-recipe", default="classic_cifar_cnn", help="a library recipe of ckrun's own code")
    parser.add_argument("--code", type=Path, default=ROOT, help="the ckrun checkout whose code runs (default: this one)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs/benchmarks.md", help="the page the section goes to")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--quick", action="store_true", help="bert_tiny, one run, three commands: a smoke run")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
