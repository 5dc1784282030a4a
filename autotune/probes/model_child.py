"""The model child: the one place `ckrun tune` runs the user's model outside a probe.

The tuner needs two things from the model before and while it searches: its facts (the repeated
blocks a plan acts on, and the layers that make micro-batching inexact) and, for screening, a
predicted peak per plan. Both run the user's code (the factory; the forward, on fake tensors), so
both happen here, in a child that leads its own process group, never in the tuner: a hang, a
segfault or an `os._exit` in the user's code then costs a timeout and a line in the report.

    python -m ckrun.autotune.probes.model_child RECIPE.json DIR --parent PID --device cpu|cuda [--nproc N] [--facts-only]
        [--time-facts FACTS.json]

Protocol (files are written atomically; the tuner waits for each with a timeout):
1. DIR/facts.json: `model_facts` of the model built on the meta device (its blocks, the layers that
   see the micro-batch, its tensor-parallel plan: autotune/space/tp_facts.py).
2. Unless --facts-only, DIR/ready.json once the estimator is built and its warm-up step ran.
3. Then one request per line on stdin, `{"id": N, **Candidate.request()}` (plan, precision and the
   `distributed:` section, null for one process: autotune/space/candidate.py), each answered in
   DIR/answer-N.json (with --nproc N, the peak of one of N ranks under that strategy:
   runner/predict/per_rank.py); with --time-facts (a device's
   `ckrun.runner.predict.hardware.DeviceFacts`), the answer's `time` holds the step's predicted time on
   it (`StepTime.record()`). End of input ends the child. A request with `"frontier": {"pairs":
   [[micro_batch, precision], ...], "limit": BYTES, "offload": bool, "timed_steps": K, "base": {plan},
   "context": BYTES (added back in its lines), "deadline": T (time.monotonic() to stop at, or null)}`
   instead asks for the solver's per-block plans (`ckrun.autotune.search.solver.frontier`, which times blocks in a
   short real run): answered with `proposals` (Proposal records) and `lines` (its reasons).
Every answer has a `status` ("ok", "bad_input", "unavailable" or "crash") and, unless ok, a
one-line `reason`. The child leaves with `os._exit` after its last answer: the tuner never waits
for an interpreter teardown that user code (atexit hooks, threads) could hold up.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import traceback
from pathlib import Path

from ckrun.runner.disk.files import write_atomic

from ckrun.runner.problems import first_line

from .child import die_with_parent, recipe_from_json, finish


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    die_with_parent(args.parent)
    requests = os.fdopen(os.dup(0), "r", encoding="utf-8")  # the tuner's channel; user code gets no stdin
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    directory = Path(args.directory)
    recipe = recipe_from_json(Path(args.recipe).read_text(encoding="utf-8"))
    facts = facts_answer(recipe, args.nproc)
    write_atomic(directory / "facts.json", json.dumps(facts))
    if args.facts_only or facts["status"] != "ok":
        return 0
    estimator = None

    def build() -> dict:
        nonlocal estimator
        from ckrun.runner.predict.estimate import Estimator

        if args.nproc > 1:
            estimator = _ranks(recipe, args.nproc, args.device, _time_facts(args.time_facts))
        else:
            estimator = Estimator(recipe, args.device, _time_facts(args.time_facts))
        return {"status": "ok"}

    write_atomic(directory / "ready.json", json.dumps(_answer(build, expected=_unavailable())))
    if estimator is None:
        return 0
    for line in requests:
        request = json.loads(line)
        work = _frontier if "frontier" in request else functools.partial(_predict, nproc=args.nproc)
        answer = _answer(functools.partial(work, estimator, request), expected=_unavailable())
        write_atomic(directory / f"answer-{request['id']}.json", json.dumps(answer))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ckrun.autotune.probes.model_child")
    parser.add_argument("recipe", help="the recipe as JSON")
    parser.add_argument("directory", help="where facts.json, ready.json and answer-N.json go")
    parser.add_argument("--parent", type=int, required=True, help="the tuner's pid; its death ends this process")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device to predict for")
    parser.add_argument("--nproc", type=int, default=1, help="predict one rank of N (tune --nproc)")
    parser.add_argument("--facts-only", action="store_true", help="report the facts and exit: no screening")
    parser.add_argument("--time-facts", metavar="FILE", help="a device's facts (JSON): predict step times on it too")
    return parser


def _time_facts(path: str | None):
    if path is None:
        return None
    from ckrun.runner.predict.hardware import load_facts

    return load_facts(Path(path))


def model_facts(recipe, nproc: int = 1) -> dict:
    """The blocks plans act on (names and containers), the modules whose result depends on the
    micro-batch (BatchNorm normalises over it, dropout draws its masks per micro-batch), and which
    tensor sizes of `nproc` ranks the model's own tensor-parallel plan splits."""
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm

    from ckrun.runner.builders.model import BuildError, build_model
    from ckrun.runner.memory.blocks import find_blocks

    from ..space.tp_facts import tensor_facts

    model = build_model(recipe.model, device="meta", weights=False)  # nothing is allocated or read; CUDA is not touched
    try:
        blocks = find_blocks(model, recipe.memory.blocks)
    except ValueError as err:
        raise BuildError("memory.blocks", str(err).removeprefix("memory.blocks: ")) from None
    named = list(model.named_modules())
    return {"container_name": blocks.container_name, "blocks": [block.name for block in blocks],
            "containers": list(blocks.containers),
            "batchnorm": [name for name, module in named if isinstance(module, _BatchNorm)],
            "dropout": [name for name, module in named
                        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0],
            "tensor_parallel": tensor_facts(model, nproc), "parameters": parameter_facts(model),
            "loss_split": _head_refusal(model)}


def _head_refusal(model) -> str | None:
    """Why memory.loss chunked cannot split the model's head (one line), or None where it can."""
    from ckrun.runner.memory.chunked_loss import output_projection

    try:
        output_projection(model)
    except ValueError as err:
        return str(err)
    return None


def parameter_facts(model) -> dict:
    """What the pools' lower bound reads (ckrun.runner.memory.floor): every parameter's count and bytes as
    built, the trainable ones' (they have gradients and optimizer state) and the largest trainable one."""
    from dataclasses import asdict

    from ckrun.runner.memory.floor import ParameterFacts

    return asdict(ParameterFacts.of(model))


def facts_answer(recipe, nproc: int = 1) -> dict:
    """The model's facts, once the user's code passes the checks the tuner leaves to this child."""
    from ckrun.runner.builders.checks import user_code_problems

    problems = user_code_problems(recipe)
    if problems:
        return {"status": "bad_input", "key": problems[0].key, "reason": problems[0].message,
                "problems": [[problem.key, problem.message] for problem in problems]}
    return _answer(lambda: {"status": "ok", **model_facts(recipe, nproc)}, expected=())


def _predict(estimator, request: dict, nproc: int = 1) -> dict:
    from ..space.candidate import Candidate

    candidate = Candidate.from_request(request)
    if nproc > 1:
        estimate = _rank_estimate(estimator, candidate, nproc)
    else:
        estimate = estimator.estimate(candidate.plan, candidate.precision)
    return {"status": "ok", "peak_bytes": int(estimate.peak_bytes), "warnings": list(estimate.warnings),
            "time": estimate.time.record() if estimate.time else None}


class _Ranks:
    """tune --nproc: one `RankPredictor` answers every request, so what no plan changes (the fake process
    group, each layout's split model and warmed-up optimizer) is made once (runner/predict/per_rank.py)."""

    def __init__(self, recipe, nproc: int, device: str, facts):
        from ckrun.runner.predict.per_rank import RankPredictor

        self.recipe, self.predictor = recipe, RankPredictor(nproc, device, facts)


def _ranks(recipe, nproc: int, device: str, facts) -> _Ranks:
    """Ready once the layout the tuner tries first is built and warmed up: the recipe's own strategy, or
    ddp for strategy none (every rank a share of the batch, as `check_world` reads none under --nproc)."""
    from ckrun.runner.predict.per_rank import rank_share
    from ckrun.runner.plan.strategies import SingleProcess, strategy_from_label

    ranks = _Ranks(recipe, nproc, device, facts)
    first = recipe.model_copy(update={"distributed": strategy_from_label("ddp")}) \
        if isinstance(recipe.distributed, SingleProcess) else recipe
    ranks.predictor.estimator(rank_share(first, nproc))
    return ranks


def _rank_estimate(ranks: _Ranks, candidate, nproc: int):
    """One rank's peak: the candidate's recipe (plan, precision, strategy) estimated as `ckrun estimate
    --nproc` does, on the kept estimator of its layout."""
    return ranks.predictor.estimate(candidate.recipe(ranks.recipe, None))


def _frontier(estimator, request: dict) -> dict:
    from ..search.solver import answer_request

    return answer_request(estimator, request["frontier"])


def _unavailable() -> tuple[type, ...]:
    from ckrun.runner.predict.estimate import EstimateUnavailable

    return (EstimateUnavailable, ValueError)  # fake tensors cannot run it, or the plan does not apply


def _answer(work, expected: tuple[type, ...]) -> dict:
    """Every failure as an answer the tuner records: a bad recipe key is bad input, an `expected`
    failure means no prediction, anything else is the user's code crashing; each in one line."""
    from ckrun.runner.builders.model import BuildError
    from ckrun.runner.problems import InputError

    try:
        return work()
    except BuildError as err:
        return {"status": "bad_input", "key": err.key, "reason": str(err)}
    except InputError as err:
        return {"status": "bad_input", "key": "", "reason": "; ".join(str(p) for p in err.problems)}
    except expected as err:
        return {"status": "unavailable", "reason": first_line(err)}
    except Exception as err:  # user code may raise anything: the tuner decides what it costs
        traceback.print_exc()
        return {"status": "crash", "reason": f"{type(err).__name__}: {first_line(err)}"}


if __name__ == "__main__":
    finish(main())
