"""Numbers a library hands the trainer reach every record as plain Python numbers (numbers.py), and
every lossy knob trains through the CLI: torchao keeps its learning rate as a tensor, which ended
every such run at step 1 (`Object of type Tensor is not JSON serializable`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import BERT_TINY, TINY_BERT, read_metrics
from ckrun.runner.train.output.numbers import RecordValueError, plain_record, plain_value

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool]
NUMPY = [np.float32, np.float64, np.int64, np.int32, np.bool_]


def _library_number(draw_value: float, kind: int):
    """The one number in one of the types libraries hand over: a tensor (0-d or 1-element) or a numpy scalar."""
    if kind < len(DTYPES):
        return torch.tensor(draw_value).to(DTYPES[kind])
    if kind < 2 * len(DTYPES):
        return torch.tensor([draw_value]).to(DTYPES[kind - len(DTYPES)])
    return NUMPY[kind % len(NUMPY)](draw_value)


@given(st.floats(-1e4, 1e4, allow_nan=False), st.integers(0, 2 * len(DTYPES) + len(NUMPY) - 1))
def test_every_library_number_becomes_a_plain_one_that_json_writes(value, kind):
    number = _library_number(value, kind)
    record = plain_record({"step": 1, "lr": number, "nested": {"scheduler": {"_last_lr": [number, number]}}})
    assert type(record["lr"]) in (int, float, bool)
    assert all(type(v) is type(record["lr"]) for v in record["nested"]["scheduler"]["_last_lr"])
    assert math.isclose(float(record["lr"]), float(number), rel_tol=1e-6, abs_tol=1e-6)
    json.dumps(record, allow_nan=False)


@pytest.mark.parametrize("value", [torch.zeros(2), object(), np.zeros(3), {1, 2}])
def test_a_value_that_is_no_number_names_its_key_and_type(value):
    with pytest.raises(RecordValueError, match=r"'nested\.lr' holds a .*not a number"):
        plain_value({"lr": value}, "nested")


KNOBS = {
    "8bit state": ["memory.optimizer_state={policy: 8bit}"],
    "4bit state": ["memory.optimizer_state={policy: 4bit}"],
    "fp8 state": ["memory.optimizer_state={policy: fp8}"],
    "bf16 weights": ["memory.weights={policy: bf16}", "precision=bf16"],
    "all at once": ["memory.weights={policy: bf16}", "precision=bf16", "memory.optimizer_state={policy: 8bit}",
                    "memory.loss={policy: chunked}", "memory.checkpointing={policy: full}"],
}


@pytest.mark.parametrize("knob", KNOBS)
def test_every_lossy_knob_trains_resumes_and_exports_through_the_cli(tmp_path, ckrun, knob):
    pytest.importorskip("torchao")
    out = tmp_path / "run"
    args = [BERT_TINY, *TINY_BERT, *KNOBS[knob], "memory.allow_lossy=true", "output.checkpoint_every=2",
            f"output.dir={out}"]
    code, _, err = ckrun(*args, "train.steps=2")
    assert code == 0, err
    code, _, err = ckrun(*args, "train.steps=3", "--resume")
    assert code == 0, err
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and isinstance(r["lr"], float) for r in records)
    assert (out / "model" / "config.json").is_file()
