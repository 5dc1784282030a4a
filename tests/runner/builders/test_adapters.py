"""model.lora: peft's LoRA on the built model; the plan finds the blocks inside it and stays exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import ROOT
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.memory.blocks import find_blocks
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.train.trainer import Trainer
from tests.runner.builders.hub_cache import tiny_llama_recipe
from tests.runner.memory.generated_models import LAYERS, Stack

LLAMA_LORA = str(ROOT / "recipes" / "llama_1b_lora.yaml")


def _trainer(lora: str = "{}", rest: str = "") -> Trainer:
    return Trainer(recipe_from_text(tiny_llama_recipe(f"lora: {lora}", rest)))


def test_only_the_adapter_trains_and_the_optimizer_holds_its_state_alone():
    trainer = _trainer("{rank: 4, target_modules: [q_proj, v_proj, down_proj]}")
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    for _ in range(2):
        trainer.train_step()
    trained = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert {name.split(".")[-4] for name in trained} == {"q_proj", "v_proj", "down_proj"}
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) != (name in trained), name  # the base stays bit for bit, the adapter moves
    assert len(trainer.optimizer.state) == len(trained)
    assert {id(p) for group in trainer.optimizer.param_groups for p in group["params"]} == \
        {id(p) for p in trainer.model.parameters() if p.requires_grad}


def test_the_blocks_are_found_inside_the_peft_model_with_their_adapters():
    trainer = _trainer()
    blocks = find_blocks(trainer.model)
    assert blocks.container_name == "base_model.model.model.layers" and len(blocks) == 2
    assert all(any("lora_A" in name for name, _ in block.module.named_modules()) for block in blocks)


@pytest.mark.parametrize("plan", ["{policy: full}", "{policy: every, every: 2}", "{policy: selective}",
                                  "{policy: layers, layers: [1]}"])
def test_checkpointing_a_lora_llama_gives_the_losses_and_adapters_of_no_plan(plan):
    """fp32 on the CPU, adapter dropout on: the recompute draws the masks the forward drew."""
    def run(checkpointing: str):
        trainer = _trainer("{dropout: 0.2, target_modules: all-linear}",
                           f"memory: {{checkpointing: {checkpointing}}}\n")
        losses = [trainer.train_step()["loss"] for _ in range(2)]
        if checkpointing != "{policy: none}":
            assert trainer.plan.checkpointed
        return losses, {name: p.detach() for name, p in trainer.model.named_parameters() if p.requires_grad}

    (losses, adapters), (got_losses, got_adapters) = run("{policy: none}"), run(plan)
    assert got_losses == losses
    assert all(torch.equal(adapters[name], got_adapters[name]) for name in adapters)


# the generated stacks of the checkpointing tests, with LoRA (dropout on) on their linear and conv layers
_TARGETS = r".*\.\d+_(linear_relu_\.0|conv_silu_\.0|residual_add_|mm_view_add_|ema_buffer)$"


def _train_adapted(blocks: list[list[str]], checkpointing: dict | None):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(Stack(blocks), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.3, target_modules=_TARGETS))
    plan = MemoryPlan.model_validate({"checkpointing": checkpointing or {"policy": "none"}})
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.1)
    ids = torch.randint(0, 11, (3, 5))
    torch.manual_seed(1)
    losses, grads = [], []
    with apply_plan(model, plan, "cpu"):
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            grads += [p.grad.clone() for p in trained]
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses, grads, [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(st.lists(st.sampled_from(LAYERS), min_size=1, max_size=4), min_size=2, max_size=4))
def test_every_policy_is_exact_on_generated_models_with_lora(blocks):
    blocks = [["residual_add_", *blocks[0]], *blocks[1:]]  # a layer to adapt in the first block at least
    expected = _train_adapted(blocks, None)
    for policy in [{"policy": "full"}, {"policy": "every", "every": 2}, {"policy": "selective"}]:
        got = _train_adapted(blocks, policy)
        for part, (want, have) in enumerate(zip(expected, got, strict=True)):
            assert all(map(torch.equal, want, have)), (blocks, policy, ["losses", "grads", "params", "buffers"][part])


@pytest.mark.parametrize("overrides, key, said", [
    (["precision=fp32"], "model.lora.base_dtype", "a bf16 base runs under bf16 autocast, but precision is fp32"),
    (["model.lora.target_modules=[no_such_proj]"], "model.lora.target_modules", "peft cannot put LoRA on LlamaForCausalLM"),
    (["model.lora.target_modules=[]"], "model.lora.target_modules", "is empty, so no layer would train"),
    (["model.lora.rank=0"], "model.lora.rank", "greater than 0"),
    (["model.lora.quantize_base=nf4"], "model.lora.quantize_base", "QLoRA"),
    (["model.lora.export_merged=true", "distributed.strategy=fsdp"], "model.lora.export_merged",
     "merging needs the whole model in one process"),
    (["distributed={strategy: tp, tensor: 2}"], "model.lora", "LoRA wraps the linear layers tensor parallelism splits"),
])
def test_a_lora_setting_that_cannot_run_is_one_line_at_its_key(ckrun, overrides, key, said):
    shrink = ["model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.intermediate_size=128",
              "data.seq_len=32", "train.batch_size=4", "memory.micro_batch=null", "train.steps=1"]
    code, _, err = ckrun(LLAMA_LORA, *shrink, *overrides, "output.dir=/nonexistent/never-written")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{key}:" in err and said in err, err


def test_lora_on_a_model_peft_has_no_default_for_names_its_layers(ckrun, tmp_path):
    code, _, err = ckrun("validate", str(ROOT / "recipes" / "resnet50.yaml"), "model.lora={}")
    assert code == 2 and "model.lora.target_modules:" in err and "its linear layers: [fc]" in err, err  # built on meta
    code, _, err = ckrun(str(ROOT / "recipes" / "classic_cifar_cnn.yaml"), "model.lora={}", "train.steps=1",
                         "train.device=cpu", f"output.dir={tmp_path}")
    assert code == 2 and "model.lora.target_modules:" in err and "name the layers in model.lora.target_modules" in err, err


def test_qlora_on_a_cpu_is_one_line_before_any_weight_is_read():
    """Where bitsandbytes is installed the schema lets quantize_base through; building on a CPU then refuses."""
    from ckrun.runner.builders.adapters import pretrained_settings
    from ckrun.runner.builders.resolve import BuildError
    from ckrun.runner.recipe.recipe import ModelSpec
    from ckrun.runner.recipe.adapters import LoraSpec

    spec = ModelSpec(source="transformers", name="LlamaForCausalLM", pretrained="org/name",
                     lora=LoraSpec.model_construct(**{**LoraSpec().model_dump(), "quantize_base": "nf4"}))
    with pytest.raises(BuildError) as refused:
        pretrained_settings(spec, "cpu")
    assert refused.value.key == "model.lora.quantize_base" and "runs on CUDA, but this run is on cpu" in str(refused.value)


def test_lora_without_peft_installed_is_one_line(ckrun, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    code, _, err = ckrun("validate", LLAMA_LORA)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model.lora: LoRA comes from the peft package, which is not installed: pip install 'ckrun[lora]'" in err


def test_a_new_head_trains_beside_the_adapter_or_the_log_says_it_never_will(tmp_path, caplog):
    """A classifier from a causal LM's weights: its head starts random. peft trains a sequence classifier's head
    itself (modules_to_save); a head it does not know stays frozen, which the log says, naming the fix."""
    from ckrun.runner.builders.model import build_model
    from ckrun.runner.recipe.recipe import ModelSpec
    from tests.runner.builders.hub_cache import save_tiny_llama

    files = save_tiny_llama(tmp_path / "causal")
    spec = ModelSpec(source="transformers", name="LlamaForSequenceClassification", pretrained=str(files),
                     config={"num_labels": 3, "pad_token_id": 0}, lora={})
    with caplog.at_level("WARNING", logger="ckrun.runner.builders.adapters"):
        model = build_model(spec)
    assert any("score.modules_to_save" in name for name, p in model.named_parameters() if p.requires_grad)
    assert not [r for r in caplog.records if r.name == "ckrun.runner.builders.adapters"]
    with caplog.at_level("WARNING", logger="ckrun.runner.builders.adapters"):
        build_model(spec.model_copy(update={"name": "LlamaForTokenClassification"}))
    (said,) = [r.getMessage() for r in caplog.records if r.name == "ckrun.runner.builders.adapters"]
    assert said.startswith("model.lora: 2 weights the pretrained model lacks start random and stay frozen, so they "
                           "never train (e.g. score.")
    assert "add [score] to model.lora.modules_to_save" in said
