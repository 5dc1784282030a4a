"""`ckrun show RECIPE --costs [--json]`: each block's bytes and recompute time per plan choice."""

from __future__ import annotations

import json

import torch

from ..problems import InputError, Place, Problem, keyed_error
from .estimate import _plan_lines_quiet

TIMED_STEPS = 2  # a short run: enough to rank blocks, not a benchmark


def print_costs(recipe, source: str, as_json: bool) -> int:
    """The cost table at the recipe's own micro-batch and precision, on the device it trains on."""
    from ..predict.block_costs import cost_table, format_table
    from ..predict.estimate import EstimateUnavailable, Estimator

    cuda = recipe.train.device == "cuda" or (recipe.train.device == "auto" and torch.cuda.is_available())
    try:
        with _plan_lines_quiet():
            table = cost_table(Estimator(recipe, "cuda" if cuda else "cpu"), recipe.micro_batch, recipe.precision,
                               TIMED_STEPS)
    except EstimateUnavailable as err:
        raise InputError([Problem(Place(source), "model", f"per-block costs are unavailable: {err}")]) from None
    except ValueError as err:
        raise keyed_error(err, source, "memory") from None
    print(json.dumps(table.record()) if as_json else format_table(table))
    return 0
