"""The tuner's knobs, one `Knob` record each (autotune/space/space.py), in `KNOBS`: the one table the space,
its candidates, starting points, the solver's points, log lines, tuned.yaml's notes and `ckrun
tune`'s flags loop over. Each record says how its knob joins the space (the values searched, or the
value pinned, and the reason either way), how a value becomes the candidate's plan and is read back,
its starting values and its words in a log line.

Adding a knob: its field in runner/plan/memory_plan.py (with any rule on combining it in `plan_problems`), the
module that applies it (runner/memory/ or runner/train/), and here its adder and one `Knob(...)`
line in `KNOBS`. Its place in the table is its place in every log line; a new knob goes last, so
the choices of the knobs before it (and the sampler's draws over them) stay as they were.

Micro-batching changes what is computed where the model looks across samples: BatchNorm
normalises over each micro-batch, dropout draws its masks per micro-batch. The space says so in
its lines, and tuned.yaml in a comment (the micro-batch knob's note).
"""

from __future__ import annotations

import logging

from optuna.distributions import FloatDistribution

from ckrun.runner.plan.choices import choice_class, choice_fields
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.plan.policies import (CHECKPOINTING, AllBlocksOffload, COMPRESSION, EVERY_K, OFFLOAD, checkpointing_choices, compression_choices,
                             offload_choices)
from ckrun.runner.recipe.recipe import Recipe
from ckrun.runner.units import format_bytes

from .candidate import Candidate
from .facts import Device, ModelFacts
from .pool_knobs import POOL_KNOBS
from ..records import TrialRecord
from .sharding import SHARDING
from .space import UNSAID, Asked, Flag, Knob, Space, later_choices

PRECISIONS = ("fp32", "bf16", "fp16")
ALLOCATOR_SETTINGS = ("default", "expandable_segments:True")  # "default": PYTORCH_CUDA_ALLOC_CONF left alone
BUDGET_STEP = 0.1  # compile's activation_memory_budget: finer steps than this measure noise, not the knob

log = logging.getLogger(__name__)


# --- micro_batch ----------------------------------------------------------------------------------


def add_micro_batches(space: Space, asked: Asked) -> None:
    """The divisors of a rank's share; under --nproc of the largest share any strategy gives a rank
    (a tensor-parallel group's ranks see the same samples), so each strategy can run its whole share."""
    recipe_micro = asked.recipe.memory.micro_batch or space.batch_size
    largest = max(space.strategies, key=space.share, default=None)  # tp's groups see the most samples
    batch_size = space.share(largest)
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    if space.batchnorm and "micro_batch" not in asked.opened:
        space.fixed["micro_batch"] = recipe_micro
        space.reasons.append(f"micro_batch pinned to the recipe's {recipe_micro}: the model has BatchNorm "
                             f"({_layers(space.batchnorm)}), which normalises over each micro-batch, so another "
                             f"micro_batch would change what it computes (--search-micro-batch searches {divisors})")
        return
    space.choices["micro_batch"] = divisors
    whose = f"train.batch_size {batch_size}" if space.world_size == 1 else \
        f"a rank's share {batch_size} (train.batch_size over {_groups(space, largest)})"
    space.reasons.append(f"micro_batch in {divisors}: the divisors of {whose}, so the global "
                         "batch stays the same; the gradient is the same only without BatchNorm and dropout")
    if batch_size > space.batch_size:
        space.reasons.append(f"note: micro_batch above {space.batch_size} fits only the larger share of a rank in a "
                             "tensor-parallel group (its ranks see the same samples); a plan whose micro_batch does "
                             "not divide its strategy's share is told invalid, not probed")
    if space.batchnorm:
        space.reasons.append(f"note: micro_batch searched (--search-micro-batch) although the model has BatchNorm "
                             f"({_layers(space.batchnorm)}): below {batch_size} it normalises over fewer samples, "
                             "which changes its statistics and the result")
    if space.dropout:
        space.reasons.append(f"note: the model has dropout ({_layers(space.dropout)}): its masks are drawn per "
                             "micro-batch, so losses differ from the whole batch's (the same in distribution)")


def _groups(space: Space, strategy) -> str:
    groups = strategy.data_parallel(space.world_size)
    if groups == space.world_size:
        return f"{groups} ranks"
    return f"the {groups} data-parallel group{'s' if groups > 1 else ''} of {strategy.label()}"


def micro_batch_comment(space: Space, record: TrialRecord) -> str | None:
    """tuned.yaml's line on what the chosen micro_batch does to the result, when it does anything,
    at the winner's samples per rank."""
    micro, batch = record.plan["micro_batch"], space.share(record.strategy)
    if "micro_batch" not in space.choices and space.batchnorm:
        return (f"micro_batch {micro}: the recipe's, not searched: the model has BatchNorm, which normalises over "
                "each micro-batch (--search-micro-batch searches it)")
    if micro >= batch:
        return None
    if space.batchnorm:
        return (f"micro_batch {micro} of batch {batch} (--search-micro-batch): BatchNorm normalises over "
                f"{micro} samples, not {batch}: the result differs from the whole batch's")
    if space.dropout:
        return (f"micro_batch {micro} of batch {batch}: dropout masks are drawn per micro-batch; the "
                "gradient is otherwise the whole batch's")
    return (f"micro_batch {micro} of batch {batch}: the gradient is the whole batch's (no BatchNorm or "
            "dropout layers found)")


def _layers(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:3])
    return f"{len(names)} layer{'s' if len(names) != 1 else ''}: {shown}{', ...' if len(names) > 3 else ''}"


def _largest_first(space: Space, recipe: Recipe, predicted: bool) -> list[int]:
    """With predictions the largest micro-batch that fits; without, the whole of a rank's share."""
    return sorted(space.choices["micro_batch"], reverse=True) if predicted else [space.batch_size]


# --- activation checkpointing, offload, compression: the policy types' own choices ----------------


def add_checkpointing(space: Space, asked: Asked) -> None:
    blocks = asked.facts.blocks
    count = len(blocks)
    options = checkpointing_choices(blocks)  # each policy's own, for this model's blocks
    space.choices["checkpointing"] = options
    space.reasons.append(f"checkpointing in {options}: {count} blocks ({blocks.container_name}); every k-th block "
                         f"for k < {count} from {list(EVERY_K[:4])}...")


def add_adaptive(space: Space, asked: Asked) -> None:
    """Text of varying length (data.split: lines): short batches may checkpoint less than long ones."""
    recipe = asked.recipe
    if not recipe.data.varying_length:
        return  # every batch is data.seq_len long: one plan fits them all
    if recipe.memory.adaptive:
        space.fixed["adaptive"] = [bucket.model_dump(mode="json") for bucket in recipe.memory.adaptive]
        space.reasons.append("memory.adaptive pinned to the recipe's buckets")
        return
    space.fixed["short_len"] = max(1, recipe.data.seq_len // 2)
    switchable = [c for c in space.choices["checkpointing"] if not choice_class(CHECKPOINTING, c).spans_blocks]
    space.choices["short_checkpointing"] = ["same"] + switchable
    space.reasons.append(f"short_checkpointing in {space.choices['short_checkpointing']}: data.split lines pads each "
                         f"batch to its longest line, so batches up to {space.fixed['short_len']} tokens may keep "
                         "more (memory.adaptive); probes run the longest batch of each bucket")


def _adaptive_buckets(values: dict, space: Space) -> dict:
    """memory.adaptive of a point: the recipe's when pinned, else one bucket of short batches with
    their own checkpointing ("same": no bucket, one plan for every length)."""
    if "adaptive" in values:
        return {"memory": {"adaptive": values["adaptive"]}}
    short = values.get("short_checkpointing", "same")
    return {"memory": {"adaptive": [] if short == "same" else
                       [{"max_len": values["short_len"], "checkpointing": choice_fields(CHECKPOINTING, short)}]}}


def _short_label(candidate: Candidate, space: Space):
    """`same` for one plan at every length, a bucket at the space's short length as its checkpointing's
    label; other buckets (the recipe's own, pinned) are nothing the knob can say."""
    buckets = candidate.plan.adaptive
    if not buckets:
        return "same"
    short = buckets[0]
    return short.checkpointing.label() if len(buckets) == 1 and short.max_len == space.fixed.get("short_len") \
        else UNSAID


def _buckets_words(candidate: Candidate) -> str | None:
    buckets = candidate.plan.adaptive
    return ", ".join(f"up to {b.max_len} tokens: {b.checkpointing.label()}" for b in buckets) if buckets else None


def add_offload(space: Space, asked: Asked) -> None:
    device = asked.device
    options = offload_choices(device.kind)
    if len(options) > 1:
        space.choices["offload"] = options
        space.reasons.append(f"offload in {options}: the run is on CUDA, where host memory can hold activations")
    else:
        space.fixed["offload"] = options[0]
        space.reasons.append(f"offload not searched: the run is on the {device.kind}, where there is no device "
                             "memory to free")


def add_compression(space: Space, asked: Asked) -> None:
    memory = asked.recipe.memory
    pinned, lossy = memory.compression.label(), memory.compression.lossy
    if "compression" not in asked.opened:
        if lossy:  # an exact plan is what a plan without the key gets: the space's fixed keys stay as they were
            space.fixed["compression"] = pinned
        why = "the recipe's lossy choice (memory.allow_lossy)" if lossy else "it is lossy"
        space.reasons.append(f"compression pinned to {pinned}: {why}; --allow-lossy searches bf16/fp8 storage of "
                             "saved activations, which changes the gradients")
        return
    space.choices["compression"] = compression_choices()
    space.reasons.append(f"compression in {space.choices['compression']} (--allow-lossy): saved activations stored "
                         "rounded; lossy, and each such plan's gradient error is measured in its probe")


def _compression_fields(values: dict, space: Space) -> dict:
    """A plan's compression keys: a lossy policy carries its opt-in, so tuned.yaml shows it."""
    label = values.get("compression", "none")
    lossy = choice_class(COMPRESSION, label).lossy
    return {"memory": {"compression": choice_fields(COMPRESSION, label), "allow_lossy": True}} if lossy else {}


def compression_comment(space: Space, record: TrialRecord) -> str | None:
    """tuned.yaml's line on a lossy winner: what it changes, and by how much on one micro-batch."""
    compression = MemoryPlan.model_validate(record.plan).compression
    if not compression.lossy:
        return None
    policy = compression.label()
    error = record.gradient_error
    measured = f"relative gradient error {error:.2e} against the exact plan (one micro-batch)" if error is not None else \
        "gradient error not measured"
    return (f"LOSSY: memory.compression {policy} stores saved activations rounded: {measured}; set "
            "memory.compression.policy: none for exact gradients")


def _policy_starts(kind) -> list[str]:
    return [label for cls in kind for label in cls.tuner_starts]


def _smaller_micro_batches(space: Space, value: int) -> list[int]:
    return sorted((micro for micro in space.choices.get("micro_batch", []) if micro < value), reverse=True)


def _offload_everything(space: Space, value: str) -> list[str]:
    """Every block's activations on the host holds the least (a solver's per-block label holds more)."""
    everything = AllBlocksOffload(policy="all").label()
    return [everything] if value != everything and space.allows("offload", everything) else []


def _offload_starts(space: Space) -> list[str]:
    """No offload; where the pools leave the activations little room (`space.tight`), every block's too."""
    starts, everything = _policy_starts(OFFLOAD), AllBlocksOffload(policy="all").label()
    if space.tight and space.searched("offload") and space.allows("offload", everything):
        starts.append(everything)
    return starts


# --- the device's and the recipe's knobs: allocator, precision, compile ---------------------------


def add_allocator(space: Space, asked: Asked) -> None:
    pinned, device = asked.recipe.memory.allocator, asked.device
    if device.kind != "cuda":
        if pinned is not None:
            space.fixed["allocator"] = pinned
        space.reasons.append(f"allocator not searched: the run is on the {device.kind}, which has no CUDA caching "
                             "allocator to configure")
        return
    space.choices["allocator"] = list(dict.fromkeys([pinned or "default", *ALLOCATOR_SETTINGS]))
    space.reasons.append(f"allocator in {space.choices['allocator']}: PYTORCH_CUDA_ALLOC_CONF per probe, set in the "
                         "probe's environment before CUDA starts (expandable segments fragment less)")


def add_precision(space: Space, asked: Asked) -> None:
    pinned, device = asked.recipe.precision, asked.device
    lora = asked.recipe.model.lora
    held = lora.base_dtype if lora is not None else "fp32"
    if "precision" in asked.opened and held != "fp32":  # the base is built once, in the dtype only that autocast computes in
        space.fixed["precision"] = pinned
        space.reasons.append(f"--search-precision set aside: model.lora.base_dtype {held} needs precision {held}")
        return
    if "precision" not in asked.opened:
        space.fixed["precision"] = pinned
        space.reasons.append(f"precision pinned to the recipe's {pinned} (pass --search-precision to search "
                             f"{', '.join(device.precisions)})")
        return
    space.choices["precision"] = [p for p in PRECISIONS if p in device.precisions]
    space.reasons.append(f"precision in {space.choices['precision']}: what {device.name} supports "
                         "(--search-precision)")


def add_compile(space: Space, asked: Asked) -> None:
    pinned = asked.recipe.memory.compile
    if "compile" in asked.opened:
        space.choices["compile"] = [False, True]
        space.reasons.append("compile in [False, True] (--search-compile): slower first step, often faster after")
    else:
        space.fixed["compile"] = pinned
        space.reasons.append(f"compile pinned to the recipe's {pinned} (pass --search-compile to try both)")


def add_budget(space: Space, asked: Asked) -> None:
    """compile's activation_memory_budget, wherever a plan may compile."""
    from ckrun.runner.memory.torch_features import missing_budget

    if not space.searched("compile") and not space.fixed.get("compile"):
        return
    if missing_budget():
        space.reasons.append(f"activation_memory_budget not searched: {missing_budget()}")
        return
    space.numeric["activation_memory_budget"] = FloatDistribution(0.0, 1.0, step=BUDGET_STEP)
    space.reasons.append(f"activation_memory_budget in [0, 1] by {BUDGET_STEP} with compile: what torch.compile's "
                         "partitioner may keep; its peak is not monotonic in it (pytorch issue 197838), so every "
                         "value is measured, none ruled out from its neighbours")


def _budget(values: dict, space: Space) -> dict:
    """The budget a compiled plan runs with; TPE's 0.30000000000000004 is the grid's 0.3."""
    value = values.get("activation_memory_budget")
    return {"memory": {"activation_memory_budget": round(value, 6) if values["compile"] and value is not None
                       else None}}


def _own_budget(candidate: Candidate, space: Space) -> float:
    budget = candidate.plan.activation_memory_budget
    return round(budget if budget is not None else 1.0, 1)  # unset: torch's default, the grid's 1.0


# --- the table ------------------------------------------------------------------------------------


def _memory(name: str, read=lambda value: value):
    """to_plan of a knob that is one plan field of the same name, its value read by `read`."""
    return lambda values, space: {"memory": {name: read(values[name])}} if name in values else {}


def _policy(kind, name: str):
    return _memory(name, lambda label: choice_fields(kind, label))


KNOBS: tuple[Knob, ...] = (
    SHARDING,
    Knob("micro_batch", add_micro_batches, _memory("micro_batch"),
         lambda c, space: c.plan.micro_batch or space.batch_size, _largest_first,
         lambda c: f"micro_batch {c.plan.micro_batch}",
         flag=Flag("--search-micro-batch", "search micro_batch also for a model with BatchNorm, whose statistics then "
                   "cover a micro-batch, not the batch (default: keep the recipe's)"),
         fits_first=True, solver=True, note=micro_batch_comment, lighter=_smaller_micro_batches),
    Knob("checkpointing", add_checkpointing, _policy(CHECKPOINTING, "checkpointing"),
         lambda c, space: c.plan.checkpointing.label(), lambda space, recipe, p: _policy_starts(CHECKPOINTING),
         lambda c: f"checkpointing {c.plan.checkpointing.label()}", joins=True, solver=True),
    Knob("short_checkpointing", add_adaptive, _adaptive_buckets, _short_label, lambda space, recipe, p: ["same"],
         _buckets_words),
    Knob("offload", add_offload, _policy(OFFLOAD, "offload"), lambda c, space: c.plan.offload.label(),
         lambda space, recipe, p: _offload_starts(space),
         lambda c: f"offload {c.plan.offload.label()}" if c.plan.offload.moves else None, joins=True, solver=True,
         lighter=_offload_everything),
    Knob("allocator", add_allocator, _memory("allocator", lambda a: None if a == "default" else a),
         lambda c, space: c.plan.allocator or "default", lambda space, recipe, p: [recipe.memory.allocator or "default"],
         lambda c: f"allocator {c.plan.allocator}" if c.plan.allocator is not None else None),
    Knob("precision", add_precision, lambda values, space: {"precision": values["precision"]},
         lambda c, space: c.precision, lambda space, recipe, p: [recipe.precision], lambda c: c.precision,
         flag=Flag("--search-precision", "search fp32/bf16/fp16 instead of the recipe's"), solver=True),
    Knob("compile", add_compile, _memory("compile"), lambda c, space: c.plan.compile,
         lambda space, recipe, p: [recipe.memory.compile], lambda c: "compile" if c.plan.compile else None,
         flag=Flag("--search-compile", "try torch.compile on and off"), solver=True),
    Knob("activation_memory_budget", add_budget, _budget, _own_budget, lambda space, recipe, p: [1.0],
         lambda c: f"activation budget {b:g}" if (b := c.plan.activation_memory_budget) is not None else None),
    Knob("compression", add_compression, _compression_fields, lambda c, space: c.plan.compression.label(),
         lambda space, recipe, p: _policy_starts(COMPRESSION),
         lambda c: f"compression {c.plan.compression.label()} (lossy)" if c.plan.compression.lossy else None,
         flag=Flag("--allow-lossy", "also search the lossy knobs: memory.compression (saved activations in bf16/fp8), "
                   "which changes the gradients, memory.weights bf16 and memory.optimizer_state 8bit/4bit/fp8, which "
                   "change the update; each such plan's error is measured and tuned.yaml marks it"),
         note=compression_comment, lighter=later_choices("compression")),
    *POOL_KNOBS,  # weights, optimizer_state, optimizer_step, optimizer_offload, loss (autotune/space/pool_knobs.py)
)


def build_space(recipe: Recipe, facts: ModelFacts, device: Device, nproc: int = 1, knobs: tuple[Knob, ...] = KNOBS,
                **flags: bool) -> Space:
    """The space for `recipe` on `device` (each of `nproc` ranks) over `knobs`; `flags` by the options'
    names (search_precision=True) open the knobs they name. Every automatic choice is logged with its reason."""
    opened = {knob.name for knob in knobs if knob.flag and flags.pop(knob.flag.dest, False)}
    if flags:
        raise TypeError(f"build_space: no knob has the flag {', '.join(flags)}")
    space = Space({}, {}, device.kind, recipe.memory.blocks, batch_size=recipe.train.batch_size // nproc,
                  batchnorm=facts.batchnorm, dropout=facts.dropout, base=recipe, knobs=knobs)
    asked = Asked(recipe, facts, device, nproc, frozenset(opened))
    for knob in knobs:
        knob.add(space, asked)
    for reason in space.reasons:
        log.info("space: %s", reason)
    log.info("space: %d plans in all", space.size)
    return space


def describe(candidate: Candidate, knobs: tuple[Knob, ...] = KNOBS) -> str:
    """The candidate as a log line says it: each knob's words, in the table's order."""
    return ", ".join(words for knob in knobs if (words := knob.words(candidate)))


def notes(space: Space, record: TrialRecord) -> list[str]:
    """tuned.yaml's lines on what the winner's knobs do to the result."""
    return [line for knob in space.knobs if knob.note and (line := knob.note(space, record))]


def differences(space: Space, recipe: Recipe, record: TrialRecord) -> str:
    """What the winner changed from the recipe's own plan, knob by knob in the table's order, and what
    its pools hold at least against the recipe's (the lower bound), in one line."""
    own = Candidate(recipe.memory, recipe.precision)
    won = Candidate(MemoryPlan.model_validate(record.plan), record.precision, record.strategy)
    changed = [knob.words(won) or f"{knob.name} {knob.from_plan(won, space)}" for knob in space.knobs
               if knob.from_plan(own, space) != knob.from_plan(won, space)]
    line = f"the winner changes {'; '.join(changed)}" if changed else "the winner is the recipe's own plan"
    floors = [space.bound.floor(c) for c in (own, won)] if space.bound is not None else [None, None]
    if all(floors) and floors[0].total != floors[1].total:
        line += (f" (its pools hold at least {format_bytes(floors[1].total)} where the recipe's hold "
                 f"{format_bytes(floors[0].total)}, before any activation)")
    return line
