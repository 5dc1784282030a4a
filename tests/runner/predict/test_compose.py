"""A plan priced from parts equals the whole-model fake step: over the library's recipes (tiny versions,
deep enough that most blocks are composed from another's trace) and plans drawn from every knob the
tuner searches, the composed estimate has the reference's peak to the byte (live and, on CUDA, the
caching allocator's reserve), its breakdown and its step time. Plans are drawn in any order against
one composer per recipe, so traces made for one plan serve later ones. Counted, not timed: the
traces a composer makes grow with the kinds of block and actions, not with depth or plans."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ckrun.runner.plan.choices import choice_fields
from ckrun.runner.recipe.load import load_recipe, recipe_from_text
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.plan.policies import CHECKPOINTING, COMPRESSION, OFFLOAD, checkpointing_choices
from ckrun.runner.plan.pool_policies import POOL_KINDS
from ckrun.runner.predict.compose import Composer
from ckrun.runner.predict.estimate import EstimateUnavailable, Estimator
from ckrun.runner.predict.hardware import DeviceFacts
from ckrun.runner.predict.parts import PartsEstimator
from ckrun.runner.memory.blocks import find_blocks
from tests.runner.memory.tiny_lm import HAS_TORCHAO

ROOT = Path(__file__).resolve().parents[3]
FACTS = DeviceFacts(name="test gpu", matmul_tflops={"fp32": 60.0, "tf32": 400.0, "bf16": 900.0, "fp16": 900.0},
                    memory_gbs=3000.0, peer_gbs=400.0, host_gbs=50.0, capability=(9, 0), memory_bytes=80 * 10**9)
LLAMA = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=4",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "model.config.vocab_size=256",
         "data.seq_len=32", "train.batch_size=4"]
TINY = {  # a library recipe, made small: a fake step of it takes a second or two here
    "llama3_8b": LLAMA,
    "llama_1b_lora": LLAMA,
    "gpt2": ["model.config.n_embd=32", "model.config.n_layer=6", "model.config.n_head=2", "model.config.n_positions=32",
             "model.config.vocab_size=256", "data.seq_len=32", "train.batch_size=4"],
    "bert_tiny": ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.vocab_size=256",
                  "model.config.num_hidden_layers=5", "model.config.max_position_embeddings=32", "data.seq_len=32",
                  "train.batch_size=4"],
    "mixtral_tiny": ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.vocab_size=256",
                     "model.config.num_local_experts=4", "model.config.num_hidden_layers=5", "data.seq_len=32",
                     "train.batch_size=4"],
    "classic_transformer_stack": ["model.config.vocab_size=256", "data.vocab_size=256", "model.config.width=32",
                                  "model.config.depth=5", "model.config.heads=2", "model.config.max_len=32",
                                  "data.seq_len=32", "train.batch_size=4"],
    "resnet50": ["model.config.num_classes=10", "data.num_classes=10", "data.image_size=64", "train.batch_size=2"],
}
ALWAYS = ("llama3_8b", "llama_1b_lora")  # the default run's recipes (a LoRA's frozen base: its first block is
# given an input needing no gradient, and the backward ends in that block); the rest run with -m slow
_COMPOSERS: dict[tuple, tuple] = {}


def pair(name: str, device: str) -> tuple[Estimator, Composer]:
    """The reference estimator and a composer for the tiny recipe, made once per recipe and device."""
    if (name, device) not in _COMPOSERS:
        recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", [*TINY[name], "train.grad_clip=null", "memory.micro_batch=null"])
        _COMPOSERS[(name, device)] = (Estimator(recipe, device, FACTS),
                                      Composer(PartsEstimator(recipe, device, FACTS)))
    return _COMPOSERS[(name, device)]


@st.composite
def plans(draw, estimator: Estimator, device: str) -> MemoryPlan:
    recipe = estimator.recipe
    batch = recipe.train.batch_size
    micro = draw(st.sampled_from([d for d in range(1, batch + 1) if batch % d == 0]))
    blocks = find_blocks(estimator.model, recipe.memory.blocks)
    labels = {"checkpointing": draw(st.sampled_from(checkpointing_choices(blocks)))}
    if device == "cuda":
        labels["offload"] = draw(st.sampled_from(["none", "all"]))
        labels["optimizer_offload"] = draw(st.sampled_from(["none", "cpu:0.5", "cpu", "master"]))
    labels["compression"] = draw(st.sampled_from(["none", "bf16"]))
    if recipe.precision != "fp32":
        labels["weights"] = draw(st.sampled_from(["fp32", "fp32:uncached"] + (["bf16"] if HAS_TORCHAO else [])))
    if HAS_TORCHAO:
        labels["optimizer_state"] = draw(st.sampled_from(["full", "8bit"]))
    labels["optimizer_step"] = draw(st.sampled_from(["after", "in_backward"])) if micro == batch else "after"
    memory = {"micro_batch": micro, "allow_lossy": True, "blocks": recipe.memory.blocks}
    kinds = {"checkpointing": CHECKPOINTING, "offload": OFFLOAD, "compression": COMPRESSION, **POOL_KINDS}
    memory.update({section: choice_fields(kinds[section], label) for section, label in labels.items()})
    if "optimizer_offload" not in labels:
        memory["optimizer_offload"] = {"policy": "none"}
    return MemoryPlan.model_validate(memory)


def answer(estimate) -> tuple:
    return estimate.peak_bytes, estimate.live_peak_bytes, estimate.breakdown, estimate.warnings


def check(name: str, device: str, drawn) -> None:
    """A drawn plan, then the same plan with other checkpointing: the second is made of traces the first
    made (a kept block traced beside a recomputed one), as a search prices its neighbours."""
    estimator, composer = pair(name, device)
    plan = drawn.draw(plans(estimator, device))
    blocks = find_blocks(estimator.model, estimator.recipe.memory.blocks)
    other = drawn.draw(st.sampled_from([c for c in checkpointing_choices(blocks) if c != plan.checkpointing.label()]))
    for each in (plan, MemoryPlan.model_validate({**plan.model_dump(mode="json"),
                                                  "checkpointing": choice_fields(CHECKPOINTING, other)})):
        check_plan(estimator, composer, each)


def check_plan(estimator: Estimator, composer: Composer, plan: MemoryPlan) -> None:
    try:
        estimator.check(plan, estimator.recipe.precision)
    except ValueError:
        return  # a combination every path refuses (in_backward with offloaded state, ...)
    try:
        reference = estimator.estimate(plan)
    except (ValueError, EstimateUnavailable) as refused:  # the model itself refuses (BatchNorm over one value)
        with pytest.raises(type(refused)):
            composer.estimate(plan)
        return
    composed = composer.estimate(plan)
    whole = [note for note in composed.notes if note.startswith("the whole-model fake step")]
    assert not whole, whole
    assert answer(composed) == answer(reference), plan
    assert composed.notes == reference.notes + whole
    assert composed.time.seconds == pytest.approx(reference.time.seconds, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize(("name", "device"), [("llama3_8b", "cuda"), ("llama_1b_lora", "cuda"),
                                             pytest.param("llama3_8b", "cpu", marks=pytest.mark.slow)])  # 48 s of CPU
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(st.data())
def test_a_composed_plan_is_the_whole_model_step(name, device, data):
    check(name, device, data)


@pytest.mark.slow  # every recipe: a few minutes of CPU
@pytest.mark.parametrize("name", [name for name in TINY if name not in ALWAYS])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(st.data())
def test_every_library_recipe_composes_as_its_whole_model_step(name, data):
    check(name, "cuda", data)


def test_traces_grow_with_kinds_and_actions_not_depth_or_plans():
    """Twelve blocks, six checkpointing plans with the same micro-batch and pools: one trace of a kept and a
    recomputed block (every plan that keeps some blocks and recomputes the rest is made of those), one of
    a selective block, one of the update; the whole-model step would have run six times over twelve blocks."""
    recipe = load_recipe(ROOT / "recipes" / "llama3_8b.yaml",
                         [*LLAMA, "model.config.num_hidden_layers=12", "train.grad_clip=null"])
    composer = Composer(PartsEstimator(recipe, "cuda", FACTS))
    for label in ["none", "every:2", "every:3", "every:4", "full", "selective"]:
        memory = {**recipe.memory.model_dump(mode="json"), "checkpointing": choice_fields(CHECKPOINTING, label)}
        composer.estimate(MemoryPlan.model_validate(memory))
    assert composer.traces == 2 + 1


@pytest.mark.parametrize(("device", "precision"), [("cuda", "bf16"), ("cpu", "fp32")])
def test_a_recomputed_block_traced_beside_a_kept_one_says_when_it_lets_go_of_its_input(device, precision):
    """torchvision's residual blocks end in a ReLU that saves its output: traced for `none`, a kept block
    holds its output (the recomputed companion's input) to its own backward, which hid when the companion
    lets go of it; `full` composed from that trace freed it as the next block's forward returned (ResNet-50:
    16,384 B under its whole-model step). Each real block now holds its own copy of such an input."""
    recipe = recipe_from_text(f"""
model: {{source: python, name: "estimate_models:residual_net", config: {{depth: 2}}}}
data: {{source: synthetic, task: image_classification, image_size: 8, num_classes: 4}}
train: {{batch_size: 2, steps: 2, grad_clip: null}}
precision: {precision}
memory: {{micro_batch: 1}}
""")
    reference, composer = Estimator(recipe, device, FACTS), Composer(PartsEstimator(recipe, device, FACTS))
    for policy in ["none", "full"]:
        plan = MemoryPlan.model_validate({**recipe.memory.model_dump(mode="json"), "checkpointing": {"policy": policy}})
        composed = composer.estimate(plan)
        assert not [note for note in composed.notes if note.startswith("the whole-model fake step")]
        assert answer(composed) == answer(reference.estimate(plan)), policy
    assert composer.traces == 3  # none's (with a recomputed companion), its update, full's widening block


@pytest.mark.parametrize("name", ALWAYS)
def test_a_sqrt_region_traced_real_is_the_whole_model_step(name):
    """sqrt checkpoints blocks 0-1 of four as one region, traced real together: the second block was given its
    own copy of the first's output (as a real neighbour's), which the region's replay did not know as the first
    block's and kept, and the copy's release freed the original in the backward, not as the second block's
    forward returned: 8,192 B over the whole-model step at micro-batch 1 (4,096 on the LoRA's bf16 base)."""
    estimator, composer = pair(name, "cuda")
    plan = MemoryPlan.model_validate({"micro_batch": 1, "checkpointing": {"policy": "sqrt"}, "allow_lossy": True,
                                      "optimizer_offload": {"policy": "none"}})
    check_plan(estimator, composer, plan)


def test_plans_that_differ_in_what_only_the_step_sees_share_the_update_trace():
    """The loss's split and autocast's cast cache act in the forward and backward, not in the update: plans
    that differ only there trace their own steps and share one update (an 8B search went through three more
    update traces, a second each), and each still equals its whole-model step."""
    recipe = load_recipe(ROOT / "recipes" / "llama3_8b.yaml", [*LLAMA, "memory.micro_batch=2"])
    reference, composer = Estimator(recipe, "cuda", FACTS), Composer(PartsEstimator(recipe, "cuda", FACTS))
    memory = {**recipe.memory.model_dump(mode="json"), "checkpointing": {"policy": "full"},
              "optimizer_offload": {"policy": "none"}}
    for change in [{"loss": {"policy": "whole"}}, {"loss": {"policy": "chunked", "chunks": 4}},
                   {"weights": {"policy": "fp32", "cast_cache": False}}]:
        plan = MemoryPlan.model_validate({**memory, **change})
        assert answer(composer.estimate(plan)) == answer(reference.estimate(plan)), change
    assert len(composer.updates) == 1


ORDERED = [  # one composer, plans in an order where later ones reuse the traces of earlier ones
    {"checkpointing": {"policy": "none"}},
    {"checkpointing": {"policy": "every", "every": 3}},
    {"checkpointing": {"policy": "full"}, "micro_batch": 2},
    {"checkpointing": {"policy": "none"}, "micro_batch": 2},
    {"checkpointing": {"policy": "selective", "products_kept_every": 2}},
]


@pytest.mark.parametrize(("name", "device", "weights"), [  # the default run keeps one GPU and one CPU order
    ("llama3_8b", "cuda", "bf16"), ("bert_tiny", "cpu", "fp32"),
    pytest.param("llama3_8b", "cuda", "fp32", marks=pytest.mark.slow),
    pytest.param("llama_1b_lora", "cuda", "fp32", marks=pytest.mark.slow)])  # 39 s; the LoRA's neighbours are checked above
def test_plans_in_any_order_compose_from_the_traces_of_others(name, device, weights):
    """Each plan reuses what earlier ones traced (a kept block traced beside a recomputed one, a block stood
    for by a later one: BERT's two blocks by its last); with bf16 weights a kept block lets go of its input
    in its forward, so only the model's loop holds it: every plan still equals its whole-model step."""
    if weights == "bf16" and not HAS_TORCHAO:
        pytest.skip("torchao (the lowbit extra) is not installed")
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", [*TINY[name], "memory.micro_batch=1"])
    reference, composer = Estimator(recipe, device, FACTS), Composer(PartsEstimator(recipe, device, FACTS))
    pools = {"weights": {"policy": weights}, "optimizer_state": {"policy": "8bit" if weights == "bf16" else "full"},
             "optimizer_offload": {"policy": "none"}, "loss": {"policy": "whole"}, "allow_lossy": True}
    for change in ORDERED:
        plan = MemoryPlan.model_validate({**recipe.memory.model_dump(mode="json"), **pools, **change})
        composed = composer.estimate(plan)
        assert not [note for note in composed.notes if note.startswith("the whole-model fake step")]
        assert answer(composed) == answer(reference.estimate(plan)), change
