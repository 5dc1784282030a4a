"""memory.optimizer_offload master (runner/memory/host_master.py), ZeRO-Offload's split: on the CPU the host
and the device are one memory, but the path is the training path (bf16 device copies of the nn.Linear
weights, float32 masters and AdamW on the host, every gradient added up there in float32, the recast), and
it gives the losses and weights of float32 weights under bf16 autocast bit for bit. The checkpoint and the
export hold the masters; the estimate counts the device's bytes and prices the host's work; the GPU's
pinned copies and side stream are in the cuda-marked test."""

from __future__ import annotations

import io
import math

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.builders.resolve import BuildError
from ckrun.runner.recipe.load import recipe_from_text
from ckrun.runner.memory.host_master import HostMasterOptimizer
from ckrun.runner.plan.memory_plan import MemoryPlan
from ckrun.runner.predict.estimate import Estimator
from ckrun.runner.predict.hardware import resolve_device
from ckrun.runner.predict.roofline import HOST_ADAMW_PER_S
from ckrun.runner.problems import InputError
from ckrun.runner.train.trainer import Trainer
from tests.runner.memory.tiny_lm import LLAMA, WIDE, identical, needs_torchao, recipe

MASTER = "optimizer_offload: {policy: master}"
PLANS = {
    "one micro-batch": ("{}", {}),
    "micro-batches, clipped on the host": ("{micro_batch: 2}", {"grad_clip": 0.05}),
    "chunked loss": ("{loss: {policy: chunked, chunks: 4}}", {}),
    "full checkpointing": ("{checkpointing: {policy: full}}", {}),
}


def _with_master(memory: str) -> str:
    return "{" + MASTER + ("" if memory == "{}" else ", " + memory[1:-1]) + "}"


def _records(recipe_, steps: int = 3) -> tuple[list[dict], Trainer]:
    trainer = Trainer(recipe_)
    return [trainer.train_step() for _ in range(steps)], trainer


@pytest.mark.parametrize("plan", PLANS)
def test_the_split_trains_bit_for_bit_as_float32_weights_under_bf16_autocast(plan):
    memory, train_keys = PLANS[plan]
    plain, plain_trainer = _records(recipe(memory, LLAMA, "bf16", **train_keys))
    split, trainer = _records(recipe(_with_master(memory), LLAMA, "bf16", **train_keys))
    assert [r["loss"] for r in split] == [r["loss"] for r in plain]
    assert [r.get("grad_norm") for r in split] == [r.get("grad_norm") for r in plain]  # clipped on the host alike
    optimizer = trainer.optimizer
    assert isinstance(optimizer, HostMasterOptimizer)
    params = list(trainer.model.parameters())
    assert identical([optimizer.copies[p] for p in params], [p.detach() for p in plain_trainer.model.parameters()])
    head = trainer.model.lm_head.weight  # split by the chunked loss, whose pieces read it apart: kept float32
    linear = [m.weight for m in trainer.model.modules() if isinstance(m, nn.Linear) and (m.weight is not head
                                                                                          or "chunked" not in memory)]
    assert linear and all(p.dtype == torch.bfloat16 and torch.equal(p, optimizer.copies[p].bfloat16()) for p in linear)
    assert trainer.model.model.embed_tokens.weight.dtype == torch.float32
    assert head.dtype == (torch.float32 if "chunked" in memory else torch.bfloat16)
    assert all(p.grad is None for p in params)  # each gradient left the device as it was made


def test_the_checkpoint_holds_the_masters_and_a_resumed_run_goes_on_as_if_never_stopped():
    memory = _with_master("{micro_batch: 2}")
    straight, _ = _records(recipe(memory, LLAMA, "bf16"), 4)
    first = Trainer(recipe(memory, LLAMA, "bf16"))
    for _ in range(2):
        first.train_step()
    state = first.state()
    masters = first.optimizer.copies
    names = dict(first.model.named_parameters())
    assert all(state["model"][name] is masters[param] for name, param in names.items())  # not the bf16 copies
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    second = Trainer(recipe(memory, LLAMA, "bf16"))
    second.restore(torch.load(saved, weights_only=True))
    assert identical([second.optimizer.copies[p] for p in second.model.parameters()],
                     [masters[p] for p in first.model.parameters()])
    assert [second.train_step()["loss"] for _ in range(2)] == [r["loss"] for r in straight[2:]]


@pytest.mark.parametrize("knob", ["exact", "8-bit moments on the host"])
def test_it_trains_resumes_after_a_kill_and_exports_float32_weights_through_the_cli(tmp_path, ckrun, monkeypatch, knob):
    lossy = ["memory.optimizer_state={policy: 8bit}", "memory.allow_lossy=true"] if knob != "exact" else []
    if lossy:
        pytest.importorskip("torchao")
    common = [BERT_TINY, *TINY_BERT, "precision=bf16", "train.steps=4", "output.checkpoint_every=2", *lossy]
    plain = tmp_path / "plain"
    assert ckrun(*common, f"output.dir={plain}")[0] == 0
    split = [*common, "memory.optimizer_offload={policy: master}", f"output.dir={tmp_path / 'split'}"]
    real_step = Trainer.train_step

    def killed_in_step_3(trainer):
        if trainer.step == 2:
            raise KeyboardInterrupt
        return real_step(trainer)

    monkeypatch.setattr(Trainer, "train_step", killed_in_step_3)
    assert ckrun(*split)[0] == 130
    monkeypatch.undo()
    code, _, err = ckrun(*split, "--resume")
    assert code == 0, err
    losses = [r["loss"] for r in read_metrics(tmp_path / "split")]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    exported, reference = (load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("split", "plain"))
    assert {t.dtype for t in exported.values()} == {torch.float32} and exported.keys() == reference.keys()
    if not lossy:  # the exact split: the plain run's losses and weights, bit for bit, across the kill
        assert losses == [r["loss"] for r in read_metrics(plain)]
        assert all(torch.equal(exported[name], reference[name]) for name in exported)


@needs_torchao
def test_low_bit_moments_live_on_the_host_and_their_update_error_is_measured():
    records, trainer = _records(recipe(_with_master("{optimizer_state: {policy: 8bit}, allow_lossy: true}"), LLAMA,
                                       "bf16"), 3)
    host = trainer.optimizer.host_optimizer
    assert type(host).__name__ == "AdamW8bit"
    assert all(all(t.device.type == "cpu" for t in state.values() if torch.is_tensor(t)) for state in host.state.values())
    assert all(math.isfinite(r["loss"]) for r in records)
    assert trainer.update_error is not None and trainer.update_error < 0.5  # followed on the masters, not the copies


class ReadTwice(nn.Module):
    """A language model whose one Linear runs twice in a forward (weights shared across depth, as ALBERT)."""

    def __init__(self, vocab_size: int = 64, width: int = 16, outside_autocast: bool = False):
        super().__init__()
        self.vocab_size, self.outside_autocast = vocab_size, outside_autocast
        self.embed, self.mix, self.head = nn.Embedding(vocab_size, width), nn.Linear(width, width), nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        if self.outside_autocast:
            with torch.autocast("cpu", enabled=False):
                return self.head(torch.tanh(self.mix(hidden)))
        return self.head(torch.tanh(self.mix(torch.tanh(self.mix(hidden)))))


@pytest.mark.parametrize(("outside", "refusal"), [
    (False, "memory.optimizer_offload: master holds mix's weight in bfloat16, and the model runs that layer twice"),
    (True, "memory.optimizer_offload: master holds mix's weight in bfloat16 for bf16 autocast to read, but the model "
           "runs that layer outside autocast"),
])
def test_a_layer_whose_reads_would_not_be_exact_is_refused_at_the_first_forward(outside, refusal):
    spec = ("{source: python, name: 'tests.runner.memory.test_host_master:ReadTwice', config: {outside_autocast: "
            f"{str(outside).lower()}}}}}")
    trainer = Trainer(recipe_from_text(f"model: {spec}\ndata: {{source: synthetic, seq_len: 8, task: causal_lm}}\ntrain: {{batch_size: 2, "
                                       f"steps: 1, device: cpu}}\nprecision: bf16\nmemory: {{{MASTER}}}\n"))
    masters = [t.clone() for t in trainer.optimizer.copies.values()]
    with pytest.raises(BuildError) as refused:
        trainer.train_step()
    assert f"{refused.value.key}: {refused.value}".startswith(refusal) and "\n" not in str(refused.value)
    assert identical(list(trainer.optimizer.copies.values()), masters)  # refused before any update


@pytest.mark.parametrize(("memory", "precision", "refusal"), [
    (MASTER, "fp32", "memory.optimizer_offload: master holds bfloat16 weights on the device for bf16 autocast"),
    (MASTER, "fp16", "memory.optimizer_offload: master holds bfloat16 weights on the device for bf16 autocast"),
    (f"{MASTER}, weights: {{policy: bf16}}, allow_lossy: true", "bf16",
     "memory.optimizer_offload: cannot be combined with memory.weights: bf16"),
    (f"{MASTER}, optimizer_step: {{policy: in_backward}}", "bf16",
     "memory.optimizer_offload: cannot be combined with memory.optimizer_step: in_backward"),
])
def test_what_the_split_cannot_combine_with_is_one_line(memory, precision, refusal):
    with pytest.raises(InputError) as refused:
        recipe("{" + memory + "}", precision=precision)
    assert refusal in str(refused.value) and str(refused.value).count("memory.optimizer_offload") == 1


def test_the_estimate_counts_bf16_weights_no_state_on_the_device_and_prices_the_hosts_work():
    """On fake CUDA tensors with the meta device as host: the device holds 2 B a Linear parameter and 4 B the
    rest, none of the moments, gradients only on their way; the host's update and the adding up of each
    micro-batch's gradients are priced at its AdamW rate, the weights' way back at the host link's."""
    a100 = resolve_device("a100")
    estimator = Estimator(recipe("{}", WIDE, "bf16", batch_size=2, device="cuda"), "cuda", a100)
    plain = estimator.estimate(MemoryPlan(micro_batch=1), "bf16")
    plan = MemoryPlan.model_validate({"micro_batch": 1, "optimizer_offload": {"policy": "master"}})
    estimate = estimator.estimate(plan, "bf16")
    model = estimator.model
    linear = {p for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    device_bytes = sum(p.numel() * (2 if p in linear else 4) for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # RoPE's frequencies
    assert estimate.breakdown["parameters"] == device_bytes + buffers < plain.breakdown["parameters"]
    assert estimate.breakdown["optimizer_state"] < 1000  # AdamW's step counters: the moments are the host's
    assert estimate.breakdown["gradients"] <= max(p.numel() * 4 for p in model.parameters())
    assert estimate.breakdown.get("weight_casts", 0) == 0  # autocast finds them in bf16 already
    assert estimate.peak_bytes < plain.peak_bytes
    optimizer = estimator._optimizing(plan).optimizer
    elements = sum(p.numel() for p in model.parameters())
    assert optimizer.host_bytes() == 16 * elements + device_bytes + 4 * len(optimizer.copies)  # + step counters
    assert estimate.time.by_class["host_adamw"] == pytest.approx(elements * (1 + 2 * 10 / 28) / HOST_ADAMW_PER_S)
    assert estimate.time.by_class["host_copies"] == pytest.approx(device_bytes / (a100.host_gbs * 1e9))
    assert "memory.optimizer_offload master" in " ".join(estimate.notes)
    assert estimator.estimate(MemoryPlan(micro_batch=1), "bf16") == plain  # the weights are back in float32


def test_the_estimate_clips_on_the_host_as_training_does():
    """Global clipping runs over the masters' gradients on the host, which in the estimate is the meta device."""
    estimator = Estimator(recipe("{}", WIDE, "bf16", batch_size=2, device="cuda", grad_clip=1.0), "cuda")
    plan = MemoryPlan.model_validate({"optimizer_offload": {"policy": "master"}})
    assert estimator.estimate(plan, "bf16").breakdown["optimizer_state"] < 1000


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("memory", ["{}", "{micro_batch: 2}"])
def test_on_a_gpu_the_masters_and_staging_are_pinned_and_it_trains_as_the_device_with_less_memory(memory):
    """The host's fused CPU AdamW rounds as the CPU does: the same run within float rounding; the device
    holds bf16 Linear weights and no moments, the copies on a side stream into pinned memory."""
    def run(memory_: str, start: dict | None = None):
        trainer = Trainer(recipe(memory_, WIDE, precision="bf16", device="cuda"))
        if start is not None:  # the masters' plan builds on the host, whose generator draws other weights
            trainer.model.load_state_dict(start)
        first = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        records = [trainer.train_step() for _ in range(3)]
        return [r["loss"] for r in records], max(r["peak_allocated_bytes"] for r in records[1:]), trainer, first
    device = run(memory)
    host = run(_with_master(memory), device[3])
    assert host[0] == pytest.approx(device[0], rel=1e-3)
    optimizer = host[2].optimizer
    assert isinstance(optimizer, HostMasterOptimizer) and optimizer.stream is not None
    assert all(t.is_pinned() for t in [*optimizer.copies.values(), *optimizer.staging.values()])
    assert all(p.is_cuda and p.grad is None for p in host[2].model.parameters())
    moments = sum(p.numel() * 8 for p in optimizer.copies)
    assert device[1] - host[1] >= moments


@pytest.mark.slow  # a 7B model on fake tensors: half a minute of CPU
def test_the_llama2_7b_full_fine_tune_is_predicted_at_or_under_torchtunes_16_gb_on_an_a100():
    """bench/published/llama2_7b_full.yaml (batch 2, seq 2048, the exact split with full checkpointing, block
    offload and the chunked loss): torchtune's low-memory config reserved 15.97 GB at its peak, lossy."""
    from conftest import ROOT
    from ckrun.runner.recipe.load import load_recipe

    recipe_ = load_recipe(ROOT / "bench" / "published" / "llama2_7b_full.yaml")
    estimate = Estimator(recipe_, "cuda", resolve_device("a100")).estimate()
    assert estimate.peak_bytes <= 16 * 10**9, estimate.breakdown
    assert estimate.breakdown["optimizer_state"] < 10**6 and estimate.breakdown["gradients"] < 10**9
