"""tuned.yaml is the recipe's own text with only what tuning (and the overrides) changed rewritten:
for every bundled recipe, any plan, precision and overrides, it validates, holds exactly the tuned
values, and keeps every line (comments included) outside the sections it replaces."""

from __future__ import annotations

import logging
import re

from hypothesis import HealthCheck, assume, given, settings, strategies as st

from ckrun.autotune.records import TrialRecord
from ckrun.autotune.outputs.tuned import tuned_data, tuned_text
from conftest import ROOT
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.plan.memory_plan import MemoryPlan, plan_problems
from ckrun.runner.recipe.yamlio import apply_overrides, load_document, parse_document

RECIPES = sorted((ROOT / "recipes").glob("**/*.yaml"))
CHECKPOINTING = [{"policy": "none"}, {"policy": "full"}, {"policy": "every", "every": 2}, {"policy": "sqrt"},
                 {"policy": "selective"}]
OVERRIDES = st.sampled_from(["train.steps=7", "train.seed=3", "output.log_every=2", "memory.micro_batch=1",
                             "precision=fp16", "description=tuned copy", "output.dir=runs/elsewhere"])
TOP_KEY = re.compile(r"^([A-Za-z_][\w-]*)\s*:")


@st.composite
def tunings(draw):
    path = draw(st.sampled_from(RECIPES))
    overrides = draw(st.lists(OVERRIDES, max_size=3, unique_by=lambda o: o.split("=")[0]))
    doc = apply_overrides(load_document(path), overrides)
    batch = doc.data["train"]["batch_size"]
    plan = MemoryPlan(checkpointing=draw(st.sampled_from(CHECKPOINTING)),
                      micro_batch=draw(st.sampled_from([None, *(d for d in range(1, batch + 1) if batch % d == 0)])),
                      compile=draw(st.booleans()))
    assume(not plan_problems(plan))  # the tuner never proposes a plan the schema refuses
    winner = TrialRecord(state="feasible", plan=plan.model_dump(mode="json"),
                         precision=draw(st.sampled_from(_precisions(doc))))
    return path, overrides, doc, winner, draw(st.sampled_from(["40GB", "100MB", "1500000000"]))


def _precisions(doc) -> list[str]:
    """The precisions the tuner may give the recipe: a LoRA base held in bf16 runs only under bf16."""
    held = ((doc.data.get("model") or {}).get("lora") or {}).get("base_dtype", "fp32")
    return ["fp32", "bf16", "fp16"] if held == "fp32" else [held]


def kept_lines(text: str, replaced: set[str]) -> list[str]:
    """The lines of `text` outside the top-level sections in `replaced`, as a reader sees sections:
    from a key at the start of a line to the next one."""
    kept, section = [], None
    for line in text.splitlines():
        key = TOP_KEY.match(line)
        section = key.group(1) if key else section
        if section not in replaced:
            kept.append(line)
    return kept


def is_subsequence(wanted: list[str], lines: list[str]) -> bool:
    remaining = iter(lines)
    return all(any(line == candidate for candidate in remaining) for line in wanted)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tunings())
def test_tuned_text_validates_holds_the_tuned_values_and_keeps_the_rest(tuning):
    path, overrides, doc, winner, cap = tuning
    expected = tuned_data(doc, winner, cap)
    text = tuned_text(doc, expected)
    assert parse_document(text, "tuned.yaml").data == expected
    recipe_from_text(text, "tuned.yaml")  # raises InputError if ckrun validate would refuse it
    replaced = {"memory", "precision", *(o.split("=")[0].split(".")[0] for o in overrides)}
    original = path.read_text(encoding="utf-8")
    assert is_subsequence(kept_lines(original, replaced), text.splitlines())
    assert original.splitlines()[0] == text.splitlines()[0]  # the header comment, not a dump


def test_an_unchanged_precision_keeps_its_line_and_comment():
    doc = load_document(ROOT / "recipes" / "bert_tiny.yaml")
    line = next(line for line in doc.text.splitlines() if line.startswith("precision:"))
    winner = TrialRecord(state="feasible", plan=MemoryPlan().model_dump(mode="json"), precision=doc.data["precision"])
    assert "#" in line and line in tuned_text(doc, tuned_data(doc, winner, "1GB")).splitlines()


def test_a_flow_style_recipe_is_dumped_and_the_log_says_why(caplog):
    doc = parse_document("{model: {source: torchvision, name: resnet18}, data: {source: synthetic, "
                         "task: image_classification}, train: {batch_size: 2}}  # one line\n", "flow.yaml")
    winner = TrialRecord(state="feasible", plan=MemoryPlan().model_dump(mode="json"), precision="bf16")
    expected = tuned_data(doc, winner, "1GB")
    with caplog.at_level(logging.INFO, logger="ckrun.autotune.outputs.tuned"):
        text = tuned_text(doc, expected)
    assert parse_document(text, "tuned.yaml").data == expected
    assert any("without the recipe's own comments" in r.message and "start a line" in r.message for r in caplog.records)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tunings())
def test_an_override_rewrites_the_keys_it_sets_not_their_section(tuning):
    """Every line of the recipe outside memory: and the precision line is still in tuned.yaml, but
    the lines of the keys the overrides set (their comments beside them go with the old value)."""
    path, overrides, doc, winner, cap = tuning
    text = tuned_text(doc, tuned_data(doc, winner, cap))
    original = parse_document(path.read_text(encoding="utf-8"), str(path))
    keys = [tuple(override.split("=")[0].split(".")) for override in overrides]
    overridden = {original.places[key].line for key in keys if key in original.places}
    kept = kept_lines(original.text, {"memory", "precision"})
    lines = original.text.splitlines()
    wanted = [line for number, line in enumerate(lines, 1) if number not in overridden and line in kept]
    assert is_subsequence(wanted, text.splitlines()), (overrides, text)


def test_tune_nproc_writes_the_strategy_after_every_line_of_the_last_section_and_fsdp_knobs_in_full():
    """Issue 25, defect 6: `distributed:` went in before the last section's indented trailing comment
    (gpt2.yaml's commented-out eval data), which then stood under it; and memory.sharding was left
    out at its defaults though the README says tuned.yaml carries it."""
    doc = load_document(ROOT / "recipes" / "gpt2.yaml")
    plan = MemoryPlan().model_dump(mode="json")
    text = tuned_text(doc, tuned_data(doc, TrialRecord(state="feasible", plan=plan, precision="bf16", strategy="fsdp"), "40GB"))
    lines = text.splitlines()
    at = lines.index("distributed:")
    assert lines[at + 1:] == ["  strategy: fsdp"]  # nothing of eval's under it
    assert lines[at - 1].startswith("  # data: {source: text")  # the comment stays last in its section:
    assert [line for line in lines[:at] if TOP_KEY.match(line)][-1] == "eval:"
    tuned = recipe_from_text(text, "tuned.yaml")
    assert tuned.memory.sharding is not None and tuned.memory.sharding.model_dump() == {
        "reshard_after_forward": True, "offload": "none"}
    ddp = tuned_data(doc, TrialRecord(state="feasible", plan=plan, precision="bf16", strategy="ddp"), "40GB")
    assert "sharding" not in ddp["memory"]  # ddp refuses sharding knobs
