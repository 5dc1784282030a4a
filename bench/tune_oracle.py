"""The search judged without noise: `ckrun tune`'s own search code, its probes answered by an oracle.

The oracle is ckrun's predictor (runner/predict): each plan's peak (CUDA context included) and
its step time on H100, A100-40GB and L4 device facts, computed once and cached, so every answer
is a fixed number. For each problem (BERT-large, GPT-2 medium, a 1B Llama, ViT-L/16, ResNet-50)
every plan of the tuner's space (the grid) is scored; for each device three caps are set, their
limits (cap minus the 5 % margin) 15 %, 50 % and 85 % of the way from the grid's smallest peak to
its largest (or to the card's memory); then `ckrun.autotune.search.run.search`, the code `ckrun tune` runs,
searches with a quarter of the grid's probes in all (the finalists' re-runs included), its
probes answered by the oracle, and again with seeded +-3 % noise on each answer's throughput.

The search sees what it sees on a GPU: predicted peaks for screening, the solver's per-block
plans (block times predicted for the device), and, with --guided, predicted step times that order
its starting points. Without --guided (the default) it gets no times: the table then measures the
search itself, not the time model's agreement with itself.

    python bench/tune_oracle.py                          # every problem, device and cap (hours at first: the oracle)
    python bench/tune_oracle.py --problems bert_large --devices h100
    python bench/tune_oracle.py --quick --out /tmp/oracle   # a tiny BERT: seconds, a smoke run

Writes OUT/oracle-PROBLEM.json (the cached oracle), OUT/results.json and, unless --quick, the
section between the markers in docs/benchmarks_tune.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from ckrun.autotune.cap import Cap
from bench.doc_sections import write_section
from ckrun.autotune.probes.model_child import model_facts
from ckrun.autotune.search.predicted import CONTEXT_BYTES
from ckrun.autotune.records import ProbeResult
from ckrun.autotune.records import ranked_feasible
from ckrun.autotune.search.run import SearchSettings, search
from ckrun.autotune.space.candidate import Candidate
from ckrun.autotune.space.facts import Device, ModelFacts
from ckrun.autotune.space.knobs import build_space, describe
from ckrun.autotune.space.pool_knobs import POOL_KNOBS
from ckrun.autotune.search.study import Budget, Prediction, open_study
from ckrun.autotune.search.tuner import FINALIST_RUNS
from ckrun.runner.disk.files import write_atomic
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.estimate import EstimateUnavailable, Estimator
from ckrun.runner.predict.hardware import GPUS
from ckrun.runner.problems import first_line
from ckrun.runner.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = {  # name: (recipe, overrides, knobs pinned: none, the tuner's whole space)
    "bert_large": ("recipes/bert_large.yaml", [], {}),
    "gpt2_medium": ("recipes/gpt2.yaml", ["model.config.n_layer=24", "model.config.n_embd=1024",
                                          "model.config.n_head=16"], {}),
    "llama_1b": ("recipes/llama_1b.yaml", [], {}),
    "vit_l_16": ("recipes/vit_l_16.yaml", [], {}),
    "resnet50": ("recipes/resnet50.yaml", [], {}),  # BatchNorm: tune keeps the recipe's micro-batch
}
QUICK = {"tiny_bert": ("recipes/bert_tiny.yaml", [  # 4 blocks, batch 16: 30 plans, so a quarter is a search
    "model.config.num_hidden_layers=4", "model.config.hidden_size=64", "model.config.intermediate_size=256",
    "model.config.vocab_size=1024", "data.seq_len=128", "train.batch_size=16", "precision=bf16"],
    {"allocator": "default", "offload": "none", "pools": "the recipe's"})}  # 30 plans: the pools' knobs pinned
DEVICES = ("h100", "a100-40gb", "l4")
CAPS = {"tight": 0.15, "middle": 0.5, "loose": 0.85}
MARGIN, SHARE, NOISE, FINALISTS = 0.05, 4, 0.03, 1

log = logging.getLogger("tune_oracle")


class Oracle:
    """Fixed answers per plan, cached in `path`: the peak (sm90 bytes, CUDA context added) and the
    step time on each device, from one fake step priced on each (`Estimate.time_on`)."""

    def __init__(self, recipe, path: Path, devices: tuple[str, ...]):
        self.recipe, self.path, self.devices = recipe, path, devices
        self.answers = json.loads(path.read_text()) if path.exists() else {}
        self.estimator, self.unsaved = None, 0
        self.frontiers: dict[str, dict] = {}  # (device, request) -> the solver's answer: the same for every run
        self.solver_estimators: dict[str, Estimator] = {}  # block times predicted for each device

    def answer(self, candidate: Candidate) -> dict:
        if candidate.key not in self.answers or set(self.devices) - set(self.answers[candidate.key].get("times", {})):
            self.answers[candidate.key] = self._predict(candidate)
            self.unsaved += 1
            if self.unsaved >= 10:
                self.save()
        return self.answers[candidate.key]

    def _predict(self, candidate: Candidate) -> dict:
        if self.estimator is None:
            self.estimator = Estimator(self.recipe, "cuda", GPUS[self.devices[0]])
        try:
            estimate = self.estimator.estimate(candidate.plan, candidate.precision)
        except (ValueError, EstimateUnavailable) as err:
            return {"invalid": first_line(err), "label": describe(candidate)}
        times = {name: estimate.time_on(GPUS[name]) for name in self.devices}
        return {"peak": estimate.peak_bytes + CONTEXT_BYTES, "label": describe(candidate),
                "times": {name: {"seconds": t.seconds, "samples_per_s": t.samples_per_s} for name, t in times.items()}}

    def save(self) -> None:
        write_atomic(self.path, json.dumps(self.answers))
        self.unsaved = 0


class OraclePredictor:
    """What the search's predictor gives it: peaks to screen by, the solver's plans, and (guided)
    step times to order its starting points by."""

    def __init__(self, oracle: Oracle, device: str, guided: bool):
        self.oracle, self.device, self.guided = oracle, device, guided

    def __call__(self, candidate: Candidate) -> Prediction:
        answer = self.oracle.answer(candidate)
        if "invalid" in answer:
            return Prediction(None, f"unscreened: {answer['invalid']}")
        return Prediction(answer["peak"], time=answer["times"][self.device] if self.guided else None)

    def frontier(self, request: dict) -> dict:
        from ckrun.autotune.search.solver import frontier

        key = json.dumps([self.device, request], sort_keys=True)
        if key not in self.oracle.frontiers:
            estimators = self.oracle.solver_estimators
            if self.device not in estimators:  # block times predicted for this device
                estimators[self.device] = Estimator(self.oracle.recipe, "cuda", GPUS[self.device])
            proposals, lines = frontier(estimators[self.device], [tuple(p) for p in request["pairs"]],
                                        int(request["limit"]), MemoryPlan.model_validate(request["base"]),
                                        bool(request["offload"]), 0)
            self.oracle.frontiers[key] = {"status": "ok", "proposals": [p.record() for p in proposals], "lines": lines}
        return self.oracle.frontiers[key]

    def summary(self) -> dict:
        return {"state": "on", "reason": "", "faults": [], "warnings": []}


def problem_space(recipe, pins: dict):
    """The space `ckrun tune` searches for `recipe` on a GPU, less the knobs `pins` fixes."""
    facts = GPUS["h100"]
    device = Device("cuda", facts.name, facts.memory_bytes, ("fp32", "bf16", "fp16"), torch.__version__, None,
                    CONTEXT_BYTES)
    space = build_space(recipe, ModelFacts.from_json(model_facts(recipe)), device)
    pins = dict(pins)
    if pins.pop("pools", None):  # the weights', optimizer's and loss's knobs at the recipe's own settings
        own = Candidate(recipe.memory, recipe.precision)
        pins.update({knob.name: knob.from_plan(own, space) for knob in POOL_KNOBS})
    for name, value in pins.items():
        space.choices.pop(name, None)
        space.fixed[name] = value
    return device, space


def grid_answers(oracle: Oracle, space) -> list[dict]:
    rows = []
    for number, params in enumerate(space.all_params()):
        candidate = space.candidate(params)
        rows.append({"key": candidate.key, **oracle.answer(candidate)})
        if number % 25 == 0:
            log.info("oracle: %d/%d plans", number + 1, space.size)
    oracle.save()
    return rows


def caps(rows: list[dict], memory_bytes: int) -> dict[str, Cap]:
    peaks = [r["peak"] for r in rows if "peak" in r]
    low, high = min(peaks), min(max(peaks), int(memory_bytes * (1 - MARGIN)))
    return {name: Cap(min(int((low + share * (high - low)) / (1 - MARGIN)), memory_bytes), MARGIN)
            for name, share in CAPS.items()}


def best(rows: list[dict], device: str, limit: int | None) -> dict | None:
    fitting = [r for r in rows if "peak" in r and (limit is None or r["peak"] <= limit)]
    return max(fitting, key=lambda r: r["times"][device]["samples_per_s"], default=None)


def run_search(recipe, pins: dict, oracle: Oracle, device: str, cap: Cap, probes: int, noise_seed: int | None,
               guided: bool = False) -> dict:
    """The tuner's search with the oracle answering its probes; the plan it picks and what it cost."""
    facts, rng = GPUS[device], random.Random(noise_seed)
    target, space = problem_space(recipe, pins)
    target = Device("cuda", facts.name, facts.memory_bytes, target.precisions, target.torch, None, CONTEXT_BYTES)

    def evaluate(candidate: Candidate, number: int) -> ProbeResult:
        answer = oracle.answer(candidate)
        if "invalid" in answer:
            return ProbeResult(status="crash", reason=answer["invalid"], probe_s=1.0)
        speed = answer["times"][device]["samples_per_s"]
        if noise_seed is not None:
            speed *= 1 + rng.uniform(-NOISE, NOISE)
        return ProbeResult(status="ok", measured_peak_bytes=answer["peak"], samples_per_s=speed, probe_s=1.0,
                           device=facts.name, device_total_bytes=facts.memory_bytes, torch=torch.__version__)

    finalists = FINALISTS if probes > 2 * FINALISTS * (FINALIST_RUNS - 1) + 2 else 0
    budget = Budget(trials=max(1, probes - 2 * finalists * (FINALIST_RUNS - 1)))
    with tempfile.TemporaryDirectory() as directory:
        study, fresh = open_study(Path(directory), {"cap": cap.bytes}, False)
        records = search(study, fresh, recipe, space, cap, target, budget, evaluate,
                         OraclePredictor(oracle, device, guided), SearchSettings(0, finalists, timed_steps=0))
    ranked = ranked_feasible(records)
    solver = next((r for r in records if r.proposed_by == "solver"), None)
    return {"winner": ranked[0].key if ranked else None,
            "probes": sum(1 for r in records if r.probe_s and r.state != "duplicate"),
            "solver_first": solver.key if solver else None}


def score(oracle: Oracle, rows: list[dict], device: str, cap: Cap, found: dict) -> dict:
    """The picked plan's true (oracle) throughput over the best the grid holds under the cap."""
    top = best(rows, device, cap.limit)
    speed = lambda key: oracle.answers[key]["times"][device]["samples_per_s"] if key else 0.0  # noqa: E731
    true_fit = found["winner"] is not None and oracle.answers[found["winner"]]["peak"] <= cap.limit
    return {"best": top["label"] if top else None, "best_speed": top["times"][device]["samples_per_s"] if top else 0.0,
            "winner": oracle.answers[found["winner"]]["label"] if found["winner"] else None,
            "ratio": speed(found["winner"]) / top["times"][device]["samples_per_s"] if top and true_fit else 0.0,
            "solver_ratio": speed(found["solver_first"]) / top["times"][device]["samples_per_s"]
            if top and found["solver_first"] else None,
            "probes": found["probes"]}


def bench_problem(name: str, problem: tuple, out: Path, devices: tuple[str, ...], guided: bool,
                  oracle_only: bool = False) -> list[dict]:
    recipe_path, overrides, pins = problem
    recipe = load_recipe(ROOT / recipe_path, overrides)
    oracle = Oracle(recipe, out / f"oracle-{name}.json", devices)
    _, space = problem_space(recipe, pins)
    started = time.monotonic()
    rows = grid_answers(oracle, space)
    log.info("oracle: %s: %d plans in %.0f s", name, len(rows), time.monotonic() - started)
    if oracle_only:
        return []
    results = []
    for device in devices:
        for cap_name, cap in caps(rows, GPUS[device].memory_bytes).items():
            probes = len(rows) // SHARE
            quiet = score(oracle, rows, device, cap, run_search(recipe, pins, oracle, device, cap, probes, None, guided))
            noisy = score(oracle, rows, device, cap, run_search(recipe, pins, oracle, device, cap, probes, 7, guided))
            results.append({"problem": name, "device": device, "cap_name": cap_name, "cap": cap.bytes,
                            "grid": len(rows), "quiet": quiet, "noisy": noisy,
                            "uncapped": best(rows, device, None)["times"][device]["samples_per_s"]})
            log.info("%s %s %s: tuned/best %.3f (noise %.3f), %d/%d probes", name, device, cap_name,
                     quiet["ratio"], noisy["ratio"], quiet["probes"], len(rows))
    oracle.save()
    return results


def markdown(results: list[dict], run: dict) -> str:
    met = [r for r in results if min(r["quiet"]["ratio"], r["noisy"]["ratio"]) >= 0.98
           and max(r["quiet"]["probes"], r["noisy"]["probes"]) * SHARE <= r["grid"]]
    lines = ["## The search against an oracle (no noise; the measure of search quality)", "",
             f"`python bench/tune_oracle.py{run['flags']}` on {run['started']} ({run['minutes']:.0f} min), "
             f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}. The oracle is "
             "ckrun's own predictor (peak with the CUDA context, roofline step time on each device's datasheet "
             "facts; bytes for sm90): fixed numbers, so a ratio below 1 is the search's doing, not the machine's. "
             f"Each search has a quarter of the grid's probes in all ({FINALISTS} finalist measured "
             f"{FINALIST_RUNS} times included); `noise`: the same search with seeded +-{NOISE:.0%} on every "
             f"answer's throughput. Time guidance {'on (--guided)' if run['guided'] else 'off: the search gets peaks, not times'}.",
             "", f"Goal: tuned / best >= 0.98 within a quarter of the grid, with and without noise: met in "
             f"{len(met)} of {len(results)}.", "",
             "| problem | device | cap | grid | probes | tuned / best | with noise | solver's first / best | best plan under the cap | tuned plan |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        q, n = r["quiet"], r["noisy"]
        solver = f"{q['solver_ratio']:.3f}" if q["solver_ratio"] is not None else "none proposed"
        lines.append(f"| {r['problem']} | {r['device']} | {r['cap_name']} {format_bytes(r['cap'])} | {r['grid']} "
                     f"| {max(q['probes'], n['probes'])} | {q['ratio']:.3f} | {n['ratio']:.3f} | {solver} "
                     f"| {q['best']} | {'the same' if q['winner'] == q['best'] else q['winner']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", nargs="+", choices=list(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--devices", nargs="+", choices=DEVICES, default=list(DEVICES))
    parser.add_argument("--out", type=Path, default=ROOT / "runs/bench_oracle")
    parser.add_argument("--guided", action="store_true", help="give the search the oracle's step times as predictions")
    parser.add_argument("--quick", action="store_true", help="a tiny BERT on one device: seconds; nothing goes to docs/")
    parser.add_argument("--oracle-only", action="store_true", help="fill the oracle caches, search nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for name in ("ckrun", "optuna"):
        logging.getLogger(name).setLevel(logging.WARNING)  # the searches' own lines: thousands
    args.out.mkdir(parents=True, exist_ok=True)
    problems = QUICK if args.quick else {k: PROBLEMS[k] for k in args.problems}
    devices = tuple(args.devices[:1] if args.quick else args.devices)
    started, clock = time.strftime("%Y-%m-%d %H:%M %Z"), time.monotonic()
    results = [row for name, problem in problems.items()
               for row in bench_problem(name, problem, args.out, devices, args.guided, args.oracle_only)]
    if args.oracle_only:
        return []
    write_atomic(args.out / "results.json", json.dumps(results, indent=1))
    flags = "".join(f" {flag}" for flag in ((argv or []) if argv is not None else []))
    run = {"started": started, "minutes": (time.monotonic() - clock) / 60, "guided": args.guided, "flags": flags}
    text = markdown(results, run)
    if not args.quick:
        write_section(ROOT / "docs/benchmarks_tune.md", "tune_oracle", text)
    print(text)
    return results


if __name__ == "__main__":
    main()
