"""The knobs of the space other than sharding, one adder each: which values the space searches for
a knob, or the value it pins, and the reason either way (autotune/space.py's `build_space` calls them
in order; autotune/sharding.py adds the ranks' knob). Also tuned.yaml's notes on what a chosen
micro-batch or lossy compression does to the result.

Micro-batching changes what is computed where the model looks across samples: BatchNorm
normalises over each micro-batch, dropout draws its masks per micro-batch. The space says so in
its lines, and tuned.yaml in a comment (`micro_batch_comment`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from optuna.distributions import FloatDistribution

from runner.memory.blocks import BlockList
from runner.plan import MemoryPlan
from runner.choices import choice_class
from runner.policies import CHECKPOINTING, EVERY_K, checkpointing_choices, compression_choices, offload_choices
from runner.recipe import Recipe

from .records import TrialRecord

if TYPE_CHECKING:
    from .space import Device, Space

PRECISIONS = ("fp32", "bf16", "fp16")
ALLOCATOR_SETTINGS = ("default", "expandable_segments:True")  # "default": PYTORCH_CUDA_ALLOC_CONF left alone
BUDGET_STEP = 0.1  # compile's activation_memory_budget: finer steps than this measure noise, not the knob


def add_micro_batches(space: Space, recipe_micro: int, search: bool) -> None:
    """The divisors of a rank's share; under --nproc of the largest share any strategy gives a rank
    (a tensor-parallel group's ranks see the same samples), so each strategy can run its whole share."""
    largest = max(space.strategies(), key=space.share, default=None)  # tp's groups see the most samples
    batch_size = space.share(largest)
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    if space.batchnorm and not search:
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


def micro_batch_comment(space: Space, micro: int, share: int | None = None) -> str | None:
    """tuned.yaml's line on what the chosen micro_batch does to the result, when it does anything;
    `share`: the winner's samples per rank (default: the space's)."""
    batch = share or space.batch_size
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


def add_checkpointing(space: Space, blocks: BlockList) -> None:
    count = len(blocks)
    options = checkpointing_choices(blocks)  # each policy's own, for this model's blocks
    space.choices["checkpointing"] = options
    space.reasons.append(f"checkpointing in {options}: {count} blocks ({blocks.container_name}); every k-th block "
                         f"for k < {count} from {list(EVERY_K[:4])}...")


def add_adaptive(space: Space, recipe: Recipe) -> None:
    """Text of varying length (data.split: lines): short batches may checkpoint less than long ones."""
    if getattr(recipe.data, "split", "packed") != "lines":
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


def add_offload(space: Space, device: Device) -> None:
    options = offload_choices(device.kind)
    if len(options) > 1:
        space.choices["offload"] = options
        space.reasons.append(f"offload in {options}: the run is on CUDA, where host memory can hold activations")
    else:
        space.fixed["offload"] = options[0]
        space.reasons.append(f"offload not searched: the run is on the {device.kind}, where there is no device "
                             "memory to free")


def add_precision(space: Space, pinned: str, device: Device, search: bool) -> None:
    if not search:
        space.fixed["precision"] = pinned
        space.reasons.append(f"precision pinned to the recipe's {pinned} (pass --search-precision to search "
                             f"{', '.join(device.precisions)})")
        return
    space.choices["precision"] = [p for p in PRECISIONS if p in device.precisions]
    space.reasons.append(f"precision in {space.choices['precision']}: what {device.name} supports "
                         "(--search-precision)")


def add_compile(space: Space, pinned: bool, search: bool) -> None:
    if search:
        space.choices["compile"] = [False, True]
        space.reasons.append("compile in [False, True] (--search-compile): slower first step, often faster after")
    else:
        space.fixed["compile"] = pinned
        space.reasons.append(f"compile pinned to the recipe's {pinned} (pass --search-compile to try both)")
    if search or pinned:
        _compile_budget(space)


def _compile_budget(space: Space) -> None:
    from runner.memory.torch_features import missing_budget

    if missing_budget():
        space.reasons.append(f"activation_memory_budget not searched: {missing_budget()}")
        return
    space.numeric["activation_memory_budget"] = FloatDistribution(0.0, 1.0, step=BUDGET_STEP)
    space.reasons.append(f"activation_memory_budget in [0, 1] by {BUDGET_STEP} with compile: what torch.compile's "
                         "partitioner may keep; its peak is not monotonic in it (pytorch issue 197838), so every "
                         "value is measured, none ruled out from its neighbours")


def add_allocator(space: Space, pinned: str | None, device: Device) -> None:
    if device.kind != "cuda":
        if pinned is not None:
            space.fixed["allocator"] = pinned
        space.reasons.append(f"allocator not searched: the run is on the {device.kind}, which has no CUDA caching "
                             "allocator to configure")
        return
    space.choices["allocator"] = list(dict.fromkeys([pinned or "default", *ALLOCATOR_SETTINGS]))
    space.reasons.append(f"allocator in {space.choices['allocator']}: PYTORCH_CUDA_ALLOC_CONF per probe, set in the "
                         "probe's environment before CUDA starts (expandable segments fragment less)")


def add_compression(space: Space, memory: MemoryPlan, allow_lossy: bool) -> None:
    pinned, lossy = memory.compression.label(), memory.compression.lossy
    if not allow_lossy:
        if lossy:  # an exact plan is what a plan without the key gets: the space's fixed keys stay as they were
            space.fixed["compression"] = pinned
        why = "the recipe's lossy choice (memory.allow_lossy)" if lossy else "it is lossy"
        space.reasons.append(f"compression pinned to {pinned}: {why}; --allow-lossy searches bf16/fp8 storage of "
                             "saved activations, which changes the gradients")
        return
    space.choices["compression"] = compression_choices()
    space.reasons.append(f"compression in {space.choices['compression']} (--allow-lossy): saved activations stored "
                         "rounded; lossy, and each such plan's gradient error is measured in its probe")


def compression_comment(record: TrialRecord) -> str | None:
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
