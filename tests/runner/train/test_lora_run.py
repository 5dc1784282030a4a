"""A LoRA run's ends: the adapter exported as peft saves it (and the merged model), checkpoints of the
adapter alone that resume exactly, and what cannot start from them said in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import read_metrics
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.train.output.export import finish_run
from ckrun.runner.train.trainer import Trainer
from tests.runner.builders.hub_cache import commit_of, offline_cache, put_in_cache, save_tiny_llama, tiny_llama_recipe

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def hub(monkeypatch, tmp_path):
    cache = offline_cache(monkeypatch, tmp_path)
    snapshot = put_in_cache(cache, REPO, save_tiny_llama(tmp_path / "saved", seed=7), commit_of("base"))
    return snapshot


def _recipe(out: Path, lora: str, rest: str = ""):
    return recipe_from_text(tiny_llama_recipe(f"pretrained: {REPO}\nlora: {lora}", f"output: {{dir: {out}}}\n{rest}"))


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def test_the_adapter_loads_with_peft_onto_the_hub_base_and_gives_ckruns_logits(hub, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    trainer = Trainer(_recipe(tmp_path / "run", "{rank: 4, alpha: 8, target_modules: all-linear, dropout: 0.1}"))
    for _ in range(3):
        trainer.train_step()
    exported = finish_run(trainer, tmp_path / "run")
    assert exported == tmp_path / "run" / "adapter"
    assert {p.name for p in exported.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "recipe.yaml"}
    assert not (tmp_path / "run" / "model").exists()  # no merged model unless asked for
    ours = _logits(trainer.model)
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(str(hub)), str(exported))
    assert torch.equal(_logits(loaded), ours)
    assert not torch.equal(_logits(LlamaForCausalLM.from_pretrained(str(hub))), ours)  # the adapter did change them


def test_the_merged_export_loads_with_transformers_alone_and_starts_another_run(hub, tmp_path, ckrun):
    from transformers import AutoModelForCausalLM

    trainer = Trainer(_recipe(tmp_path / "run", "{target_modules: [q_proj, v_proj, up_proj], export_merged: true}"))
    for _ in range(2):
        trainer.train_step()
    ours = _logits(trainer.model)
    exported = finish_run(trainer, tmp_path / "run")
    assert exported == tmp_path / "run" / "model" and (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(str(exported))
    assert not any("lora" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged), ours, rtol=0, atol=1e-5)  # W + BA summed once, not per step
    recipe = tmp_path / "again.yaml"
    recipe.write_text(tiny_llama_recipe(f"pretrained: {exported}", f"output: {{dir: {tmp_path / 'again'}}}\n"))
    code, _, err = ckrun(str(recipe), "train.steps=1")
    assert code == 0, err


def _write(tmp_path: Path, name: str, lora: str = "{rank: 4, dropout: 0.1}") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(tiny_llama_recipe(f"pretrained: {REPO}\nlora: {lora}",
                                      f"output: {{dir: {tmp_path / name}, checkpoint_every: 1}}\n"))
    return path


def test_a_lora_checkpoint_holds_the_adapter_and_resumes_exactly(hub, tmp_path, ckrun):
    straight, resumed = _write(tmp_path, "straight"), _write(tmp_path, "resumed")
    assert ckrun(str(straight), "train.steps=4")[0] == 0
    assert ckrun(str(resumed), "train.steps=2")[0] == 0
    state = torch.load(tmp_path / "resumed" / "checkpoints" / "step-00000002" / "state.pt", weights_only=True)
    trained = [name for name in state["model"] if "lora_" in name]
    assert state["trainable_only"] and trained
    assert all("lora_" in name or "rotary_emb" in name for name in state["model"])  # the adapter and buffers
    assert len(state["optimizer"]["state"]) == len(trained)
    code, _, err = ckrun(str(resumed), "train.steps=4", "--resume")
    assert code == 0, err
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed")] == [r["loss"] for r in read_metrics(tmp_path / "straight")]


def test_resuming_an_adapter_on_another_base_is_refused(hub, tmp_path, ckrun):
    run = _write(tmp_path, "run")
    assert ckrun(str(run), "train.steps=1")[0] == 0
    code, _, err = ckrun(str(run), "train.steps=2", f"model.pretrained={tmp_path / 'saved'}", "--resume")
    assert code == 2 and "model.pretrained" in err and "was trained with a different model" in err, err


@pytest.mark.parametrize("start, said", [
    ("adapter", "holds a LoRA adapter, not a model"),
    ("checkpoints/step-00000001", "is a LoRA run's checkpoint, which holds the adapter and not the model"),
])
def test_what_a_lora_run_leaves_is_no_model_to_start_from(hub, tmp_path, ckrun, start, said):
    run = _write(tmp_path, "run")
    assert ckrun(str(run), "train.steps=1")[0] == 0
    again = tmp_path / "again.yaml"
    again.write_text(tiny_llama_recipe(f"pretrained: {tmp_path / 'run' / start}", f"output: {{dir: {tmp_path / 'x'}}}\n"))
    code, _, err = ckrun(str(again), "train.steps=1")
    assert code == 2 and "model.pretrained:" in err and said in err, err
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_a_checkpoint_written_before_the_lora_and_revision_keys_still_resumes(tmp_path, ckrun):
    """Its fingerprint lacks model.lora and model.revision, which are null now: no setting changed."""
    import json

    from ckrun.runner.train.checkpoint.store import save_checkpoint

    recipe = tmp_path / "plain.yaml"
    recipe.write_text(tiny_llama_recipe("", f"output: {{dir: {tmp_path / 'run'}}}\n"))
    assert ckrun(str(recipe), "train.steps=1")[0] == 0
    root = tmp_path / "run" / "checkpoints"
    state = torch.load(root / "step-00000001" / "state.pt", weights_only=True)
    model = json.loads(state["recipe"]["model"])
    assert model.pop("lora") is None
    state["recipe"]["model"] = json.dumps(model, sort_keys=True)  # as ckrun wrote it before these keys
    save_checkpoint(root, 1, state)
    code, _, err = ckrun(str(recipe), "train.steps=2", "--resume")
    assert code == 0, err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qlora_trains_a_4bit_base_on_cuda_and_exports_its_adapter(hub, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes

    recipe = recipe_from_text(tiny_llama_recipe(
        f"pretrained: {REPO}\nlora: {{quantize_base: nf4, base_dtype: bf16, target_modules: all-linear}}",
        f"precision: bf16\noutput: {{dir: {tmp_path / 'run'}}}\n").replace("device: cpu", "device: cuda"))
    trainer = Trainer(recipe)
    assert any(isinstance(m, bitsandbytes.nn.Linear4bit) for m in trainer.model.modules())
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    assert all(loss == loss and loss > 0 for loss in losses)
    assert (finish_run(trainer, tmp_path / "run") / "adapter_model.safetensors").is_file()


def test_a_lora_checkpoint_is_refused_before_a_model_of_the_default_config_is_built(hub, tmp_path, ckrun, monkeypatch):
    """model.config={} takes the architecture from model.pretrained's config.json, which a checkpoint lacks:
    building first would make LlamaConfig()'s 7B model, killed for memory before the line could be said."""
    import transformers

    from ckrun.runner.builders.model import BuildError, build_model
    from ckrun.runner.recipe.recipe import ModelSpec

    run = _write(tmp_path, "run")
    assert ckrun(str(run), "train.steps=1")[0] == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000001"

    llama = str(Path(__file__).resolve().parents[3] / "recipes" / "llama_1b.yaml")
    for verb in (["validate"], []):
        code, _, err = ckrun(*verb, llama, "model.config={}", f"model.pretrained={checkpoint}",
                             f"output.dir={tmp_path / 'x'}", "train.device=cpu")
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "model.pretrained:" in err and "merged export (model.lora.export_merged: true)" in err, err

    def never(*args, **kwargs):
        raise AssertionError("a model was built for a LoRA checkpoint")

    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", never)  # validate's build is on the meta device
    with pytest.raises(BuildError, match="is a LoRA run's checkpoint"):
        build_model(ModelSpec(source="transformers", name="LlamaForCausalLM", pretrained=str(checkpoint)))


def test_the_adapter_names_its_hub_base_and_loads_with_auto_peft_from_another_cache(hub, tmp_path, ckrun, monkeypatch):
    """adapter_config.json names the base by its Hub id and the commit trained on, not the snapshot's absolute path:
    AutoPeftModelForCausalLM on another machine finds the base in its own cache, under that name."""
    import json

    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    run = _write(tmp_path, "run", "{rank: 4, target_modules: all-linear, export_merged: true}")
    code, _, err = ckrun(str(run), "train.steps=2")
    assert code == 0, err
    adapter = tmp_path / "run" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == (REPO, commit_of("base"))
    elsewhere = tmp_path / "elsewhere"  # another machine's cache: the base downloaded there, this one gone
    elsewhere.mkdir()
    second = offline_cache(monkeypatch, elsewhere)
    put_in_cache(second, REPO, save_tiny_llama(tmp_path / "downloaded", seed=7), commit_of("base"))
    shutil.rmtree(hub.parent.parent.parent)
    moved = tmp_path / "moved-adapter"  # and the adapter copied to another folder
    shutil.copytree(adapter, moved)
    loaded = AutoPeftModelForCausalLM.from_pretrained(str(moved))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "model"))
    torch.testing.assert_close(_logits(loaded), _logits(merged), rtol=0, atol=1e-5)
