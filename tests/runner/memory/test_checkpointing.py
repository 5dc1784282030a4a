"""Checkpointing changes memory, never results: exact losses, gradients and BatchNorm statistics
against no plan (fp32, dropout on, same seed), recompute proven by backward FLOP counts and the
saving by the bytes a forward leaves alive for backward."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torchvision
import transformers
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ckrun.runner.memory.apply import apply_plan
from ckrun.runner.memory.blocks import find_blocks
from ckrun.runner.plan.policies import sqrt_segments
from ckrun.runner.memory.measure import SavedBytes
from ckrun.runner.plan.memory_plan import MemoryPlan

TEXT = dict(vocab_size=100, max_position_embeddings=32)


def _text_batch():
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 12:] = 0  # padding makes the attention mask a real kwarg of every layer
    return lambda m: m(input_ids=ids, attention_mask=mask, labels=ids).loss


def bert():
    config = transformers.BertConfig(**TEXT, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                                     intermediate_size=128)  # dropout 0.1 by default
    model = transformers.BertForMaskedLM(config)
    return model, _text_batch()


def gpt2():
    config = transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=4, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    return model, _text_batch()


def t5():
    config = transformers.T5Config(vocab_size=100, d_model=64, d_ff=128, d_kv=32, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(1, 100, (2, 16))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


def vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=4,
                                    num_attention_heads=2, intermediate_size=128, num_labels=10,
                                    hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = transformers.ViTForImageClassification(config)
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return model, lambda m: m(pixel_values=images, labels=labels).loss


def resnet():
    model = torchvision.models.resnet18(num_classes=10)
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    return model, lambda m: nn.functional.cross_entropy(m(images), labels)


def swin():
    # torchvision's swin_v2_t at a tiny width: PatchMergingV2 runs between the stages the finder takes as
    # blocks (the stem and 4 stages: sqrt's first segment, [stem, stage 1, stage 2], spans one)
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2
    model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2, 2, 2], num_heads=[2, 2, 2, 2], window_size=[4, 4],
                            stochastic_depth_prob=0.2, num_classes=10, block=SwinTransformerBlockV2,
                            downsample_layer=PatchMergingV2)
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    return model, lambda m: nn.functional.cross_entropy(m(images), labels)


def pegasus():
    # LayerDrop: a coin drawn between layers, the layer skipped (0.5, so 3 steps skip some and run others)
    config = transformers.PegasusConfig(vocab_size=100, d_model=32, encoder_layers=4, decoder_layers=4,
                                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                        decoder_ffn_dim=64, max_position_embeddings=32, encoder_layerdrop=0.5,
                                        decoder_layerdrop=0.5, pad_token_id=0, decoder_start_token_id=0)
    model = transformers.PegasusForConditionalGeneration(config)
    ids = torch.randint(1, 100, (2, 16))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny models: thread start-up and spinning cost more than the math, badly so on a busy machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


MODELS = {"bert": bert, "gpt2": gpt2, "t5": t5, "vit": vit, "resnet": resnet, "swin": swin, "pegasus": pegasus}
POLICIES = {
    "full": {"policy": "full"},
    "every2": {"policy": "every", "every": 2},
    "layers": {"policy": "layers", "layers": [1, 2]},
    "sqrt": {"policy": "sqrt"},
    "selective": {"policy": "selective"},
}


def plan(checkpointing: dict | None = None, **memory) -> MemoryPlan:
    return MemoryPlan.model_validate({"checkpointing": checkpointing or {"policy": "none"}, **memory})


def train(name: str, checkpointing: dict | None, steps: int = 3):
    """Losses of `steps` SGD steps, then the last gradients, parameters and buffers."""
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    model.train()
    applied = apply_plan(model, plan(checkpointing), "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # the same dropout masks in every run
    losses = []
    for _ in range(steps):
        loss = loss_of(model)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    applied.remove()
    return losses, grads, dict(model.named_parameters()), dict(model.named_buffers())


@functools.cache
def baseline(name: str):
    return train(name, None)


def assert_identical(expected, actual):
    for want, got in zip(expected, actual, strict=True):
        if isinstance(want, list):
            assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True)), "losses differ"
        else:
            assert want.keys() == got.keys()
            different = [key for key in want if not torch.equal(want[key], got[key])]
            assert not different, f"not bit-identical: {different[:5]}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["bert", "gpt2", "vit", "resnet", "t5", "swin", "pegasus"])
def test_every_policy_is_exact(name, policy):
    # all policies are bit-identical on CPU: the recompute replays the same ops on the same inputs
    # with the RNG restored, and selective only replaces recomputed values by the saved ones
    assert_identical(baseline(name), train(name, POLICIES[policy]))


def test_batchnorm_statistics_move_once_per_forward():
    torch.manual_seed(0)
    model, loss_of = resnet()
    apply_plan(model, plan({"policy": "full"}), "cpu")
    loss_of(model).backward()  # the backward recomputes every block, BatchNorms included
    tracked = [m.num_batches_tracked.item() for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert tracked == [1] * len(tracked)


def test_autocast_and_an_input_without_grad():
    # the first block's input does not require grad; the block's weights still get gradients
    def run(checkpointing):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.2)) for _ in range(4)])
        apply_plan(model, plan(checkpointing), "cpu")
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(8, 32)).float().square().mean()
        loss.backward()
        return loss, [p.grad for p in model.parameters()]

    loss, grads = run(None)
    for checkpointing in ({"policy": "full"}, {"policy": "selective"}, {"policy": "sqrt"}):
        other_loss, other_grads = run(checkpointing)
        assert torch.equal(loss, other_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, other_grads, strict=True))


def test_remove_puts_the_model_back_and_a_new_plan_applies():
    torch.manual_seed(0)
    model, loss_of = gpt2()
    assert model.config.use_cache
    applied = apply_plan(model, plan({"policy": "full"}), "cpu")
    assert not model.config.use_cache  # a recompute would write the KV cache a second time
    applied.remove()
    applied.remove()  # twice is harmless
    assert model.config.use_cache
    assert all("forward" not in module.__dict__ for module in model.modules())
    with apply_plan(model, plan({"policy": "every", "every": 3}), "cpu") as applied:
        assert applied.checkpointed == [0, 3]
        assert sum("forward" in block.module.__dict__ for block in applied.blocks) == 2
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_decisions_are_logged(caplog):
    model, _ = bert()
    with caplog.at_level(logging.INFO, logger="ckrun.runner.memory"):
        apply_plan(model, plan({"policy": "every", "every": 2}), "cpu").remove()
    assert "checkpointing 2 of 4 blocks (every 2nd: 0,2)" in caplog.text


# --- recompute, counted ----------------------------------------------------------------------


def measure(name: str, checkpointing: dict | None):
    """(forward FLOPs by module, backward FLOPs, bytes the forward left alive for backward: SavedBytes)."""
    torch.manual_seed(0)
    model, loss_of = MODELS[name]()
    applied = apply_plan(model, plan(checkpointing), "cpu")
    with FlopCounterMode(display=False) as counter:
        with SavedBytes(model) as saved:
            loss = loss_of(model)
        forward = {module: sum(counts.values()) for module, counts in counter.get_flop_counts().items()}
        loss.backward()
    backward = counter.get_total_flops() - forward["Global"]
    prefix = type(model).__name__ + "."
    block_flops = [forward[prefix + block.name] for block in applied.blocks or find_blocks(model)]
    return block_flops, backward, saved.bytes


@pytest.mark.parametrize("name", ["bert", "resnet"])
def test_backward_recomputes_exactly_the_checkpointed_blocks(name):
    block_flops, backward, _ = measure(name, None)
    for policy in ("full", "every2", "layers", "sqrt"):
        _, checkpointed_backward, _ = measure(name, POLICIES[policy])
        torch.manual_seed(0)
        model, _ = MODELS[name]()
        chosen = apply_plan(model, plan(POLICIES[policy]), "cpu").checkpointed
        assert checkpointed_backward - backward == sum(block_flops[i] for i in chosen), policy


def test_saved_bytes_fall_and_selective_keeps_matmuls():
    _, backward, none = measure("bert", None)
    _, full_backward, full = measure("bert", POLICIES["full"])
    _, _, every2 = measure("bert", POLICIES["every2"])
    _, selective_backward, selective = measure("bert", POLICIES["selective"])
    assert full < every2 < none
    assert full < selective < none
    # FlopCounterMode counts matmuls and attention only; selective keeps exactly those, so its
    # backward recomputes no counted FLOP while full recomputes every block
    assert selective_backward == backward < full_backward


def _product_blocks(layer, shape):
    """Four blocks of three products (`layer()` each) with Tanh between, and an input of `shape`."""
    blocks = [nn.Sequential(layer(), nn.Tanh(), layer(), nn.Tanh(), layer()) for _ in range(4)]
    return nn.Sequential(*blocks), torch.randn(*shape, requires_grad=True)


@pytest.mark.parametrize("layer, shape", [(lambda: nn.Linear(16, 16, bias=False), (8, 16)),
                                          (lambda: nn.Conv2d(4, 4, 3, padding=1, bias=False), (2, 4, 6, 6))],
                         ids=["mm", "convolution"])
def test_selective_at_a_product_stride_recomputes_every_second_product(layer, shape):
    """products_kept_every 2 (on mm: torchtitan's 'selective op'): of each block's three products the 1st
    and 3rd stay cached and the 2nd is recomputed, so the backward runs one more product per block (its
    FLOPs counted) and the forward leaves one product's output less per block alive."""
    def run(checkpointing):
        torch.manual_seed(0)
        model, x = _product_blocks(layer, shape)
        apply_plan(model, plan(checkpointing), "cpu")
        with FlopCounterMode(display=False) as counter:  # the forwards are the same under both: the difference is the backward's
            with SavedBytes(model) as saved:
                loss = model(x).sum()
            loss.backward()
        return counter.get_total_flops(), saved.bytes
    kept_all, every_second = run({"policy": "selective"}), run({"policy": "selective", "products_kept_every": 2})
    with FlopCounterMode(display=False) as one:
        layer()(torch.randn(*shape))
    assert every_second[0] - kept_all[0] == 4 * one.get_total_flops()
    assert every_second[1] < kept_all[1]


def chain(blocks: int = 16, width: int = 64):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)])


def test_sqrt_keeps_only_segment_boundaries():
    # cheap blocks (saved activations about twice the block input): here sqrt segments beat per-block
    def saved_bytes(checkpointing):
        model = chain()
        applied = apply_plan(model, plan(checkpointing), "cpu")
        weights, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, [0]

        def pack(tensor):  # every save counts, also two saves of one storage: the exact sums below rely on it
            saved[0] += 0 if tensor.untyped_storage().data_ptr() in weights else tensor.numel() * 4
            return tensor
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(torch.randn(8, 64, requires_grad=True)).sum().backward()
        return saved[0], applied

    boundary = 8 * 64 * 4
    full, _ = saved_bytes({"policy": "full"})
    sqrt, applied = saved_bytes({"policy": "sqrt"})
    assert sqrt_segments(applied.blocks) == [list(range(i, i + 4)) for i in (0, 4, 8, 12)]
    assert full == 16 * boundary  # every block's input
    assert sqrt == 3 * boundary + 4 * 2 * boundary  # 3 segment inputs + the last segment, not checkpointed


def test_saved_bytes_counts_what_each_policy_keeps_on_every_torch():
    # per block: addmm saves its input, tanh its output (the next block's input); the model's input x
    # existed before and is not counted. Selective's cached addmm outputs live outside autograd's
    # saved tensors (torch < 2.14 shows them to no saved-tensor hook): they must count all the same
    boundary = 8 * 64 * 4
    x = torch.randn(8, 64, requires_grad=True)
    expected = {"none": 16, "full": 15, "sqrt": 2 + 5, "selective": 15 + 16}
    for policy, blocks in expected.items():
        model = chain()
        apply_plan(model, plan(None if policy == "none" else POLICIES[policy]), "cpu")
        with SavedBytes(model) as kept:
            loss = model(x).sum()
        with SavedBytes(model) as dropped:
            model(x).sum()  # the graph is dropped inside the region: SavedBytes holds it until the end
        assert (kept.bytes, dropped.bytes) == (blocks * boundary + loss.nbytes, blocks * boundary), policy


@pytest.mark.parametrize(("name", "size"), [("googlenet", 64), ("inception_v3", 80)])
def test_full_checkpointing_of_inception_networks_keeps_a_fraction_of_their_activations(name, size):
    # GoogLeNet's blocks were 36 inner branches, whose inputs are the Inceptions' activations: full saved 1%;
    # Inception v3 had no blocks at all (its Inceptions are plain attributes of five classes)
    def saved(checkpointing):
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(num_classes=10, init_weights=False, aux_logits=False)
        apply_plan(model, plan(checkpointing), "cpu")
        with SavedBytes(model) as kept:
            loss = model(torch.randn(2, 3, size, size)).sum()
        del loss
        return kept.bytes

    assert saved({"policy": "full"}) < 0.6 * saved(None)  # GoogLeNet's stem before the first Inception stays


def test_sqrt_segments_stay_inside_their_container():
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=100, d_model=64, d_ff=128, d_kv=32, num_layers=5, num_heads=2))
    blocks = find_blocks(model)
    assert sqrt_segments(blocks) == [[0, 1, 2], [3, 4], [5, 6, 7], [8, 9]]  # 3 per segment, split per stack


def test_sqrt_is_exact_when_the_forward_skips_a_block_or_ends_inside_a_segment():
    # a skipped block ends its region and starts another; the region open when the forward ends is closed there
    class Skipping(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = chain(9)

        def forward(self, x):
            for index in (0, 2, 1, 4, 5):  # 1 skipped then called out of order, segment [3, 4, 5] entered at 4
                x = self.layers[index](x)
            return x

    def gradients(checkpointing):
        torch.manual_seed(0)
        model = Skipping()
        with apply_plan(model, plan(checkpointing), "cpu"):
            model(torch.randn(2, 64)).sum().backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    assert all(map(torch.equal, gradients(None), gradients({"policy": "sqrt"})))
    chain(2)(torch.randn(2, 64, requires_grad=True)).sum().backward()  # no hooks left behind
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # private: where this torch has it
    assert top is None or top(False) is None


# --- bad input ---------------------------------------------------------------------------------


def test_layer_out_of_range():
    model, _ = bert()
    with pytest.raises(ValueError) as error:
        apply_plan(model, plan({"policy": "layers", "layers": [1, 30]}), "cpu")
    assert str(error.value) == ("memory.checkpointing.layers: block 30 is out of range; "
                                "the model has 4 blocks (0-3)")
    assert all("forward" not in module.__dict__ for module in model.modules())


def test_bad_block_path():
    model, _ = bert()
    with pytest.raises(ValueError, match=r"^memory.blocks: .*'bert.encoder.layers' \(did you mean bert.encoder.layer\?\)"):
        apply_plan(model, plan({"policy": "full"}, blocks="bert.encoder.layers"), "cpu")


def test_no_plan_needs_no_blocks():
    model = nn.Linear(4, 4)  # nothing repeated: fine while the plan asks for nothing
    assert apply_plan(model, plan(), "cpu").blocks is None
    with pytest.raises(ValueError, match="memory.blocks: found no repeated blocks"):
        apply_plan(model, plan({"policy": "full"}), "cpu")


def test_selective_recomputes_attention_that_draws_dropout():
    # on the GPU, fused attention with dropout draws random numbers: caching it would let the
    # recompute skip that draw and shift every later dropout mask of the block
    from torch.utils.checkpoint import CheckpointPolicy

    from ckrun.runner.memory.selective import static_policy

    policy = static_policy(frozenset({"mm", "_scaled_dot_product_efficient_attention"}))
    attention = torch.ops.aten._scaled_dot_product_efficient_attention.default
    q = torch.empty(1, 1, 4, 8)
    assert policy(None, torch.ops.aten.mm.default, q[0, 0], q[0, 0].T) is CheckpointPolicy.MUST_SAVE
    assert policy(None, attention, q, q, q, None, False, 0.0) is CheckpointPolicy.MUST_SAVE
    assert policy(None, attention, q, q, q, None, False, 0.1) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, torch.ops.aten.native_dropout.default, q, 0.1, True) is CheckpointPolicy.PREFER_RECOMPUTE
