"""Every checkpointing policy trains to the same per-step losses as no plan, through the real CLI.

fp32, CPU, dropout on, fixed seed. Non-reentrant checkpointing replays the saved RNG state, so
recomputed dropout masks match and the losses are bit-identical: the test asserts equality.
"""

import shutil

import pytest
import torch

from conftest import BERT_TINY, TINY_BERT, read_metrics

POLICIES = {
    "full": "{policy: full}",
    "every2": "{policy: every, every: 2}",
    "layers": "{policy: layers, layers: [1, 2]}",
    "sqrt": "{policy: sqrt}",
    "selective": "{policy: selective}",
}

MODELS = {
    "bert": [*TINY_BERT, "model.config.num_hidden_layers=4"],
    "gpt2": ["model.name=GPT2LMHeadModel", "model.config={n_layer: 4, n_embd: 32, n_head: 2, vocab_size: 256, n_positions: 32}",
             "data.seq_len=32", "train.batch_size=4", "train.device=cpu"],
    "resnet": ["model.source=torchvision", "model.name=resnet18", "model.config={num_classes: 10}", "data.image_size=32",
               "train.batch_size=4", "train.device=cpu", "train.optimizer={name: sgd, lr: 0.05}"],
    "vit": ["model.name=ViTForImageClassification",
            "model.config={image_size: 32, patch_size: 8, num_hidden_layers: 4, num_attention_heads: 2, hidden_size: 32, "
            "intermediate_size: 64, num_labels: 10}", "train.batch_size=4", "train.device=cpu"],
}


def _run(ckrun, out, model_args, policy):
    code, _, err = ckrun(BERT_TINY, *model_args, "train.steps=5", "output.checkpoint_every=3",
                         f"memory.checkpointing={policy}", f"output.dir={out}")
    assert code == 0, err
    return [m["loss"] for m in read_metrics(out)]


@pytest.mark.parametrize("model", MODELS)
def test_every_policy_gives_the_losses_of_no_plan(tmp_path, ckrun, model):
    reference = _run(ckrun, tmp_path / "none", MODELS[model], "{policy: none}")
    for name, policy in POLICIES.items():
        assert _run(ckrun, tmp_path / name, MODELS[model], policy) == reference, name
        shutil.rmtree(tmp_path / name)  # a resnet run leaves 200 MB of checkpoints; a failed one stays to read


def test_batchnorm_statistics_are_updated_once_per_step(tmp_path, ckrun):
    states = {}
    for name, policy in {"none": "{policy: none}", "full": "{policy: full}"}.items():
        _run(ckrun, tmp_path / name, MODELS["resnet"], policy)
        checkpoint = torch.load(tmp_path / name / "checkpoints" / "step-00000003" / "state.pt", weights_only=True)
        states[name] = {k: v for k, v in checkpoint["model"].items() if "running" in k or "num_batches" in k}
    assert states["none"].keys() == states["full"].keys() and states["none"]
    for key, value in states["none"].items():
        assert torch.equal(value, states["full"][key]), key
    assert int(states["full"]["bn1.num_batches_tracked"]) == 3
