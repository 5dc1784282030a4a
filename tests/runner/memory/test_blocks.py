"""Block discovery finds the repeated layers of the common model families, on the meta device."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings, strategies as st
import torch
import torchvision
import transformers
from torch import nn

from ckrun.runner.cli.show import print_blocks
from ckrun.runner.memory.blocks import find_blocks
from ckrun.runner.problems import InputError
from ckrun.runner.recipe.recipe import Recipe

SMALL = dict(hidden_size=64, num_attention_heads=2, intermediate_size=128)


class UserModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.stages = nn.ModuleList([nn.TransformerEncoderLayer(16, 2, 32, batch_first=True) for _ in range(3)])
        self.heads = nn.ModuleList([nn.Linear(16, 2), nn.Linear(16, 2)])  # repeated too, but fewer parameters


CASES = {
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=3, **SMALL)),
             "bert.encoder.layer", ["bert.encoder.layer.0", "bert.encoder.layer.1", "bert.encoder.layer.2"]),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2)),
             "transformer.h", ["transformer.h.0", "transformer.h.1"]),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2, **SMALL)),
              "model.layers", ["model.layers.0", "model.layers.1"]),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=64, d_ff=128, num_layers=2,
                                                                                  num_heads=2)),
           "encoder.block, decoder.block", ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
    "hf_vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(num_hidden_layers=2, **SMALL)),
               "vit.layers", ["vit.layers.0", "vit.layers.1"]),
    "tv_vit": (lambda: torchvision.models.vit_b_16(), "encoder.layers",
               [f"encoder.layers.encoder_layer_{i}" for i in range(12)]),
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), "layer1, layer2, layer3, layer4",
                 [f"layer{stage}.{i}" for stage in range(1, 5) for i in range(2)]),
    "sequential": (lambda: nn.Sequential(nn.Linear(8, 16), *[nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                                                             for _ in range(3)], nn.Linear(16, 2)),
                   "", ["1", "2", "3"]),
    "user_modulelist": (UserModel, "stages", ["stages.0", "stages.1", "stages.2"]),
    # issue 32: the encoder's layers are another class than the decoder's, and were never blocks
    "pegasus": (lambda: transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64)), "model.encoder.layers, model.decoder.layers",
        ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1"]),
    # issue 32: the Inceptions sit in no container; their 36 inner branches were the blocks (full saved 1%)
    "googlenet": (lambda: torchvision.models.googlenet(init_weights=False, aux_logits=False), "",
                  [f"inception{name}" for name in ("3a", "3b", "4a", "4b", "4c", "4d", "4e", "5a", "5b")]),
    # no container repeats a class (eleven Inceptions of five classes, plain attributes): none were found
    "inception_v3": (lambda: torchvision.models.inception_v3(init_weights=False, aux_logits=False), "",
                     ["Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "Conv2d_3b_1x1", "Conv2d_4a_3x3",
                      *(f"Mixed_{name}" for name in ("5b", "5c", "5d", "6a", "6b", "6c", "6d", "6e", "7a", "7b", "7c"))]),
}


@pytest.mark.parametrize("case", CASES)
def test_finds_the_repeated_blocks(case):
    build, container, names = CASES[case]
    with torch.device("meta"):
        model = build()
    blocks = find_blocks(model)
    assert blocks.container_name == container
    assert [block.name for block in blocks] == names
    assert [block.index for block in blocks] == list(range(len(names)))
    assert all(block.module is model.get_submodule(block.name) for block in blocks)


def test_resnet50_blocks_are_its_bottlenecks():
    with torch.device("meta"):
        blocks = find_blocks(torchvision.models.resnet50())
    assert len(blocks) == 3 + 4 + 6 + 3
    assert {type(block.module).__name__ for block in blocks} == {"Bottleneck"}


def test_explicit_container():
    model = UserModel()
    blocks = find_blocks(model, "heads")
    assert blocks.container_name == "heads"
    assert [block.name for block in blocks] == ["heads.0", "heads.1"]


def test_explicit_container_that_does_not_exist():
    with pytest.raises(ValueError) as error:
        find_blocks(UserModel(), "stage")
    assert str(error.value) == "memory.blocks: UserModel has no module 'stage' (did you mean stages?)"


def test_explicit_path_that_is_not_a_container():
    with pytest.raises(ValueError, match="memory.blocks: 'embed' is a Linear, not an nn.ModuleList or nn.Sequential"):
        find_blocks(UserModel(), "embed")


def test_nothing_repeated():
    model = nn.Module()  # a model without any container
    model.body = nn.Linear(4, 4)
    with pytest.raises(ValueError) as error:
        find_blocks(model)
    assert "found no repeated blocks in Module" in str(error.value)
    assert 'memory.blocks: "path.to.container"' in str(error.value)


def bert_recipe(**memory) -> Recipe:
    return Recipe.model_validate({
        "model": {"source": "transformers", "name": "BertForMaskedLM", "config": {"num_hidden_layers": 2, **SMALL}},
        "train": {"batch_size": 2, "steps": 1},
        "memory": memory,
    })


def test_print_blocks_of_a_bad_path_is_a_located_problem():
    with pytest.raises(InputError) as error:
        print_blocks(bert_recipe(blocks="bert.encoder.layers"))
    [problem] = error.value.problems
    assert problem.key == "memory.blocks"
    assert problem.message.endswith("(did you mean bert.encoder.layer?)")


def test_print_blocks(capsys):
    recipe = bert_recipe()
    assert print_blocks(recipe) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "bert.encoder.layer: 2 blocks (BertLayer)"
    assert lines[1].split() == ["0", "bert.encoder.layer.0", "33,472", "parameters"]  # 4 x (64x64+64) attention, 2 LayerNorms, 64-128-64 MLP
    assert lines[2].split()[:2] == ["1", "bert.encoder.layer.1"]


# --- generated: whatever the model's tree, the blocks found never nest -----------------------------


class _Unit(nn.Module):
    """A module of modules in no container (an Inception's branches are its plain attributes)."""

    def __init__(self, children: list[nn.Module]):
        super().__init__()
        for i, child in enumerate(children):
            setattr(self, f"part{i}", child)


class _OtherUnit(_Unit):
    pass


def _trees():
    leaf = st.builds(lambda width: nn.Linear(width, width), st.integers(1, 6))
    wrappers = [lambda kids: nn.Sequential(*kids), lambda kids: nn.ModuleList(kids), _Unit, _OtherUnit]
    return st.recursive(leaf, lambda inner: st.builds(lambda make, kids: make(kids), st.sampled_from(wrappers),
                                                      st.lists(inner, min_size=1, max_size=4)), max_leaves=24)


def _seq(*kids: nn.Module) -> nn.Sequential:
    return nn.Sequential(*kids)


def test_blocks_never_nest_whatever_the_tree():
    @settings(max_examples=150, deadline=None)
    @given(_trees())
    # drawn by a seeded run: the root's two Sequentials and the second one's own two were one group, nested
    @example(_seq(_seq(nn.Linear(1, 1)), _seq(_seq(nn.Linear(1, 1)), _seq(nn.Linear(1, 1)))))
    def check(model):
        try:
            blocks = find_blocks(model)
        except ValueError:
            return  # nothing repeated: a one-line error that names the key
        names = [block.name for block in blocks]
        assert len(set(names)) == len(names)
        assert not [(a, b) for a in names for b in names if a != b and b.startswith(f"{a}.")], names
        modules = [id(block.module) for block in blocks]
        assert len(set(modules)) == len(modules)
        assert all(block.module is model.get_submodule(block.name) for block in blocks)
    check()
