"""grad_norm and the learning rate (issue 36 point 8): every step's gradient norm before clipping, as
HF Trainer logs it, in metrics.jsonl and so in every sink; the learning rate and the norm get a panel of
curves.png each."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.builders.data import Batch
from ckrun.runner.train.step import make_precision, run_step


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), clip=st.sampled_from([1e-3, 0.5, 1e9]), micro=st.sampled_from([1, 2, 4]))
def test_the_recorded_norm_is_the_gradients_norm_before_clipping(seed, clip, micro):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 5))
    inputs, labels = torch.randint(0, 11, (4, 3)), torch.randint(0, 5, (4, 3))
    reference = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 5))
    reference.load_state_dict(model.state_dict())
    loss = torch.nn.functional.cross_entropy(reference(inputs).reshape(-1, 5), labels.reshape(-1), reduction="sum")
    (loss / labels.numel()).backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = run_step(model, optimizer, Batch({"input_ids": inputs}, labels, False), micro,
                      make_precision("fp32", torch.device("cpu")), None, clip)
    assert torch.allclose(result.grad_norm, expected, rtol=1e-4)
    assert run_step(model, optimizer, Batch({"input_ids": inputs}, labels, False), micro,
                    make_precision("fp32", torch.device("cpu")), None, None).grad_norm is None


@pytest.mark.parametrize("clip", ["1.0", "null"])
def test_grad_norm_is_in_every_step_record_when_clipping_measures_it(tmp_path, ckrun, clip):
    code, _, err = ckrun(BERT_TINY, *TINY_BERT, "train.steps=3", f"train.grad_clip={clip}", f"output.dir={tmp_path}")
    assert code == 0, err
    steps = [r for r in read_metrics(tmp_path) if "loss" in r]
    if clip == "null":
        assert not any("grad_norm" in r for r in steps)
    else:
        assert all(r["grad_norm"] > 0 and r["lr"] >= 0 for r in steps)


def test_curves_have_a_learning_rate_and_a_gradient_norm_panel(tmp_path, ckrun, monkeypatch):
    import matplotlib.figure

    drawn = {}
    real = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn["titles"] = {ax.get_title(): ax for ax in fig.axes}
        return real(fig, *args, **kwargs)

    assert ckrun(BERT_TINY, *TINY_BERT, "train.steps=4", "train.scheduler={name: cosine, warmup_steps: 2}",
                 f"output.dir={tmp_path}")[0] == 0
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    assert ckrun("report", tmp_path)[0] == 0
    lr = drawn["titles"]["learning rate (the schedule)"].lines[0].get_ydata()
    assert list(lr) == [r["lr"] for r in read_metrics(tmp_path) if "loss" in r]
    assert len(drawn["titles"]["gradient norm (before clipping)"].lines[0].get_xdata()) == 4
