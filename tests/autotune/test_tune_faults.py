"""Probes that run out of memory, crash or hang cost one trial each, never the tuner; an
impossible cap, a bad flag and a training run that breaches the cap each get a clear answer."""

import re
from pathlib import Path

import pytest
import torch

from ckrun.autotune.records import TrialRecord
from ckrun.autotune.tune import check_cap_fits
from ckrun.autotune.space.facts import Device
from ckrun.autotune.cap import Cap
from ckrun.autotune.outputs.train import train_with_fallback
from conftest import BERT_TINY, TINY_BERT
from ckrun.runner.problems import InputError
from ckrun.runner.train.loop import MemoryCapExceeded, RunResult
from tune_helpers import launches, survivors, trials_by_number, use_fake_child


def _tune(ckrun, directory, *extra):
    return ckrun("tune", BERT_TINY, *TINY_BERT, f"output.dir={directory}", "--output", directory, "--no-train",
                 "--no-screen", *extra)  # the fake child measures a formula, not what the estimator predicts


@pytest.mark.slow  # 21 s: waits out a hang
def test_oom_crash_and_hang_are_survived(ckrun, monkeypatch, tmp_path):
    use_fake_child(monkeypatch)
    monkeypatch.setenv("CKRUN_PROBE_FAULT", "oom:0,crash:1,hang:2")  # the child's documented test hook
    code, out, err = _tune(ckrun, tmp_path, "--max-mem", "10MB", "--trials", "4", "--probe-timeout", "15")
    assert code == 0, err
    trials = trials_by_number(tmp_path)
    assert trials[0]["state"] == "oom" and "injected by CKRUN_PROBE_FAULT" in trials[0]["reason"]
    assert trials[1]["state"] == "died" and "SIGSEGV" in trials[1]["reason"]
    assert trials[2]["state"] == "timeout" and "timed out after 15 s" in trials[2]["reason"]
    assert trials[3]["state"] == "feasible"
    assert not survivors([launch["pid"] for launch in launches(tmp_path)])  # the hang's grandchild included


def test_an_impossible_cap_says_what_was_seen_and_what_would_help(ckrun, monkeypatch, tmp_path):
    use_fake_child(monkeypatch)
    code, _, err = _tune(ckrun, tmp_path, "--max-mem", "1MB", "--trials", "3")
    assert code == 3
    assert len(err.strip().splitlines()) == 1
    assert re.search(r"nothing fits within 950.0 kB \(1.0 MB cap minus 5% margin\): the smallest peak seen was "
                     r"[\d.]+ MB \(trial \d: micro_batch \d, checkpointing \w+, fp32\)", err)
    assert "--search-precision would try bf16" in err


def test_when_every_probe_breaks_the_line_gives_the_probes_reason(ckrun, monkeypatch, tmp_path):
    # not "the smallest peak predicted": a crash says nothing about memory
    use_fake_child(monkeypatch)
    monkeypatch.setenv("CKRUN_PROBE_FAULT", "crash:0,crash:1,crash:2")
    code, _, err = _tune(ckrun, tmp_path, "--max-mem", "10MB", "--trials", "3")
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "3 probe(s) failed before measuring a peak, e.g. trial 0" in err and "SIGSEGV" in err
    assert f"{tmp_path / 'probes' / 'trial-0.log'}" in err


@pytest.mark.parametrize("flag, value, message", [
    ("--max-mem", "lots", "'lots' is not a size"),
    ("--time-budget", "soon", "'soon' is not a duration"),
    ("--trials", "0", "at least 1 plan"),
    ("--margin", "0.7", "in [0, 0.5)"),
])
def test_bad_flags_are_one_line_and_status_2(ckrun, tmp_path, flag, value, message):
    extra = [flag, value] if flag == "--max-mem" else ["--max-mem", "1GB", flag, value]
    code, _, err = _tune(ckrun, tmp_path, *extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not launches(tmp_path)


def test_a_cap_larger_than_the_card_is_refused():
    card = Device("cuda", "NVIDIA H100 80GB HBM3", 85_000_000_000, ("fp32", "bf16"), "2.x", "12.8")
    with pytest.raises(InputError, match=r"more than the NVIDIA H100 80GB HBM3 has \(85.0 GB\); give at most"):
        check_cap_fits(Cap(200 * 10**9, 0.05), card, "200GB")


def _tuned_for(record):
    """What tune's own tuned_for returns: the tuned.yaml path of a ranked trial and its recipe."""
    from ckrun.runner.recipe.load import load_recipe

    return Path(f"tuned-{record.number}.yaml"), load_recipe(BERT_TINY, TINY_BERT + ["memory.max_mem=100"])


def _ranked(number: int, label: str, peak: int) -> TrialRecord:
    return TrialRecord(state="feasible", number=number, label=label, measured_peak=peak)


def test_a_breach_in_training_falls_back_to_the_next_best_plan(tmp_path):
    ranked = [_ranked(4, "fast", 90), _ranked(7, "lean", 60)]
    trained = []

    def train(recipe, source, resume):
        trained.append((source, resume))
        if source == "tuned-4.yaml":
            raise MemoryCapExceeded(100, 120, 2)
        return RunResult(3, peak_mem_bytes=80)

    assert train_with_fallback(ranked, _tuned_for, resume=False, train_fn=train).record.number == 7
    assert trained == [("tuned-4.yaml", False), ("tuned-7.yaml", True)]  # the fallback continues the same run


def test_a_stopped_training_run_is_not_a_reason_to_fall_back(capsys):
    """SIGTERM during tune's training ends it like `ckrun run`, no next plan tried; the line that says so
    is `ckrun tune`'s to print (the library prints nothing)."""
    import signal

    ranked = [_ranked(4, "a", 90), _ranked(7, "b", 80)]
    trained = []

    def train(recipe, source, resume):
        trained.append(source)
        return RunResult(2, peak_mem_bytes=80, stopped_by=signal.SIGTERM)

    found = train_with_fallback(ranked, _tuned_for, resume=False, train_fn=train)
    assert found.result.stopped_by == signal.SIGTERM and found.record.number == 4 and trained == ["tuned-4.yaml"]
    assert capsys.readouterr() == ("", "")


def test_ckrun_tune_prints_the_stop_line_of_a_stopped_training_and_its_status(ckrun, monkeypatch, tmp_path):
    """The library returns a stopped run; the command says so in `ckrun run`'s line and exits 143."""
    import signal

    from ckrun.autotune import cli_tune
    from ckrun.autotune.tune import Found, TuneResult
    from ckrun.runner.recipe.load import load_recipe

    recipe = load_recipe(BERT_TINY, [f"output.dir={tmp_path}"])
    record = _ranked(4, "a", 90)

    def stopped_tune(request, on_found):
        found = Found(request.directory, [record], "the table", [record], "the winner changes nothing")
        on_found(found)
        return TuneResult(found, record, tmp_path / "tuned.yaml", recipe,
                          RunResult(2, total_steps=5, stopped_by=signal.SIGTERM, output_dir=tmp_path))

    monkeypatch.setattr(cli_tune, "tune", stopped_tune)
    code, out, err = ckrun("tune", BERT_TINY, *TINY_BERT, "--max-mem", "1GB", "--output", tmp_path)
    assert code == 128 + signal.SIGTERM
    assert out == "the table\nckrun tune: the winner changes nothing\n"
    assert err.strip().startswith("ckrun: stopped by SIGTERM after step 2 of 5")


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)"),
    MemoryError(),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
])
def test_a_probe_that_runs_out_of_host_or_device_memory_is_recorded_as_oom(error):
    """On the CPU a plan over the machine's memory fails in the CPU allocator: still a plan that does
    not fit, which the search learns from, not a crash."""
    from ckrun.autotune.probes.child import _guarded

    def step():
        raise error

    assert _guarded(step).status == "oom"
