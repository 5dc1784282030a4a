"""The step-time model against published training measurements nobody here made.

Each setup is a published, measured training run (the source's URL, the exact words or table row it
was read from, its setup), written as a ckrun recipe as close to that setup as recipes allow
(bench/published/*.yaml, with the overrides bench/published_setups.py lists) and predicted the way anyone would:

    ckrun estimate RECIPE --gpu NAME --json [--nproc N] [overrides]

(a subprocess per setup). The prediction's throughput per GPU is compared with the published one;
pairs of setups that differ only in activation checkpointing give recompute overheads, compared with
the overheads the sources measured; the predicted memory per GPU is set beside the figure a source
reports, or the card its run trained on. The setups themselves: bench/published_setups.py. A setup
ckrun cannot express faithfully says why (`mismatch`) and is left out of the headline error, not out
of the table. Nothing here is fitted: the time model's
figures are its datasheet facts and the calibration table (runner/predict/calibration.json).

    python bench/published.py                    # every setup: about 8 minutes on 2 cores
    python bench/published.py --set heldout      # the held-out runs (bench/heldout_setups.py, issue 44)
    python bench/published.py --only bert-p2-fp16 llama2-13b-none --no-docs
    python bench/published.py --quick --out /tmp/p   # two toy setups through the same code (tests)
    python bench/published.py --from runs/bench_published/results.json   # the docs again, no predicting

Writes its section of docs/benchmarks_time.md (unless --no-docs, --quick or --only) and results.json under
--out (runs/bench_published, or runs/bench_heldout for the held-out set).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages, as tests and the other benches
    sys.path.insert(0, str(ROOT))

from bench.doc_sections import write_section  # noqa: E402
from bench.published_setups import (  # noqa: E402 (the setups, read by name: published.SETUPS)
    DLE_BERT, DLE_RN50, KORTHIKANTI, OVERHEADS, QUICK, RATIO_SETUPS, SETUPS, TITAN, Overhead, Setup,
)
from bench.heldout_setups import FOUNDRY, FSDP_BLOG, HELDOUT  # noqa: E402
from bench.stats import spearman  # noqa: E402

GOALS = {"published": "goal: at most 15 %", "heldout": "goal: at most 10 %; worst at most 20 %, H100 rows at most 15 %"}

@dataclass
class Result:
    setup: Setup
    predicted: float | None
    seconds: float | None = None
    """The predicted step time."""
    compute_s: float | None = None
    """Its forward and backward."""
    peak_gib: float | None = None
    estimate_s: float = 0.0
    error: str = ""
    breakdown: dict = field(default_factory=dict)
    mfu: float | None = None
    comm_s: float | None = None
    """Collective time the compute does not hide (--nproc)."""

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.setup.published if self.predicted and self.setup.published else None


def predict(setup: Setup) -> Result:
    """`ckrun estimate` of the setup, as a subprocess: the command anyone re-runs."""
    started = time.perf_counter()
    done = subprocess.run(setup.command(sys.executable), cwd=ROOT, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    took = time.perf_counter() - started
    if done.returncode != 0:
        return Result(setup, None, estimate_s=took, error=(done.stderr.strip().splitlines() or ["?"])[-1])
    record = json.loads(done.stdout)
    step = record["time"]
    ranks = setup.nproc or 1
    rate = step["tokens_per_s"] if setup.unit == "tokens/s" else step["samples_per_s"]
    return Result(setup, rate / ranks, step["seconds"], step["forward_s"] + step["backward_s"],
                  record["peak_bytes"] / 2**30, took, breakdown={k: round(v / 2**30, 2) for k, v in record["breakdown"].items()},
                  mfu=step["mfu"], comm_s=step["comm_s"])


def predict_all(setups) -> dict[str, Result]:
    results = {}
    for setup in setups:
        result = results[setup.key] = predict(setup)
        shown = f"{result.predicted:,.1f} {setup.unit}/GPU" if result.predicted else f"failed: {result.error}"
        print(f"{setup.key}: {shown} (published {setup.published:,}; {result.estimate_s:.0f} s)", flush=True)
    return results


def recorded(path: Path, setups) -> dict[str, Result]:
    """A run's predictions read back, attached to the setups as they are now (sources, notes)."""
    rows = json.loads(path.read_text(encoding="utf-8"))["results"]
    fields = ("predicted", "seconds", "compute_s", "peak_gib", "estimate_s", "error", "breakdown", "mfu", "comm_s")
    return {setup.key: Result(setup, *(rows[setup.key].get(name) for name in fields))
            for setup in setups if setup.key in rows}


def summary(results: dict[str, Result], overheads: tuple[Overhead, ...]) -> dict:
    """The headline figures: median and worst absolute error (faithful setups), rank correlation, overheads."""
    rows = [r for r in results.values() if r.ratio is not None and r.setup.published]
    faithful = [r for r in rows if not r.setup.mismatch]
    errors = sorted(abs(r.ratio - 1) for r in faithful)
    out = {"setups": len(rows), "faithful": len(faithful),
           "median_abs_error": statistics.median(errors) if errors else None,
           "worst_abs_error": max(errors) if errors else None,
           "worst_any": max((abs(r.ratio - 1) for r in rows), default=None),
           "median_all": statistics.median(abs(r.ratio - 1) for r in rows) if rows else None,
           "spearman_all": spearman([r.predicted for r in rows], [r.setup.published for r in rows])
           if len(rows) > 2 else None,
           "spearman_faithful": spearman([r.predicted for r in faithful], [r.setup.published for r in faithful])
           if len(faithful) > 2 else None, "overheads": [],
           "worst_h100": max((abs(r.ratio - 1) for r in faithful if "h100" in r.setup.gpu), default=None),
           "most_mfu": max((r.mfu for r in rows if r.mfu is not None), default=None),
           "most_scaling": max((1 - r.comm_s / r.seconds for r in rows if r.comm_s is not None and r.seconds
                                and (r.setup.nproc or 1) > 1), default=None)}
    for overhead in overheads:
        base, plan = results.get(overhead.base), results.get(overhead.plan)
        predicted = None
        if base and plan and base.seconds and plan.seconds:
            over = base.compute_s if overhead.per_layer else base.seconds
            predicted = (plan.seconds - base.seconds) / over if over else None
        out["overheads"].append({"name": overhead.name, "published": overhead.published, "predicted": predicted,
                                 "points": None if predicted is None else 100 * (predicted - overhead.published),
                                 "mismatch": overhead.mismatch})
    return out


def _pct(value: float | None, signed: bool = True) -> str:
    return "-" if value is None else (f"{100 * value:+.1f} %" if signed else f"{100 * value:.1f} %")


TITLES = {"published": ("# The step-time model against published measurements",
                         "Nothing is fitted to these rows: the figures are the GPU table's datasheet facts and the "
                         "calibration table's kernel-level figures (`runner/predict/calibration.json`)."),
          "heldout": ("# Held out: published training runs the time model was never fitted to",
                      "These rows (bench/heldout_setups.py, chosen by a rule written before any prediction) are held "
                      "out: the time model's figures come from datasheets and kernel-level benchmarks only "
                      "(`runner/predict/calibration.json`, one row per fact with its source), never from a training "
                      "run, these included.")}


def table(results: dict[str, Result], figures: dict, facts_lines: list[str], versions: str, took_s: float,
          which: str = "published") -> str:
    title, fitted = TITLES[which]
    lines = [title, "",
             f"Generated by `bench/published.py{' --set heldout' if which == 'heldout' else ''}` on "
             f"{time.strftime('%Y-%m-%d')} ({versions}; {took_s / 60:.0f} min of predictions on 2 shared CPU cores, no "
             "GPU). Every prediction is `ckrun estimate RECIPE --gpu NAME --json [--nproc N] [overrides]` of a recipe "
             "in `bench/published/`; the table gives each command's parts. Throughput is per GPU. " + fitted, "",
             "## Headline", "",
             f"- Median absolute throughput error over the {figures['faithful']} setups ckrun expresses faithfully: "
             f"**{_pct(figures['median_abs_error'], False)}** ({GOALS[which]}); worst of them "
             f"{_pct(figures['worst_abs_error'], False)}; worst faithful H100 row: "
             f"{_pct(figures.get('worst_h100'), False)}.",
             f"- Over all {figures['setups']} setups, the {figures['setups'] - figures['faithful']} ckrun cannot express "
             f"faithfully included (the table says why for each): median {_pct(figures.get('median_all'), False)}, "
             f"worst {_pct(figures['worst_any'], False)}.",
             f"- Spearman rank correlation of predicted and published throughput: "
             f"{_num(figures['spearman_all'])} over all {figures['setups']}, {_num(figures['spearman_faithful'])} "
             f"over the faithful ones (goal: at least 0.9).",
             f"- Highest predicted MFU: {_pct(figures.get('most_mfu'), False)}; highest predicted share of a "
             f"multi-GPU step not waiting for collectives: {_pct(figures.get('most_scaling'), False)} "
             "(below 100 % wherever collectives cannot all hide).", "",
             "## Setups", "",
             "| setup | GPU | ranks | published | predicted | error | MFU | collectives exposed | faithful | source "
             "(row as published) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for result in results.values():
        lines += _row(result)
    lines += ["", *memory_lines(results)]
    if not figures["overheads"]:
        return "\n".join([*lines, "## Commands", "", "```", *(shlex.join(r.setup.command()) for r in results.values()),
                          "```", "", "## Devices", "", *facts_lines]) + "\n"
    lines += ["## Recompute overheads", "",
              "| plan | published | predicted | difference | mismatch |", "|---|---:|---:|---:|---|"]
    for row in figures["overheads"]:
        points = "-" if row["points"] is None else f"{row['points']:+.1f} points"
        lines.append(f"| {row['name']} | {_pct(row['published'])} | {_pct(row['predicted'])} | {points} | "
                     f"{row['mismatch'] or '-'} |")
    lines += ["", "Sources of the overheads: " + "; ".join(sorted({f"[{_host(o.source)}]({o.source}): `{o.quote}`"
                                                                    for o in OVERHEADS})), "",
              "## Commands", "", "```"]
    lines += [shlex.join(r.setup.command()) for r in results.values()]
    lines += ["```", "", "## Devices", "", *facts_lines]
    return "\n".join(lines) + "\n"


def _row(result: Result) -> list[str]:
    setup = result.setup
    if not setup.published:
        return []
    faithful = "yes" if not setup.mismatch else f"no: {setup.mismatch}"
    if setup.note:
        faithful += f" (note: {setup.note})"
    predicted = f"{result.predicted:,.1f}" if result.predicted else f"failed: {result.error}"
    error = _pct(result.ratio - 1) if result.ratio else "-"
    exposed = f"{result.comm_s / result.seconds:.1%}" if result.comm_s is not None and result.seconds else "-"
    return [f"| {setup.key} | {_gpu_name(setup.gpu)} | {setup.nproc or 1} | {setup.published:,} {setup.unit} | "
            f"{predicted} | {error} | {_pct(result.mfu, False)} | {exposed} | {faithful} | "
            f"[{_host(setup.source)}]({setup.source}): `{setup.quote}` |"]


def memory_lines(results: dict[str, Result]) -> list[str]:
    """Each setup's predicted memory per GPU beside the figure its source reports, or the card its run fit on."""
    lines = ["## Memory", "",
             "Predicted reserved: the estimate's CUDA allocator model (cuBLAS workspaces in, the CUDA context out); "
             "live: the tensors at the peak. torchtitan logs its peak reserved memory; its A100 rows give no figure, "
             "only that they trained on 80 GB cards.", "",
             "| setup | ranks | published | predicted reserved | predicted live | verdict |",
             "|---|---:|---:|---:|---:|---|"]
    for result in results.values():
        setup = result.setup
        if result.peak_gib is None or (setup.memory_gib is None and setup.card_gib is None):
            continue
        live = result.peak_gib - (result.breakdown or {}).get("allocator_cache", 0.0)
        if setup.memory_gib is not None:
            shown, verdict = f"{setup.memory_gib:.1f} GiB", _pct(result.peak_gib / setup.memory_gib - 1)
        else:
            over = result.peak_gib - setup.card_gib
            shown = f"trained on a {setup.card_gib:.0f} GiB card"
            verdict = "fits" if over <= 0 else f"over the card by {over:.1f} GiB"
        lines.append(f"| {setup.key} | {setup.nproc or 1} | {shown} | {result.peak_gib:.1f} GiB | {live:.1f} GiB | "
                     f"{verdict} |")
    return [*lines, ""]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _host(url: str) -> str:
    return {DLE_BERT: "NVIDIA DLE BERT", DLE_RN50: "NVIDIA DLE ResNet-50", TITAN: "torchtitan performance.md",
            KORTHIKANTI: "Korthikanti et al. 2022", FOUNDRY: "llm-foundry benchmarking README",
            FSDP_BLOG: "PyTorch FSDP blog"}.get(url, url)


def _gpu_name(gpu: str) -> str:
    return Path(gpu).stem if gpu.endswith(".json") else gpu


def device_lines(setups) -> list[str]:
    from ckrun.runner.predict.hardware import resolve_device

    lines = []
    for gpu in sorted({s.gpu for s in setups}):
        facts = resolve_device(str(ROOT / gpu) if gpu.endswith(".json") else gpu)
        lines.append(f"- `{gpu}`: {facts.name}, dense bf16 {facts.matmul_tflops.get('bf16')} / tf32 "
                     f"{facts.matmul_tflops.get('tf32')} / fp32 {facts.matmul_tflops.get('fp32')} TFLOP/s, "
                     f"{facts.memory_gbs:,.0f} GB/s, peer {facts.peer_gbs:.0f} GB/s, network {facts.network_gbs:g} GB/s a "
                     f"GPU, {facts.gpus_per_host} a host, {facts.sms} SMs. {facts.source}.")
    return lines


def versions() -> str:
    import torch
    import transformers

    return (f"torch {torch.__version__.split('+')[0]}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="which", choices=("published", "heldout"), default="published",
                        help="published: bench/published_setups.py; heldout: bench/heldout_setups.py (issue 44)")
    parser.add_argument("--only", nargs="*", help="setup keys to run (default: all)")
    parser.add_argument("--quick", action="store_true", help="two toy setups, no docs (tests)")
    parser.add_argument("--out", type=Path, help="default: runs/bench_published or runs/bench_heldout")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--from", dest="recorded", type=Path, metavar="RESULTS_JSON",
                        help="the predictions a run recorded (its results.json): tables and docs again, with the "
                             "setups' current sources and mismatch notes, without predicting")
    args = parser.parse_args(argv)
    setups = QUICK if args.quick else HELDOUT if args.which == "heldout" else (*SETUPS, *RATIO_SETUPS)
    if args.only:
        setups = tuple(s for s in setups if s.key in args.only)
    args.out = args.out or ROOT / "runs" / f"bench_{args.which}"
    results = recorded(args.recorded, setups) if args.recorded else predict_all(setups)
    figures = summary(results, () if args.quick or args.which == "heldout" else OVERHEADS)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({
        "figures": figures, "results": {k: {**asdict(r), "setup": asdict(r.setup)} for k, r in results.items()}},
        indent=1), encoding="utf-8")
    text = table(results, figures, device_lines(setups), versions(), sum(r.estimate_s for r in results.values()),
                 args.which)
    print(text)
    if not (args.no_docs or args.quick or args.only):
        write_section(ROOT / "docs" / "benchmarks_time.md", args.which, text)
    return 0 if all(r.predicted for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
