"""The live-bytes tracker counts exactly: known allocation sequences, views, in-place ops, a
training step computed by hand, and the same peak on fake tensors as on real ones."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ckrun.runner.memory.tracker import CATEGORIES, LiveBytesTracker

MB = 1 << 20
F32 = 4


def _bytes(count: int) -> torch.Tensor:
    return torch.empty(count, dtype=torch.uint8)


def test_peak_of_a_known_sequence_is_exact():
    baseline = _bytes(MB)
    tracker = LiveBytesTracker().track(extra_tensors=[baseline])
    with tracker:
        a = _bytes(MB)
        b = _bytes(2 * MB)
        del a
        c = _bytes(3 * MB)
        del b, c
    assert tracker.peak_bytes == 5 * MB + MB
    assert tracker.current_bytes == MB
    assert tracker.breakdown_at_peak == {**dict.fromkeys(CATEGORIES, 0), "inputs": MB, "activations": 5 * MB}


SCALAR = 8  # a 0-dim tensor made from a Python number: float64/int64 at most


def test_views_and_in_place_ops_add_nothing():
    # Views and in-place results share x's storage: x is never counted again and nothing of x's
    # size appears. Whether torch turns a Python number into a 0-dim tensor through an aten op is
    # its own business (`x[0] = 3.0` does on 2.11 and 2.14, a 4-byte float): such a temporary is
    # real memory and counted, so it is allowed, at a scalar's size and freed again.
    x = torch.zeros(256, 256)
    key = id(x.untyped_storage())
    tracker = LiveBytesTracker(record_events=True).track(extra_tensors=[x])
    with tracker:
        views = [x.view(-1), x[1:], x.t(), x.reshape(256, 256), x.detach(), x.unsqueeze(0).expand(3, 256, 256), x[:, ::2]]
        x.add_(1).mul_(2).zero_()
        x[0] = 3.0
        torch.add(x, x, out=x)
        del views
    assert [event for event in tracker.events if event[0] == key] == [(key, x.nbytes, torch.device("cpu"))]
    temporaries = [size for other, size, _ in tracker.events if other != key and size > 0]
    assert all(size <= SCALAR for size in temporaries), temporaries
    assert tracker.peak_bytes - x.nbytes <= 2 * SCALAR
    assert tracker.current_bytes == x.nbytes


def test_frees_of_registered_tensors_are_seen():
    params, batch = _bytes(MB), _bytes(2 * MB)
    tracker = LiveBytesTracker().track(extra_tensors=[params, batch])
    tracker.count_existing([params], "parameters")  # a known storage is re-labelled, not counted twice
    del batch
    assert tracker.current_bytes == MB
    assert tracker.current_breakdown["parameters"] == MB
    assert tracker.peak_bytes == 3 * MB


def test_reset_peak_restarts_from_current_bytes():
    tracker = LiveBytesTracker()
    with tracker:
        kept = _bytes(MB)
        _bytes(4 * MB)
    tracker.reset_peak()
    assert tracker.peak_bytes == tracker.current_bytes == kept.nbytes


def test_events_replay_the_allocations_in_order():
    tracker = LiveBytesTracker(record_events=True)
    with tracker:
        a = _bytes(100)
        b = _bytes(300)
        del a
    cpu = torch.device("cpu")
    assert [(size, device) for _, size, device in tracker.events] == [(100, cpu), (300, cpu), (-100, cpu)]
    assert tracker.events[0][0] == tracker.events[2][0] != tracker.events[1][0] == id(b.untyped_storage())


def test_tiny_mlp_sgd_step_matches_hand_computation():
    batch, d_in, hidden, d_out = 5, 3, 7, 2  # distinct sizes so every term below is identifiable
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden, bias=False), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out, bias=False)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: the step is in place
    x = torch.randn(batch, d_in)
    tracker = LiveBytesTracker().track(model, optimizer, [x])
    with tracker:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        del loss
    params, inputs = F32 * (hidden * d_in + d_out * hidden), F32 * batch * d_in
    relu_out = grad_relu_out = grad_relu_in = F32 * batch * hidden
    grad_w2 = F32 * d_out * hidden
    # The peak is threshold_backward (ReLU's backward): its output grad_relu_in is allocated while
    # the saved ReLU output, the gradient flowing into it and W2's finished gradient are all live,
    # plus scalars: the loss (held by the test) and, while the engine holds it, the seed gradient 1.0.
    big = params + inputs + relu_out + grad_relu_out + grad_relu_in + grad_w2
    assert tracker.peak_bytes - big in (F32, 2 * F32)
    peak = tracker.breakdown_at_peak
    assert (peak["parameters"], peak["inputs"], peak["gradients"]) == (params, inputs, grad_w2)
    assert sum(peak.values()) == tracker.peak_bytes
    assert tracker.current_bytes == params + inputs  # every activation and gradient was freed


def test_adamw_state_is_labelled_after_its_first_step():
    model = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = LiveBytesTracker().track(model, optimizer)
    with tracker:
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    param_bytes = sum(p.nbytes for p in model.parameters())
    now = tracker.current_breakdown
    assert now["gradients"] == param_bytes
    # exp_avg and exp_avg_sq per parameter, and a float32 step counter per parameter
    assert now["optimizer_state"] == 2 * param_bytes + F32 * len(optimizer.state)
    assert now["activations"] == 0
    tracker.close()


def _bert_step(model, optimizer, batch):
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tracked_bert_step(model, batch) -> LiveBytesTracker:
    optimizer = torch.optim.AdamW(model.parameters())
    _bert_step(model, optimizer, batch)  # untracked: the optimizer state exists, as in steady state
    tracker = LiveBytesTracker().track(model, optimizer, batch.values())
    with tracker:
        _bert_step(model, optimizer, batch)
    tracker.close()
    return tracker


def test_fake_tensor_step_has_the_peak_of_the_real_step():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=64, attn_implementation="sdpa",  # dropout stays on: masks are memory too
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, config.vocab_size, (4, 32))
    batch = {"input_ids": ids, "labels": torch.where(torch.rand(ids.shape) < 0.15, ids, -100)}

    # Built under the mode, as the estimate does; `model._apply(fake_mode.from_tensor)` would untie
    # the tied embedding/decoder weight and give AdamW one more parameter's state to keep.
    with FakeTensorMode() as fake_mode:
        fake_model = transformers.BertForMaskedLM(config)
        fake_batch = {name: fake_mode.from_tensor(t) for name, t in batch.items()}
        fake = _tracked_bert_step(fake_model, fake_batch)
    real = _tracked_bert_step(model, batch)

    assert real.peak_bytes > 2 * sum(p.nbytes for p in model.parameters())  # it measured a real step
    assert fake.peak_bytes == real.peak_bytes
    assert fake.breakdown_at_peak == real.breakdown_at_peak
    assert fake.current_bytes == real.current_bytes


def test_fake_cuda_bytes_are_counted_per_device_without_a_gpu():
    with FakeTensorMode():
        tracker = LiveBytesTracker("cuda")  # the same device as cuda:0, which tensors report
        with tracker:
            on_gpu = torch.empty(MB, dtype=torch.uint8, device="cuda")
            on_host = on_gpu.to("cpu")
            del on_gpu
    assert tracker.peak_bytes == MB and tracker.current_bytes == 0
    assert tracker.peak_by_device == {"cuda:0": MB, "cpu": MB} and on_host.nbytes == MB
