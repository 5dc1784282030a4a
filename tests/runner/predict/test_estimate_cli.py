"""`ckrun estimate`: predicted peaks that match what a CPU run measures, and bert_large on a laptop."""

import json

import pytest

from conftest import BERT_TINY, read_metrics

# A GPT-2-style decoder, a ResNet and a ViT beside bert_tiny, each small enough to train in seconds.
MODELS = {
    "bert_tiny": ["model.config.vocab_size=1024", "data.seq_len=64", "train.batch_size=8"],
    "gpt2": ["model.name=GPT2LMHeadModel", "model.config={n_layer: 4, n_embd: 64, n_head: 2, vocab_size: 512, n_positions: 64}",
             "data.seq_len=64", "train.batch_size=8"],
    "resnet": ["model.source=torchvision", "model.name=resnet18", "model.config={num_classes: 10}", "data.image_size=96",
               "train.batch_size=8", "train.optimizer={name: sgd}"],
    "vit": ["model.name=ViTForImageClassification", "model.config={image_size: 32, patch_size: 4, num_hidden_layers: 4, "
            "num_attention_heads: 2, hidden_size: 64, intermediate_size: 128, num_labels: 10}", "train.batch_size=8"],
}
PLANS = {"none": "{policy: none}", "full": "{policy: full}", "every2": "{policy: every, every: 2}",
         "selective": "{policy: selective}"}


def _estimate(ckrun, args):
    code, out, err = ckrun("estimate", BERT_TINY, *args, "--device", "cpu", "--json")
    assert code == 0, err
    return json.loads(out)


# every model at 2 micro-batches of 4 (the fake step, then the later micro-batches' accumulation); the whole batch in
# one pass on bert_tiny by default, on the others with -m slow (the same single-pass path as bert_tiny's)
CASES = [(4, model) for model in MODELS] + [(8, "bert_tiny")] + \
    [pytest.param(8, model, marks=pytest.mark.slow) for model in MODELS if model != "bert_tiny"]


@pytest.mark.parametrize(("micro", "model"), CASES)
def test_estimate_is_within_5_percent_of_the_measured_cpu_peak(tmp_path, ckrun, model, micro):
    for name, plan in PLANS.items():
        args = [*MODELS[model], "train.device=cpu", f"memory.micro_batch={micro}", f"memory.checkpointing={plan}"]
        predicted = _estimate(ckrun, args)["peak_bytes"]
        out = tmp_path / f"{name}"
        assert ckrun(BERT_TINY, *args, "train.steps=2", f"output.dir={out}")[0] == 0
        measured = max(m["peak_mem_bytes"] for m in read_metrics(out))
        assert predicted == pytest.approx(measured, rel=0.05), (name, predicted, measured)


def test_bert_large_for_cuda_on_a_cpu_machine(ckrun):
    # how fast this runs is a benchmark's business (bench/estimate_accuracy.py), not a test's
    none = _cuda_estimate(ckrun, "{policy: none}")
    full = _cuda_estimate(ckrun, "{policy: full}")
    ratio = none["breakdown"]["activations"] / full["breakdown"]["activations"]
    # what stays under full checkpointing: the 24 fp32 block boundaries (LayerNorm runs in fp32
    # under autocast) and the MLM head's logits at the masked positions
    assert ratio > 5, ratio
    assert none["peak_bytes"] > full["peak_bytes"] > 5e9


def _cuda_estimate(ckrun, plan):
    code, out, err = ckrun("estimate", "bert_large", f"memory.checkpointing={plan}", "--json")
    assert code == 0, err
    return json.loads(out)


def test_a_model_that_reads_tensor_values_is_estimated_approximately(tmp_path, ckrun, monkeypatch):
    (tmp_path / "branchy.py").write_text(
        "import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.a, self.b = nn.Linear(3 * 8 * 8, 10), nn.Linear(3 * 8 * 8, 10)\n"
        "    def forward(self, x):\n        x = x.flatten(1)\n        return self.a(x) if x.sum() > 0 else self.b(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = ckrun("estimate", BERT_TINY, "model.source=python", "model.name=branchy:Net", "model.config={}",
                           "data.task=image_classification", "data.image_size=8", "data.num_classes=10", "--device", "cpu")
    # was refused ("prediction is unavailable"); a model that trains must estimate: on real CPU tensors, said so
    assert code == 0 and "  note: approximate: measured on real CPU tensors" in out, err
