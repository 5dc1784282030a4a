"""`ckrun tune` on a GPU: peaks counted as the card counts them (allocator reserve plus the CUDA
context), offload searched, and a cap larger than the card refused before any probe."""

import pytest
import torch

from conftest import BERT_TINY, TINY_BERT
from tune_helpers import launches, report

pytestmark = pytest.mark.cuda

CUDA_TINY = [o for o in TINY_BERT if not o.startswith("train.device")] + ["train.device=cuda"]


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_a_cap_larger_than_the_card_is_refused(ckrun, tmp_path):
    total = torch.cuda.get_device_properties(0).total_memory
    code, _, err = ckrun("tune", BERT_TINY, *CUDA_TINY, f"output.dir={tmp_path}", "--max-mem", str(2 * total),
                         "--no-train")
    assert code == 2 and "more than the" in err and "give at most --max-mem" in err
    assert not [launch for launch in launches(tmp_path / "tune") if launch["what"] == "probe"]


def test_peaks_include_the_cuda_context_and_offload_is_searched(ckrun, tmp_path):
    code, _, err = ckrun("tune", BERT_TINY, *CUDA_TINY, f"output.dir={tmp_path}", "--max-mem", "4GB",
                         "--trials", "3", "--no-train")
    assert code == 0, err
    found = report(tmp_path / "tune")
    winner = found["trials"][found["winner"]]
    assert winner["device"]["cuda"] and winner["measured_peak"] <= found["limit_bytes"]
    assert winner["measured_peak"] > 50 * 10**6  # a tiny BERT needs a few MB; the CUDA context is hundreds
    assert '"offload"' in (tmp_path / "tune" / "study.journal").read_text()


def test_probes_have_the_gpu_to_themselves(ckrun, tmp_path):
    """The model child predicts with the GPUs hidden and the solver's timing child is gone before the
    first probe, so NVML lists no process of the tuner's beside a probe (this test process may hold a
    context of its own from earlier tests: that one is allowed)."""
    import json

    allowed = int(torch.cuda.is_initialized())
    code, _, err = ckrun("tune", BERT_TINY, *CUDA_TINY, f"output.dir={tmp_path}", "--max-mem", "4GB",
                         "--trials", "3", "--no-train")
    assert code == 0, err
    results = [json.loads(p.read_text()) for p in (tmp_path / "tune" / "probes").glob("trial-*.result.json")]
    assert results and all(r.get("other_gpu_processes") in (None, allowed) for r in results), results
    model_log = (tmp_path / "tune" / "probes" / "model" / "model.log").read_text()
    assert "Traceback" not in model_log, model_log[-2000:]
