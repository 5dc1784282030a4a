"""Device facts: names resolve to one table whatever torch is installed, and that table agrees with
torch's own where torch states dense figures."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckrun.runner.predict.gpus import ROWS, row_for_name
from ckrun.runner.predict.hardware import GPUS, DeviceFacts, UnknownDevice, known_names, resolve_device


@pytest.mark.parametrize("name, key", [
    ("h100", "h100"), ("H100", "h100"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"),
    ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA GH200 144G HBM3e", "gh200-144gb"), ("a100", "a100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100 80GB PCIe", "a100-pcie"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
    ("A100-40GB", "a100-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"), ("NVIDIA B200", "b200"),
    ("l4", "l4"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("NVIDIA L40", "l40"), ("NVIDIA A10", "a10"),
    ("NVIDIA A40", "a40"),
])
def test_short_and_reported_names_resolve(name, key):
    assert resolve_device(name) == GPUS[key]


def test_every_row_answers_to_its_own_reported_name_first():
    """Rows are tried in order: a plain row listed before its variant (H100 before H100 NVL) would take
    the variant's cards. Each row's own name must reach it, and each key must be a --gpu name."""
    for row in ROWS:
        assert row_for_name(row.facts.name) is row, f"{row.facts.name} resolves to {row_for_name(row.facts.name).key}"
        assert row.key in known_names() and GPUS[row.key] is row.facts


@settings(max_examples=60, deadline=None)
@given(row=st.sampled_from(ROWS), data=st.data())
def test_a_reported_name_resolves_whatever_its_case_and_separators(row, data):
    """Drivers and tools write one card's name with other separators and case ("A100-SXM4-80GB",
    "a100 sxm4 80gb"): only letters and digits decide."""
    separators = st.sampled_from(["", " ", "-", "_"])
    words = row.facts.name.replace("-", " ").split()
    spelled = "".join(data.draw(st.sampled_from([w.lower(), w.upper(), w])) + data.draw(separators) for w in words)
    assert resolve_device(spelled) == row.facts


def test_the_links_a_card_has():
    """GH200: its NVLink-C2C host link (900 GB/s both ways) is what offload runs over; PCIe cards, an
    NVL's bridged pairs included, run a ring over more than two cards at PCIe rate (no NVLink peer)."""
    assert GPUS["gh200"].host_gbs == GPUS["gh200-144gb"].host_gbs == 450 > 8 * GPUS["h200"].host_gbs
    assert GPUS["gh200"].memory_bytes < GPUS["h200"].memory_bytes
    for key in ("a100-pcie", "a100-pcie-40gb", "h100-pcie", "h100-nvl", "h200-nvl", "l40s", "l4"):
        assert GPUS[key].peer_gbs <= 64, key  # PCIe 4 or 5 x16, one way
    for key in ("a100", "h100", "h200", "b200"):
        assert GPUS[key].peer_gbs >= 300, key
    assert GPUS["h100-nvl"].memory_gbs == 3900 and GPUS["h100-nvl"].memory_bytes == 94 * 10**9


@pytest.mark.parametrize("name", ["h300", "NVIDIA RTX 6000 Ada", "", "l"])
def test_an_unknown_name_lists_the_known_ones(name):
    with pytest.raises(UnknownDevice) as err:
        resolve_device(name)
    assert "known: " + ", ".join(known_names()) in str(err.value)


def test_the_table_holds_dense_figures():
    for facts in GPUS.values():
        assert facts.matmul_tflops["bf16"] == facts.matmul_tflops["fp16"]
        assert facts.matmul_tflops["fp32"] <= facts.matmul_tflops["tf32"] < facts.matmul_tflops["bf16"]
        assert facts.memory_bytes > 20 * 2**30 and facts.capability >= (8, 0) and facts.sms > 0
        assert facts.efficiency is not None and "calibration" in facts.source
    assert GPUS["h100"].matmul_tflops["bf16"] == pytest.approx(989.4)  # not the sparse 1979
    assert GPUS["l4"].memory_gbs == 300  # torch's table (2.11, 2.15) gives the H100's 3350


def test_the_table_agrees_with_torchs_where_torch_states_dense_figures():
    device_info = pytest.importorskip("torch._inductor.analysis.device_info")
    entry = device_info.lookup_device_info("NVIDIA H100")
    if "tops_sparsity_factor" not in getattr(type(entry), "__dataclass_fields__", {}):
        pytest.skip(f"torch {torch.__version__}'s table mixes sparse and dense figures")
    for name, key in (("NVIDIA H100", "h100"), ("NVIDIA A100", "a100")):
        ours = GPUS[key]
        for dtype, label in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            assert device_info.datasheet_tops(dtype, device_name=name) == pytest.approx(
                ours.matmul_tflops[label], rel=0.01)
        assert device_info.datasheet_dram_bw_gbs(name) == pytest.approx(ours.memory_gbs, rel=0.01)


def test_a_gpu_only_torchs_table_knows_is_read_from_it_and_a_mistyped_name_imports_no_inductor():
    """The table's file is loaded by itself: asking it for a name costs no torch._inductor import (dynamo and the
    distributed tensors: seconds), and answers as the package's module does."""
    import subprocess
    import sys

    from conftest import ROOT

    device_info = pytest.importorskip("torch._inductor.analysis.device_info")
    if not hasattr(device_info.DeviceInfo, "tops_sparsity_factor"):
        pytest.skip(f"torch {torch.__version__}'s table mixes sparse and dense figures")
    theirs = [name for name in device_info._device_mapping if row_for_name(name) is None]
    for name in theirs:
        facts = resolve_device(name)
        assert "datasheet table (not in ckrun's own)" in facts.source
        assert facts.matmul_tflops["fp32"] == device_info.datasheet_tops(torch.float32, device_name=name)
    code = ("import sys\nfrom ckrun.runner.predict.hardware import UnknownDevice, resolve_device\n"
            f"print(resolve_device({theirs[0]!r}).name)\n"
            "try:\n    resolve_device('nvidia h9000')\nexcept UnknownDevice:\n    print('unknown')\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._inductor', 'torch._dynamo'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.stdout.splitlines()[-3:] == [theirs[0], "unknown", "[]"], done.stderr[-2000:]


def test_a_facts_file_round_trips_and_a_bad_one_is_one_line(tmp_path):
    measured = GPUS["h100"].model_copy(update={"matmul_efficiency": 1.0, "matmul_tflops": {"fp32": 50, "bf16": 700}})
    path = tmp_path / "facts.json"
    path.write_text(measured.model_dump_json())
    assert resolve_device(str(path)) == measured
    path.write_text(json.dumps({"name": "x", "matmul_tflops": {"bf16": 1}, "memory_gbs": 1, "typo": 1}))
    with pytest.raises(UnknownDevice, match="not a device facts file"):
        resolve_device(str(path))
    with pytest.raises(UnknownDevice, match="cannot read device facts"):
        resolve_device(str(tmp_path / "missing.json"))


def test_a_facts_file_may_give_only_what_differs_from_a_row(tmp_path):
    """A cluster's network or a card's power limit over ckrun's row: the rest, calibration included, is the row's."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"base": "a100", "network_gbs": 6.25, "source": "a 400 Gb/s host"}))
    facts = resolve_device(str(path))
    assert facts.network_gbs == 6.25 and facts.peer_gbs == GPUS["a100"].peer_gbs
    assert facts.efficiency == GPUS["a100"].efficiency and facts.matmul_tflops == GPUS["a100"].matmul_tflops
    assert facts.source.startswith("a 400 Gb/s host") and GPUS["a100"].source in facts.source
    path.write_text(json.dumps({"base": "a100", "network": 1}))
    with pytest.raises(UnknownDevice, match="not a device facts file"):
        resolve_device(str(path))
    path.write_text(json.dumps({"base": "no such gpu"}))
    with pytest.raises(UnknownDevice, match="unknown GPU"):
        resolve_device(str(path))


def test_this_cpu_is_measured():
    facts = resolve_device("cpu")
    assert facts.kind == "cpu" and facts.compute_rate("matmul", "fp32") > 0 and facts.traffic_rate("memory") > 0
    assert isinstance(facts, DeviceFacts) and facts.source.startswith("measured")


@pytest.mark.cuda
def test_this_gpu_measured_reads_back_as_facts(tmp_path):
    from ckrun.runner.predict.hardware import main

    path = tmp_path / "gpu.json"
    assert main([str(path)]) == 0
    facts = resolve_device(str(path))
    assert facts.matmul_tflops["bf16"] > facts.matmul_tflops["fp32"] > 0
    assert facts.memory_gbs > 100 and facts.host_gbs > 1 and facts.memory_bytes > 2**30
    assert facts.matmul_efficiency == facts.memory_efficiency == 1.0
    known = GPUS.get(next((k for k, v in GPUS.items() if v.name == facts.name), ""), None)
    if known is not None:  # what was reached stays under the datasheet
        assert facts.matmul_tflops["bf16"] <= known.matmul_tflops["bf16"] * 1.05


def test_calibrating_without_a_gpu_says_how_in_one_line(capsys):
    from ckrun.runner.predict.hardware import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["out.json"]) == 2
    assert "on a machine with a GPU" in capsys.readouterr().err
