"""Where fake kernels allocate less than real ones (an LSTM's oneDNN workspace), the estimate says
so: a CPU estimate that differs from what training measures always carries a warning naming the op."""

import json
from pathlib import Path

import torch

from conftest import lstm_step_reaches, read_metrics
from runner.predict.fake_gaps import FAKE_GAPS

HERE = Path(__file__).resolve().parent
LSTM = ["model.source=python", "model.name=estimate_models:tiny_lstm", "model.config={vocab: 64, width: 32}",
        "data={source: synthetic, task: sequence_classification, seq_len: 16, vocab_size: 64, num_classes: 4}",
        "train.batch_size=8", "train.device=cpu"]



def test_every_known_gap_is_an_aten_op_of_this_torch():
    for name in FAKE_GAPS:
        namespace, _, op = name.partition("::")
        assert hasattr(getattr(torch.ops, namespace), op), name  # a renamed op would silently never warn


def test_an_lstm_estimate_that_misses_bytes_says_which_op(tmp_path, ckrun, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    code, out, err = ckrun("estimate", "bert_tiny", *LSTM, "--device", "cpu", "--json")
    assert code == 0, err
    estimate = json.loads(out)
    assert ckrun("bert_tiny", *LSTM, "train.steps=2", f"output.dir={tmp_path}")[0] == 0
    measured = max(m["peak_mem_bytes"] for m in read_metrics(tmp_path))
    if estimate["peak_bytes"] != measured:  # never a silent miss
        assert any(w.split(":")[0].replace(".", "::") in FAKE_GAPS for w in estimate["warnings"]), estimate
    if lstm_step_reaches("aten::mkldnn_rnn_layer"):
        assert any(w.startswith("aten.mkldnn_rnn_layer: ") and "low" in w for w in estimate["warnings"])
        code, out, _ = ckrun("estimate", "bert_tiny", *LSTM, "--device", "cpu")
        assert "  warning: aten.mkldnn_rnn_layer: " in out


def test_a_model_without_such_ops_gets_no_warning(ckrun):
    code, out, err = ckrun("estimate", "bert_tiny", "model.config.num_hidden_layers=1", "--device", "cpu", "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []
