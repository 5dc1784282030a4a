"""Where fake kernels allocate less than real ones (an LSTM's oneDNN workspace), the estimate says
so: a CPU estimate that differs from what training measures always carries a warning naming the op."""

import json
from pathlib import Path

import torch

from conftest import lstm_step_reaches, read_metrics
from ckrun.runner.predict.fake_gaps import FAKE_GAPS

HERE = Path(__file__).resolve().parent
LSTM = ["model.source=python", "model.name=estimate_models:tiny_lstm", "model.config={vocab: 64, width: 32}",
        "data={source: synthetic, task: sequence_classification, seq_len: 16, vocab_size: 64, num_classes: 4}",
        "train.batch_size=8", "train.device=cpu"]



def test_every_known_gap_is_an_aten_op_of_this_torch():
    for name in FAKE_GAPS:
        namespace, _, op = name.partition("::")
        assert hasattr(getattr(torch.ops, namespace), op), name  # a renamed op would silently never warn


def test_an_lstm_estimate_fills_in_onednns_workspace(tmp_path, ckrun, monkeypatch):
    # the fake kernel's workspace is empty; its real size, measured once per shape, made the estimate exact
    # (it was 13-27% low, with a warning)
    monkeypatch.syspath_prepend(str(HERE))
    code, out, err = ckrun("estimate", "bert_tiny", *LSTM, "--device", "cpu", "--json")
    assert code == 0, err
    estimate = json.loads(out)
    assert ckrun("bert_tiny", *LSTM, "train.steps=2", f"output.dir={tmp_path}")[0] == 0
    measured = max(m["peak_mem_bytes"] for m in read_metrics(tmp_path))
    if estimate["peak_bytes"] != measured:  # never a silent miss
        assert any(w.split(":")[0].replace(".", "::") in FAKE_GAPS for w in estimate["warnings"]), estimate
    if lstm_step_reaches("aten::mkldnn_rnn_layer"):
        assert estimate["peak_bytes"] == measured and estimate["warnings"] == []


def test_a_layer_too_large_to_measure_keeps_the_warning(ckrun, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setattr("ckrun.runner.predict.fake_gaps.MOST_MEASURED_FLOPS", 0)
    code, out, err = ckrun("estimate", "bert_tiny", *LSTM, "train.batch_size=4", "--device", "cpu", "--json")
    assert code == 0, err
    if lstm_step_reaches("aten::mkldnn_rnn_layer"):
        assert any(w.startswith("aten.mkldnn_rnn_layer: ") and "low" in w for w in json.loads(out)["warnings"])


def test_a_model_without_such_ops_gets_no_warning(ckrun):
    code, out, err = ckrun("estimate", "bert_tiny", "model.config.num_hidden_layers=1", "--device", "cpu", "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []
