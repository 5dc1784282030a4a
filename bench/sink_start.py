"""How long the MLflow sink holds training back, and where its time goes (issue 36 point 8: "the MLflow
sink takes 17 s to open before step 1").

Two measurements, each in fresh processes:

- parts: in one `python` process, the seconds of `from mlflow.tracking import MlflowClient`, of the
  first use of a new SQLite store (MLflow creates its tables and alembic runs every migration), and
  of creating the experiment and the run and logging the recipe's params.
- runs: `python -m ckrun bert_tiny` (tiny, 3 steps on the CPU, from the checkout --code names) with
  and without `output.sinks: [mlflow]`, and with --before the same from another checkout; "first
  step" is the wall time from the process's start until metrics.jsonl holds step 1 (polled every
  20 ms), "end" until the process exits (the end waits for the sink to take every record). MLflow
  runs with a user cache folder (XDG_CACHE_HOME) new for each run ("cold": the store is made and kept
  there) or filled by one untimed run first ("warm": a new run's store is a copy). The rounds
  alternate the cases, so they share the machine's moods.

    python bench/sink_start.py                                  # about 3 minutes on 2 idle cores
    python bench/sink_start.py --before /tmp/old-checkout      # and the same runs of older code

Writes the section `sink_start` of docs/benchmarks.md (unless --no-docs) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from bench.doc_sections import write_section

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.vocab_size=256",
        "model.config.max_position_embeddings=32", "data.seq_len=32", "train.batch_size=8", "train.device=cpu",
        "train.steps=3", "output.log_every=1"]
PARTS = r"""
import json, os, sys, tempfile, time
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
times, started = {}, time.perf_counter()
from mlflow.tracking import MlflowClient
from mlflow.entities import Param
times["import"] = time.perf_counter() - started
folder = tempfile.mkdtemp()
started = time.perf_counter()
client = MlflowClient(tracking_uri=f"sqlite:///{folder}/mlflow.db")
client.get_experiment_by_name("ckrun")
times["store"] = time.perf_counter() - started
started = time.perf_counter()
experiment = client.create_experiment("ckrun", artifact_location=f"file://{folder}/mlartifacts")
run = client.create_run(experiment, run_name="bench").info.run_id
client.log_batch(run, params=[Param(f"key{i}", "value") for i in range(60)])
times["run"] = time.perf_counter() - started
print(json.dumps(times))
"""


def version(*names: str) -> str:
    """The installed version of the first of `names` there is (mlflow or the client alone, mlflow-skinny)."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "?"


def parts(python: str) -> dict[str, float]:
    done = subprocess.run([python, "-c", PARTS], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed_run(python: str, code: Path, sinks: bool, cache: Path | None = None) -> tuple[float, float]:
    """(seconds until metrics.jsonl holds step 1, seconds until the process exits); `cache`: the user
    cache folder (None: a new one)."""
    out = Path(tempfile.mkdtemp(prefix="sink-start-")) / "run"
    args = [python, "-m", "ckrun", "bert_tiny", *TINY, f"output.dir={out}",
            *(["output.sinks=[mlflow]"] if sinks else [])]
    env = {**os.environ, "PYTHONPATH": str(code), "MLFLOW_DISABLE_TELEMETRY": "true",
           "XDG_CACHE_HOME": str(cache or tempfile.mkdtemp(prefix="sink-start-cache-"))}
    started, first = time.perf_counter(), None
    process = subprocess.Popen(args, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    while process.poll() is None:
        if first is None and metrics.is_file() and '"step": 1' in metrics.read_text():
            first = time.perf_counter() - started
        time.sleep(0.02)
    end = time.perf_counter() - started
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {process.returncode}: {process.stderr.read()[-2000:]}")
    return first if first is not None else end, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="the checkout whose runner runs (default: this one)")
    parser.add_argument("--before", type=Path, help="a checkout of older code to run beside it (`git archive`)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    python, load = sys.executable, os.getloadavg()[0]
    split = [parts(python) for _ in range(args.runs)]
    print("parts:", split, flush=True)
    code, warm = args.code.resolve(), Path(tempfile.mkdtemp(prefix="sink-start-warm-"))
    timed_run(python, code, True, warm)  # fills the warm cache
    cases = {"no sink": (code, False, warm), "`output.sinks: [mlflow]`, cold cache": (code, True, None),
             "`output.sinks: [mlflow]`, warm cache": (code, True, warm)}
    if args.before:
        cases.update({"no sink (before)": (args.before.resolve(), False, warm),
                      "`output.sinks: [mlflow]` (before)": (args.before.resolve(), True, warm)})
    rows = {label: [] for label in cases}
    for _ in range(args.runs):
        for label, case in cases.items():
            rows[label].append(timed_run(python, *case))
            print(label, rows[label][-1], flush=True)
    median = lambda values: statistics.median(values)  # noqa: E731
    commit = subprocess.run(["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    lines = [
        "## The MLflow sink's start",
        "",
        f"`python bench/sink_start.py{' --before ' + str(args.before) if args.before else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, code at commit {commit}: Python {sys.version.split()[0]}, mlflow {version('mlflow', 'mlflow-skinny')}, alembic "
        f"{version('alembic')}, {os.cpu_count()} cores (load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end); medians of {args.runs} runs, wall seconds.",
        "",
        "| MLflow, in one process | seconds | runs |",
        "|---|---|---|",
        *(f"| {label} | {median([p[key] for p in split]):.2f} | {', '.join(f'{p[key]:.2f}' for p in split)} |"
          for key, label in (("import", "`from mlflow.tracking import MlflowClient`"),
                             ("store", "a new SQLite store: its tables created, every migration run"),
                             ("run", "the experiment, the run and 60 params"))),
        "",
        "| `ckrun bert_tiny` (3 tiny steps, CPU) | first step | end | runs (first step, s) |",
        "|---|---|---|---|",
        *(f"| {label} | {median([r[0] for r in runs]):.2f} | {median([r[1] for r in runs]):.2f} | "
          f"{', '.join(f'{r[0]:.2f}' for r in runs)} |" for label, runs in rows.items()),
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        write_section(ROOT / "docs" / "benchmarks.md", "sink_start", text)


if __name__ == "__main__":
    main()
