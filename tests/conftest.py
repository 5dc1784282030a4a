"""Shared helpers: run the real CLI in-process and tiny recipe overrides that train in seconds."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from ckrun.runner.cli import main

# Tiny models gain nothing from threads, and OpenMP spinning on a shared 2-core machine can
# make them many times slower: one thread keeps the suite fast and its timing steady.
torch.set_num_threads(1)

# Every generated test, whatever its own @settings leave unset: no per-example deadline. Hypothesis's
# default (200 ms) fails an example that a busy machine slowed down (DeadlineExceeded, or "Unreliable
# test timings" when the replay is quick), and it also sets the too_slow health check's bound on drawing
# to 1 s; without a deadline that bound is 30 s. Time is bounded by pytest-timeout, speed by bench/.
# The failing example's blob is printed, so a case CI drew can be replayed here (@reproduce_failure).
# Built on the profile hypothesis loaded (its "ci" profile where a CI variable is set), so that stays.
settings.register_profile("ckrun", parent=settings.default, deadline=None, print_blob=True)
settings.load_profile("ckrun")

ROOT = Path(__file__).resolve().parents[1]
BERT_TINY = str(ROOT / "recipes" / "bert_tiny.yaml")

# bert_tiny made smaller still: a step takes a few milliseconds on one core
TINY_BERT = [
    "model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.vocab_size=256",
    "model.config.max_position_embeddings=32", "data.seq_len=32", "train.batch_size=8", "train.device=cpu",
]


@pytest.fixture
def ckrun(capsys):
    """Run `ckrun ARGS` in this process; returns (exit code, stdout, stderr)."""

    def run(*args: str):
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


@contextlib.contextmanager
def time_limit(seconds: int, what: str):
    """End a call that would never return (a FIFO or device read, a hang) with a TimeoutError saying `what`,
    instead of the whole test run."""
    def stop(signum, frame):
        raise TimeoutError(f"{what} ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def lstm_step_reaches(op: str) -> bool:
    """Whether a real LSTM step reaches `op` on this torch (oneDNN may be absent or bypassed on some builds)."""
    from ckrun.runner.predict.fake_gaps import FakeGapWatch

    watch = FakeGapWatch()
    lstm = torch.nn.LSTM(8, 8, batch_first=True)
    with watch:
        lstm(torch.randn(2, 3, 8))[0].sum().backward()
    return op in watch.seen


@pytest.fixture(autouse=True)
def _own_user_cache(monkeypatch, tmp_path_factory):
    """ckrun keeps ls's counts, validate's passed model checks and tokenised data in the user's cache
    (runner/disk/user_cache.py): each test gets an empty one, so no test sees what another kept, and the
    suite leaves nothing in the home folder. Children inherit it through the environment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("user-cache")))


@pytest.fixture(autouse=True)
def _logger_levels_restored():
    """A benchmark's main() run in-process quiets ckrun's loggers (bench/tune_oracle.py sets them to
    WARNING); put them back, so a later test on the same worker still sees the INFO lines it checks."""
    names = ("ckrun", "ckrun.runner", "ckrun.autotune", "optuna")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture
def two_rank_mesh():
    """Rank 0 of torch's fake process group of 2 ranks (collectives are no-ops, shapes real), as a 1-D
    device mesh: DTensors as FSDP2's shards are, in one process (a testing API: skipped without it)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()
