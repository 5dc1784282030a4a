"""Every file under recipes/ - found by glob, so a new recipe is covered without touching this file.

Each one must validate, build at full size on the meta device, explain itself in its header, and
- shrunk to 2 layers of width 64 or so through ordinary overrides - train 2 steps on the CPU
with exactly the same losses with no plan, full checkpointing and its own plan (fp32, same seed,
dropout on). The shrink table is per architecture: a recipe whose model is not in it fails with a
message asking for a row, rather than being skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckrun.runner.builders.model import build_model, count_parameters
from ckrun.runner.builders.checks import load_checked
from ckrun.runner.recipe.load import load_recipe
from ckrun.runner.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("**/*.yaml"))

# what every shrunk run shares: CPU, fp32 (exact losses), 2 steps of 4 samples in one pass, no
# CUDA-only offload (of activations or of the optimizer), no compile, no cap
COMMON = [
    "train.device=cpu", "train.steps=2", "train.batch_size=4", "precision=fp32", "memory.micro_batch=null",
    "memory.offload={policy: none}", "memory.optimizer_offload={policy: none}", "memory.compile=false",
    "memory.max_mem=null",
]
TEXT = ["data.seq_len=32"]
BERT = TEXT + [
    "model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.num_attention_heads=2",
    "model.config.intermediate_size=128", "model.config.vocab_size=512",
]
# torchvision's vit_* builders fix the depth and width, so the shrunk run builds the same
# VisionTransformer class (the same EncoderBlock blocks) directly with a small shape
TINY_VIT = ("model={source: python, name: 'torchvision.models.vision_transformer:VisionTransformer', config: "
            "{image_size: 32, patch_size: 8, num_layers: 2, num_heads: 2, hidden_dim: 64, mlp_dim: 128, "
            "dropout: 0.1, num_classes: 10}}")
TINY_RESNET = ["model.config.num_classes=10", "model.config.width_per_group=8", "data.image_size=32"]

SHRINK = {
    "BertForMaskedLM": BERT + ["model.config.max_position_embeddings=32"],
    "BertForSequenceClassification": BERT + ["model.config.max_position_embeddings=32"],
    "RobertaForMaskedLM": BERT + ["model.config.max_position_embeddings=34"],  # positions start at 2
    "GPT2LMHeadModel": TEXT + [
        "model.config.n_layer=2", "model.config.n_embd=64", "model.config.n_head=2", "model.config.vocab_size=512",
        "model.config.n_positions=32",
    ],
    "LlamaForCausalLM": TEXT + [
        "model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.num_attention_heads=4",
        "model.config.num_key_value_heads=2", "model.config.intermediate_size=128", "model.config.vocab_size=512",
        "model.config.max_position_embeddings=32",
    ],
    "MixtralForCausalLM": TEXT + [
        "model.config.num_hidden_layers=2", "model.config.hidden_size=64", "model.config.num_attention_heads=4",
        "model.config.num_key_value_heads=2", "model.config.intermediate_size=64", "model.config.vocab_size=512",
        "model.config.num_local_experts=4", "model.config.max_position_embeddings=32",
    ],
    "T5ForConditionalGeneration": TEXT + [
        "model.config.num_layers=2", "model.config.num_decoder_layers=2", "model.config.d_model=64",
        "model.config.d_kv=16", "model.config.num_heads=4", "model.config.d_ff=128", "model.config.vocab_size=512",
    ],
    # ResNets keep their real depth (the builder fixes it): 32x32 images and 8 instead of 64
    # channels per group in each bottleneck's 3x3 conv (a tenth of the parameters) make them cheap
    "resnet50": TINY_RESNET,
    "resnet152": TINY_RESNET,
    "vit_b_16": [TINY_VIT, "data.task=image_classification", "data.image_size=32"],
    "vit_l_16": [TINY_VIT, "data.task=image_classification", "data.image_size=32"],
    "ckrun.runner.models.classics:conv20": ["model.config.width=8", "model.config.depth=4", "data.image_size=16"],
    "ckrun.runner.models.classics:cifar_cnn": ["model.config.width=8"],
    "ckrun.runner.models.classics:transformer_stack": TEXT + [
        "model.config.width=64", "model.config.depth=2", "model.config.heads=2", "model.config.vocab_size=512",
        "model.config.max_len=32", "data.vocab_size=512",
    ],
}


def _id(path: Path) -> str:
    return path.relative_to(ROOT / "recipes").with_suffix("").as_posix()


@pytest.fixture(params=RECIPES, ids=_id)
def recipe_path(request) -> Path:
    return request.param


def test_the_library_is_there():
    assert len(RECIPES) >= 17


def test_validates_and_builds_at_full_size_on_meta(recipe_path):
    recipe, _ = load_checked(recipe_path)  # the schema and the checks after it, as `ckrun validate`
    assert recipe.description and "\n" not in recipe.description
    assert recipe.family in ("language", "vision", "classic")
    assert count_parameters(build_model(recipe.model, device="meta")) > 0


def test_header_gives_the_launch_and_tune_commands(recipe_path):
    header = recipe_path.read_text().split("\n\n")[0]
    assert header.startswith(f"# ckrun recipes/{recipe_path.name}")
    assert "ckrun tune" in header  # how to find a plan for your own card
    assert len(header.splitlines()) >= 4  # the launch lines and a word on what it trains and why


def shrunk(path: Path, checkpointing: str | None):
    """The recipe at a size that trains in milliseconds; `checkpointing` None keeps its own plan."""
    name = load_recipe(path).model.name
    assert name in SHRINK, f"{path.name}: add a row for {name!r} to SHRINK in {Path(__file__).name}"
    plan = [f"memory.checkpointing={checkpointing}"] if checkpointing else []
    lora = ["model.lora.base_dtype=fp32"] if load_recipe(path).model.lora is not None else []  # fp32 runs an fp32 base
    return load_recipe(path, COMMON + SHRINK[name] + plan + lora)


def losses(recipe) -> list[float]:
    trainer = Trainer(recipe)
    if recipe.memory.checkpointing.policy != "none":  # equal losses prove nothing if no block was wrapped
        assert trainer.plan.checkpointed, f"{recipe.memory.checkpointing.policy} checkpointed no block"
    return [trainer.train_step()["loss"] for _ in range(recipe.train.steps)]


def test_shrunk_trains_with_the_same_losses_under_every_plan(recipe_path):
    baseline = losses(shrunk(recipe_path, "{policy: none}"))
    assert all(loss == loss and loss > 0 for loss in baseline)  # finite and positive, not NaN
    assert losses(shrunk(recipe_path, "{policy: full}")) == baseline
    own = shrunk(recipe_path, None)
    if own.memory.checkpointing.policy not in ("none", "full"):
        assert losses(own) == baseline, f"the recipe's own plan {own.memory.checkpointing.policy} changed the losses"
