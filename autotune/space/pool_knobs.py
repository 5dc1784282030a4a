"""The tuner's knobs for the pools beside the activations (runner/plan/pool_policies.py): weights, optimizer
state, optimizer step, optimizer offload and the loss, one `Knob` each in autotune/space/knobs.py's table.

Each is searched over its policy types' own tuner labels where this device, the recipe and the rules
of runner/plan/memory_plan.py allow; each choice left out is logged with its reason. Exact policies are searched
by default; lossy ones (bf16 weights, low-bit optimizer state) only with --allow-lossy (the flag of
the compression knob, which opens every lossy knob), and a plan holding one carries
memory.allow_lossy, so tuned.yaml shows it. A lossy winner's measured update error goes to tuned.yaml
(`lossy_comment`), from its probe's record.

The starting points take one pool setting (`start_settings`): the one with the fewest changes from
the pools' defaults whose lower bound (autotune/space/pool_floor.py) leaves room for the activations, else the
one with the least bound; the solver plans its blocks on top of the same setting (autotune/search/frontier.py).
Where that setting offloads the optimizer's update to the host and --allow-lossy opened pools that leave
the activations room on the device, the starting points are made with one of those too
(`Space.pool_alternatives`): the search then starts from both kinds of step.
"""

from __future__ import annotations

import logging
from functools import partial

from ckrun.runner.plan.choices import choice_class, choice_fields
from ckrun.runner.plan.memory_plan import MemoryPlan, plan_problems
from ckrun.runner.plan.policy_base import library_missing
from ckrun.runner.plan.pool_policies import (BF16Weights, ChunkedLoss, LowBitState, MasterWeights,
                                        POOL_KINDS, StepInBackward)
from ckrun.runner.units import format_bytes

from .pool_floor import Bound, default_label, least, nothing_fits_line, pool_floor, pool_plan, settings
from .space import Asked, Knob, Space, later_choices

log = logging.getLogger(__name__)

LOSSY_KNOB = "compression"  # the knob whose flag (--allow-lossy) opens every lossy knob
ROOM = 0.8  # a start's pool setting leaves a fifth of the limit for activations, the batch and the allocator's cache
SECTIONS = tuple(POOL_KINDS)  # one knob per pool, in the table's order (runner/plan/pool_policies.py)


def _own(asked: Asked, section: str) -> str:
    return getattr(asked.recipe.memory, section).label()


def _join(space: Space, asked: Asked, section: str, exact: list[str], lossy: list[str], why: str) -> None:
    """`section`'s choices: the exact labels, the lossy ones when --allow-lossy opened them, and the
    recipe's own (a lossy one of the recipe's without the flag pins the knob, as compression's does)."""
    own, opened = _own(asked, section), LOSSY_KNOB in asked.opened
    own_lossy = choice_class(POOL_KINDS[section], own).lossy
    if own_lossy and not opened:
        space.fixed[section] = own
        space.reasons.append(f"{section} pinned to the recipe's {own}: it is lossy (memory.allow_lossy); "
                             "--allow-lossy searches the lossy choices")
        return
    labels = list(dict.fromkeys([*exact, *(lossy if opened else []), own]))
    if len(labels) == 1:
        space.fixed[section] = labels[0]
        space.reasons.append(f"{section} not searched ({labels[0]}): {why}")
        return
    space.choices[section] = labels
    lossy_words = (f"; lossy {[l for l in labels if l in lossy]} (--allow-lossy): each such plan's update error "
                   "is measured in its probe") if opened and lossy else \
        (f"; --allow-lossy also searches {lossy}" if lossy else "")
    space.reasons.append(f"{section} in {labels}: {why}{lossy_words}")


def add_weights(space: Space, asked: Asked) -> None:
    precisions = space.choices.get("precision") or [space.fixed.get("precision", asked.recipe.precision)]
    half = any(p != "fp32" for p in precisions)
    exact = MasterWeights.tuner_labels("bf16" if half else "fp32")
    lossy = BF16Weights.tuner_labels() if "bf16" in precisions and asked.recipe.step_facts().adamw else []
    why = ("fp32 masters; fp32:uncached drops autocast's cast copies between a checkpointed block's forward and "
           "its backward" if half else "the run computes in fp32: no cast copies to drop")
    _join(space, asked, "weights", exact, lossy, why + _lossy_missing(BF16Weights, asked, "bf16"))


def add_optimizer_state(space: Space, asked: Asked) -> None:
    lossy = [label for label in LowBitState.tuner_labels() if not _low_bit(label).unsupported()] \
        if asked.recipe.step_facts().adamw else []
    why = "AdamW's moments as the recipe's optimizer keeps them" if asked.recipe.step_facts().adamw else \
        f"train.optimizer {asked.recipe.train.optimizer.name} is not ckrun's adamw, which the low-bit states replace"
    _join(space, asked, "optimizer_state", ["full"], lossy, why + _lossy_missing(LowBitState, asked, "8bit"))


def add_optimizer_step(space: Space, asked: Asked) -> None:
    facts = asked.recipe.step_facts()
    why_not = ("train.grad_clip is set (global clipping needs every gradient first)" if facts.grad_clip else
               "precision fp16's loss scaler must see every gradient first" if space.fixed.get("precision") == "fp16"
               else None)
    exact = ["after"] if why_not else ["after", StepInBackward(policy="in_backward").label()]
    why = (f"in_backward left out: {why_not}" if why_not else
           "in_backward updates each parameter as its gradient is accumulated (exact; a plan of several "
           "micro-batches with it" + (", or with ddp, whose gradients are averaged after that," if asked.nproc > 1
                                      else "") + " is told invalid)")
    _join(space, asked, "optimizer_step", exact, [], why)


def add_optimizer_offload(space: Space, asked: Asked) -> None:
    why_not = (f"the run is on the {asked.device.kind}: there is no device memory to free" if asked.device.kind != "cuda"
               else "--nproc: the ranks' host offload is FSDP2's own, the sharding knob's cpu "
               "(memory.sharding.offload)" if asked.nproc > 1
               else "precision fp16's loss scaler unscales gradients on the device"
               if space.fixed.get("precision") == "fp16" else None)
    exact = ["none"] + ([] if why_not else [label for cls in POOL_KINDS["optimizer_offload"] if cls.active
                                            for label in cls.tuner_labels(asked.device.kind)])
    why = why_not or ("cpu:F keeps the optimizer state and update of a fraction F of the parameters in host memory, "
                      "master the float32 master weights too, with bf16 weights on the device (precision bf16); "
                      "exact, the host's step priced at its AdamW rate and the copies at the host link's")
    _join(space, asked, "optimizer_offload", exact, [], why)


def add_loss(space: Space, asked: Asked) -> None:
    refusal = asked.facts.loss_split
    exact = ["whole"] + ([] if refusal else ChunkedLoss.tuner_labels())
    why = refusal or ("chunked:8 computes the head's logits and loss over 8 pieces of the sequence, each recomputed "
                      "in backward (exact up to summation order)")
    _join(space, asked, "loss", exact, [], why)


def add_pool(section: str, space: Space, asked: Asked) -> None:
    """A pool without an adder of its own in ADDERS: its policies' tuner labels, the exact ones searched,
    the lossy ones with --allow-lossy."""
    kind = POOL_KINDS[section]
    exact = [label for cls in kind if not cls.lossy for label in cls.tuner_labels()] or [default_label(section)]
    _join(space, asked, section, exact, lossy_labels(section), "its policies' tuner labels")


def lossy_labels(section: str) -> list[str]:
    """The tuner labels of the pool's lossy policies (none where their library is missing)."""
    return [label for cls in POOL_KINDS[section] if cls.lossy for label in cls.tuner_labels()]


def _low_bit(label: str) -> LowBitState:
    return LowBitState.model_validate(choice_fields(POOL_KINDS["optimizer_state"], label))


def _lossy_missing(cls, asked: Asked, label: str) -> str:
    why = library_missing(cls.library, f"memory.{cls.section}", label)
    return f"; lossy ones left out: {why.split(': ', 1)[1].split(':')[0]}" if why and LOSSY_KNOB in asked.opened else ""


# --- a point's part, read back, said -----------------------------------------------------------------


def to_plan(section: str, values: dict, space: Space) -> dict:
    """The section's policy; a lossy one carries memory.allow_lossy."""
    if section not in values:
        return {}
    kind = POOL_KINDS[section]
    fields = {section: choice_fields(kind, values[section])}
    return {"memory": {**fields, "allow_lossy": True} if choice_class(kind, values[section]).lossy else fields}


def from_plan(section: str, candidate, space: Space) -> str:
    return getattr(candidate.plan, section).label()


def words(section: str, candidate) -> str | None:
    policy = getattr(candidate.plan, section)
    if policy == MemoryPlan.model_fields[section].default_factory():
        return None
    return f"{section} {policy.label()}" + (" (lossy)" if policy.lossy else "")


def start(section: str, space: Space, recipe, predicted: bool) -> list[str]:
    return [start_settings(space)[section]]


def lossy_comment(section: str, space: Space, record) -> str | None:
    """tuned.yaml's line on a lossy winner's pool policy and its measured update error."""
    policy = getattr(MemoryPlan.model_validate(record.plan), section)
    if not policy.lossy:
        return None
    error = record.update_error
    measured = f"relative update error {error:.2e} against exact AdamW over its probe's first steps" \
        if error is not None else "update error not measured (predicted, not probed)"
    return (f"LOSSY: memory.{section} {policy.label()}: {measured}; leave memory.{section} out for exact "
            "training")


def pool_knob(section: str) -> Knob:
    return Knob(section, ADDERS.get(section, partial(add_pool, section)), partial(to_plan, section),
                partial(from_plan, section), partial(start, section), partial(words, section), joins=True,
                solver=True, note=partial(lossy_comment, section), lighter=later_choices(section))


ADDERS = {"weights": add_weights, "optimizer_state": add_optimizer_state, "optimizer_step": add_optimizer_step,
          "optimizer_offload": add_optimizer_offload, "loss": add_loss}
"""The pools whose choices depend on the device, the recipe or the ranks, with their adders; any other
pool of POOL_KINDS is searched over its policies' own tuner labels (`add_pool`)."""
POOL_KNOBS = tuple(pool_knob(section) for section in SECTIONS)


# --- the starting points' pool setting ---------------------------------------------------------------


def space_values(space: Space) -> dict[str, list[str]]:
    """Each pool knob's values in the space (its choices, or the one it is pinned to)."""
    return {s: list(space.choices.get(s, [space.fixed.get(s, default_label(s))])) for s in SECTIONS}


def start_settings(space: Space) -> dict[str, str]:
    """The pool setting of every starting point and of the solver's plans: computed once per space
    (module docstring), logged with its reason. Exact values first; where no exact setting leaves the
    activations room and --allow-lossy opened lossy ones, the lossy settings too (the options say what
    the starting points may be)."""
    if space.pool_start is not None:
        return space.pool_start
    values = space_values(space)
    whole = all(m >= space.batch_size for m in space.micro_batches())  # else in_backward makes starts invalid
    exact = {s: [label for label in v if not _lossy_or_unsafe(s, label, whole)] or v[:1] for s, v in values.items()}
    first = {s: v[0] for s, v in exact.items()}
    if space.bound is None:
        space.pool_start = first
        return first
    chosen, why = _roomy(exact, first, space)
    if chosen is None:
        allowed = {s: [label for label in v if not _unsafe(s, label, whole)] or v[:1] for s, v in values.items()}
        chosen, why = _roomy(allowed, first, space) if allowed != exact else (None, "")
        if chosen is not None:
            why = f"no exact setting leaves a fifth of the limit for activations, so the lossy ones (--allow-lossy): {why}"
        else:
            chosen, why = _least(allowed, space)
    space.pool_start = chosen
    changed = ", ".join(f"{s} {label}" for s, label in chosen.items() if label != first[s]) or "the pools as they are"
    log.info("space: starting points and the solver take %s: %s", changed, why)
    space.pool_alternatives = _on_the_device(values, chosen, first, whole, space)
    return chosen


def _on_the_device(values: dict[str, list[str]], chosen: dict[str, str], first: dict[str, str], whole: bool,
                   space: Space) -> list[dict[str, str]]:
    """Where the chosen setting moves the optimizer's update to the host (an order slower than the device's)
    and the values the options opened (--allow-lossy's) leave the activations room without it, that
    setting too: the starting points are then made with both, so the search starts from each kind of
    step, whatever it samples later."""
    offload = "optimizer_offload"
    if chosen.get(offload, "none") == "none" or "none" not in values.get(offload, []):
        return []
    kept = {s: [label for label in v if not _unsafe(s, label, whole)] or v[:1] for s, v in values.items()}
    kept[offload] = ["none"]
    bound = space.bound
    roomy = [(floor, labels) for labels in _allowed(kept, bound.step)
             if (floor := pool_floor(pool_plan(labels), bound.facts, bound.step, bound.context)).total <= ROOM * bound.limit]
    if not roomy:
        return []

    def lossy(labels: dict[str, str]) -> int:
        return sum(choice_class(POOL_KINDS[s], label).lossy for s, label in labels.items())

    # the fewest and mildest lossy values, and of the exact ones the strongest (a chunked loss, no cast cache): the
    # activations share the device with the pools the host no longer holds
    def strength(labels: dict[str, str], of_lossy: bool) -> int:
        return sum(kept[s].index(v) for s, v in labels.items() if choice_class(POOL_KINDS[s], v).lossy == of_lossy)

    floor, alternative = min(roomy, key=lambda f: (lossy(f[1]), strength(f[1], True), -strength(f[1], False),
                                                   f[0].total))
    if alternative == chosen:
        return []
    changed = ", ".join(f"{s} {label}" for s, label in alternative.items() if label != first[s])
    log.info("space: the starting points take %s too: the fewest, mildest lossy values whose lower bound %s leaves a fifth of "
             "the limit for activations with the optimizer's update on the device (the host's is an order slower), "
             "each exact one at its strongest", changed, format_bytes(floor.total))
    return [alternative]


def _roomy(values: dict[str, list[str]], first: dict[str, str], space: Space) -> tuple[dict | None, str]:
    """The setting of `values` with the fewest changes from `first` (then the milder values: each knob's
    choices go from mild to strong) whose lower bound leaves a fifth of the limit, or None."""
    facts, step, context, limit = space.bound.facts, space.bound.step, space.bound.context, space.bound.limit
    fitting = [(len([s for s in labels if labels[s] != first[s]]), sum(values[s].index(v) for s, v in labels.items()),
                floor.total, labels)
               for labels in _allowed(values, step) if (floor := pool_floor(pool_plan(labels), facts, step, context)).total
               <= ROOM * limit]
    if not fitting:
        return None, ""
    _, _, total, chosen = min(fitting, key=lambda f: f[:3])
    return chosen, f"the fewest changes whose lower bound {format_bytes(total)} leaves a fifth of the limit for activations"


def _allowed(values: dict[str, list[str]], step) -> list[dict[str, str]]:
    """The pools' settings among `values` that the plan's rules allow (runner/plan/memory_plan.py: no lossy state beside
    the host's optimizer, ...); all of them where none is."""
    every = settings(values)
    return [labels for labels in every if not plan_problems(pool_plan(labels), step)] or every


def _least(values: dict[str, list[str]], space: Space) -> tuple[dict, str]:
    """No setting leaves room: the least bound, and of those the strongest values (chunked loss, no cast
    cache: fewer activations); the starting points that save the most then come first (`space.tight`)."""
    facts, step, context = space.bound.facts, space.bound.step, space.bound.context
    floors = [(pool_floor(pool_plan(labels), facts, step, context), labels) for labels in _allowed(values, step)]
    floor, chosen = min(floors, key=lambda f: (f[0].total, -sum(values[s].index(v) for s, v in f[1].items())))
    space.tight = True
    return chosen, (f"no setting leaves a fifth of the limit for activations; the least bound, {floor.words()}, "
                    "with each knob's strongest value; the starting points that save the most are tried first")


def _lossy_or_unsafe(section: str, label: str, whole_batch: bool) -> bool:
    """Not for a start: lossy, or the step in backward where the starts' micro-batches split the batch."""
    return choice_class(POOL_KINDS[section], label).lossy or _unsafe(section, label, whole_batch)


def _unsafe(section: str, label: str, whole_batch: bool) -> bool:
    """The step in backward where the starts' micro-batches split the batch: every start would be invalid."""
    return getattr(choice_class(POOL_KINDS[section], label), "updates_in_backward", False) and not whole_batch


# --- the search's lower bound ------------------------------------------------------------------------


def bound_space(space: Space, recipe, facts, device, cap, nproc: int = 1) -> str | None:
    """Give `space` the pools' lower bound for this cap (none under --nproc, or without parameter
    facts), and return the one line that says nothing can fit when no pool setting of the space
    leaves any plan under the limit (naming what would), else None."""
    if facts.parameters is None or nproc > 1:
        log.info("space: no lower bound on the plans: %s", "--nproc shards the pools it counts" if nproc > 1 else
                 "the model child did not count the parameters")
        return None
    space.bound = Bound(facts.parameters, recipe.step_facts(), device.context_bytes, cap.limit)
    values = space_values(space)
    lossy = {section: lossy_labels(section) for section in SECTIONS} if recipe.step_facts().adamw else {}
    every = {s: list(dict.fromkeys([*v, *lossy.get(s, [])])) for s, v in values.items()}
    line = nothing_fits_line(values, every, space.bound, "--allow-lossy")
    labels, floor = least(values, facts.parameters, space.bound.step, device.context_bytes)
    log.info("space: every plan holds at least %s (its pools' lower bound, at their smallest: %s); a plan whose "
             "bound is over the limit %s is ruled out without a prediction", floor.words(),
             ", ".join(f"{s} {label}" for s, label in labels.items()), format_bytes(cap.limit))
    if line is not None:
        return f"nothing fits within {cap.describe()}: {line}"
    start_settings(space)  # now: whether the space is tight orders the other knobs' starts too
    return None
