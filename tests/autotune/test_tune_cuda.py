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
