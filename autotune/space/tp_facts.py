"""What the tuner must know of a model to offer tensor parallelism (`tp:T` under `tune --nproc N`).

`distributed: {strategy: tp}` without a `plan` splits the layers the transformers model's own plan
names (its config's `base_model_tp_plan`). Whether it can, for each tensor size T the world size
offers, is runner/builders/tensor_plan.py's to say (a plan at all, styles ckrun applies, patterns
that match linear layers, features and attention heads that split over T): the model child asks it
on the meta-device model (`tensor_facts`), and the space reads the answers back (`TensorFacts`)
without building anything, so the tuner never offers a tp the recipe checks would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorFacts:
    """Per tensor size, why the model's own plan cannot split it over that many ranks (None: it can)."""

    model: str  # the model's class name, for the log
    problems: dict[int, str | None] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict) -> TensorFacts:
        return cls(data["model"], {int(size): problem for size, problem in data.get("problems", {}).items()})

    def problem(self, tensor: int) -> str | None:
        if tensor not in self.problems:
            return f"the model's facts say nothing of {tensor} ranks a tensor group"
        return self.problems[tensor]


def tensor_facts(model, nproc: int) -> dict:
    """`TensorFacts` of a built (meta-device) model for the tensor sizes `nproc` ranks offer, as JSON:
    the first problem runner/builders/tensor_plan.py finds with the model's own plan at each size."""
    from ckrun.runner.builders.tensor_plan import resolve
    from ckrun.runner.plan.strategies import TensorParallel, strategy_from_label

    problems = {}
    for label in TensorParallel.tuner_labels(nproc):
        strategy = strategy_from_label(label)
        found = resolve(model, strategy)[1]
        problems[strategy.tensor] = found[0].message if found else None
    return {"model": type(model).__name__, "problems": problems}
