"""What a study's report says about its winner: one plan only measured (nothing compared), a
runner-up within the noise of the winner, and a plot that draws what its legend names."""

from __future__ import annotations

import matplotlib
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckrun.autotune.cap import Cap
from ckrun.autotune.records import TrialRecord
from ckrun.autotune.outputs.report import caveats, format_table, plot
from ckrun.autotune.records import ranked_feasible
from ckrun.autotune.outputs.tuned import provenance

CONFIG = {"cap": 100_000_000, "margin": 0.05}


def _runs(key: str, speeds: list[float], first: int, peak: int = 50_000_000) -> list[TrialRecord]:
    """A plan's first probe and its re-runs, as the study records them."""
    return [TrialRecord(state="feasible", number=first + i, key=key, label=f"plan {key}", plan={"micro_batch": 1},
                        precision="fp32", measured_peak=peak, samples_per_s=speed,
                        repeat_of=None if i == 0 else first) for i, speed in enumerate(speeds)]


speeds = st.lists(st.floats(1.0, 100.0), min_size=1, max_size=3)


@settings(max_examples=200, deadline=None)
@given(speeds, speeds)
def test_the_runner_up_is_flagged_exactly_when_its_runs_do_not_separate_from_the_winners(a, b):
    records = _runs("a", a, 0) + _runs("b", b, 10)
    found = caveats(records)
    median = lambda xs: sorted(xs)[len(xs) // 2] if len(xs) % 2 else sum(sorted(xs)[len(xs) // 2 - 1:][:2]) / 2  # noqa: E731
    best, second = (a, b) if (median(a), -0) >= (median(b), -10) else (b, a)
    if len(a) == 1 or len(b) == 1:
        assert len(found) == 1 and found[0].startswith("NOT CONFIRMED") and "1 run" in found[0]
    elif max(second) < min(best):
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith("WITHIN THE NOISE")
        assert f"median of {len(best)} runs, {min(best):.2f}-{max(best):.2f}" in found[0]


def test_one_plan_measured_says_so_in_the_table_and_in_tuned_yaml(tmp_path):
    records = _runs("a", [4.3], 0) + [TrialRecord(state="skipped", number=n, reason="queued") for n in range(1, 20)]
    assert "warning: ONLY ONE PLAN WAS MEASURED (trial 0)" in format_table(records, CONFIG["cap"], 95_000_000)
    comment = provenance(ranked_feasible(records)[0], Cap(CONFIG["cap"], 0.05), "r.yaml", [], tmp_path / "tuned.yaml", records)
    assert "chosen:     trial 0, the fastest that fits of 1 plan(s) measured (20 trials: 19 skipped, 1 feasible)" in comment
    assert "# WARNING:    ONLY ONE PLAN WAS MEASURED (trial 0): nothing was compared" in comment.replace("#   ", "# ")
    assert "of 20" not in comment.replace("(20 trials", "")


def test_predictions_carry_no_measurement_caveat():
    records = [r.model_copy(update={"predicted": True}) for r in _runs("a", [4.0], 0) + _runs("b", [3.9], 1)]
    assert caveats(records) == [] and caveats(records[:1]) == []


@pytest.mark.parametrize("plans", [1, 2, 4])
def test_every_legend_entry_of_the_plot_is_drawn_in_view(tmp_path, monkeypatch, plans):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # more memory, more speed: every plan is on the front
    records = [r for n in range(plans) for r in _runs(str(n), [10.0 + n], n, peak=(40 + 10 * n) * 10**6)]
    shown = {}
    real_savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        shown["axes"] = fig.axes[0]
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    plot(tmp_path, records, CONFIG)
    ax = shown["axes"]
    left, right = ax.get_xlim()
    handles, labels = ax.get_legend_handles_labels()
    assert ("Pareto front" in labels) == (plans > 1)
    for handle, label in zip(handles, labels, strict=True):
        if hasattr(handle, "get_offsets"):  # a scatter: its points in view
            xs = [x for x, _ in handle.get_offsets()]
        else:  # a line: a vertical one (cap, limit) or the front's steps
            xs = list(handle.get_xdata())
            assert label in ("cap", "limit (cap - margin)") or len(xs) > 1, label
        assert xs and all(left <= x <= right for x in xs), label


def test_a_budget_that_stopped_before_a_fitting_plan_does_not_say_nothing_fits(tmp_path):
    """The first probe went over the cap and the time budget ended the search: plans never measured
    may fit, so the line says the budget stopped it, not "nothing fits"."""
    from ckrun.autotune.outputs.train import nothing_fits

    over = TrialRecord(state="over_cap", number=0, key="a", label="micro_batch 16, checkpointing none, fp32",
                       plan={"micro_batch": 16}, precision="fp32", measured_peak=104_700_000)
    skipped = [TrialRecord(state="skipped", number=n, reason="queued") for n in (1, 2)]
    line = nothing_fits([over, *skipped], Cap(100_000_000, 0.05), None, None, tmp_path)
    assert line.startswith("no plan measured fits within 95.0 MB (100.0 MB cap minus 5% margin), but 2 queued plan(s) "
                           "were never measured: the time budget stopped the search")
    assert "nothing fits" not in line and "smallest peak seen was 104.7 MB" in line
