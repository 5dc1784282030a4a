"""What compute hides of a step's collectives (runner/predict/overlap.py) and what they run at
(DeviceFacts.ring_rate): counted on given timelines, never timed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckrun.runner.predict.hardware import GPUS
from ckrun.runner.predict.overlap import DDP_BUCKET_BYTES, Collective, ddp_buckets_exposed, exposed
from ckrun.runner.predict.roofline import _per_host

seconds = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@st.composite
def timelines(draw):
    ops = draw(st.lists(seconds, min_size=0, max_size=30))
    collectives = draw(st.lists(st.builds(Collective, st.integers(0, len(ops)), seconds,
                                          st.sampled_from(["gather", "reduce", "other"]), st.booleans()), max_size=12))
    return ops, sorted(collectives, key=lambda c: c.position)


@settings(max_examples=200, deadline=None)
@given(timelines())
def test_what_compute_waits_is_never_negative_nor_more_than_the_collectives(timeline):
    ops, collectives = timeline
    waited = exposed(ops, collectives)
    assert -1e-9 <= waited <= sum(c.seconds for c in collectives) + 1e-9


@settings(max_examples=100, deadline=None)
@given(timelines())
def test_a_blocking_collective_is_waited_for_whole(timeline):
    ops, collectives = timeline
    blocking = [Collective(c.position, c.seconds, c.kind, True) for c in collectives]
    assert exposed(ops, blocking) == pytest.approx(sum(c.seconds for c in collectives), abs=1e-9)


def test_fsdp_gathers_hide_behind_the_previous_units_compute_but_the_first():
    """Units of 1 s compute each, gathered in 0.5 s before each: only the first gather has nothing before it."""
    ops = [1.0] * 4
    gathers = [Collective(i, 0.5, "gather", False) for i in range(4)]
    assert exposed(ops, gathers) == pytest.approx(0.5)
    slow = [Collective(i, 1.5, "gather", False) for i in range(4)]  # longer than a unit: each one waits 0.5 more
    assert exposed(ops, slow) == pytest.approx(1.5 + 3 * 0.5)


def test_reductions_hide_behind_the_next_units_backward_the_last_shows():
    ops = [1.0] * 4
    reduces = [Collective(i + 1, 0.25, "reduce", False) for i in range(4)]  # each after its unit's backward
    assert exposed(ops, reduces) == pytest.approx(0.25)
    # a gather does not queue behind a reduce-scatter issued just before it (streams of their own): only the first
    # gather, with nothing before it, shows (one stream would make it wait the reduction too: 0.5)
    both = sorted([*reduces[:3], *(Collective(i, 0.25, "gather", False) for i in range(1, 4))], key=lambda c: c.position)
    assert exposed(ops, both) == pytest.approx(0.25)


def test_ddp_exposes_at_least_its_last_bucket_and_at_most_all_of_them():
    rate, world, backward = 100e9, 8, 0.5
    last = 2 * DDP_BUCKET_BYTES * (world - 1) / world / rate
    gradients = 40 * DDP_BUCKET_BYTES
    waited = ddp_buckets_exposed(gradients, rate, world, backward)
    assert last <= waited + 1e-12 and waited < 2 * gradients * (world - 1) / world / rate
    assert ddp_buckets_exposed(gradients, rate, 1, backward) == 0.0
    assert ddp_buckets_exposed(gradients, rate, world, 100.0) == pytest.approx(last)  # a long backward hides the rest


def test_a_ring_runs_at_nvlink_within_a_host_and_at_the_hosts_rails_across():
    h100 = GPUS["h100"]
    assert h100.ring_rate(8, 8) == h100.peer_gbs * 1e9
    assert h100.ring_rate(128, 8) == min(h100.peer_gbs, 8 * h100.network_gbs) * 1e9  # eight rails a host
    assert h100.ring_rate(16, 1) == h100.network_gbs * 1e9  # one rank a host: its own rail
    pcie = GPUS["l4"]
    assert pcie.network_gbs == 0 and pcie.ring_rate(64, 8) == pcie.peer_gbs * 1e9  # not known: the peer rate


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 64), st.integers(1, 16), st.sampled_from([1, 2, 4, 8]))
def test_a_groups_ranks_a_host_follow_torchruns_numbering(size, stride, per_host):
    ranks = tuple(range(0, size * stride, stride))
    held = _per_host(ranks, per_host)
    assert 1 <= held <= min(size, per_host)
    assert held == min(size, max(1, -(-per_host // stride))) if stride <= per_host else held == 1
