"""Every way a command ends on purpose is a CkrunError, and ckrun.runner.cli.ending is the one map from it
to an exit status and the lines on stderr, for every verb. A new error class must be added here
with its status and lines, or the first test fails."""

import importlib
import pkgutil

import pytest
import torch

from ckrun import autotune, runner
from ckrun.autotune.api import MemoryPlanError
from ckrun.autotune.tune import NothingFits
from ckrun.autotune.outputs.rank_tune import RanksEnded, RanksOverCap
from ckrun.runner.builders.resolve import BuildError
from ckrun.runner.disk.checkpoint_files import CheckpointError
from ckrun.runner.cli import UsageError, ending
from ckrun.runner.recipe.load import AcrossSections
from ckrun.runner.predict.estimate import EstimateUnavailable
from ckrun.runner.predict.hardware import UnknownDevice
from ckrun.runner.problems import EXIT_STATUSES, CkrunError, InputError, KeyedError, Place, Problem
from ckrun.runner.train.run.guard import NonFiniteLoss
from ckrun.runner.train.loop import MemoryCapExceeded, OutOfMemory
from ckrun.runner.train.run.memory_cap import PredictedOverCap
from ckrun.runner.train.output.directory import OutputError
from ckrun.runner.train.output.numbers import RecordValueError

PROBLEM = Problem(Place("r.yaml", 3, 1), "train.steps", "input should be greater than 0")
CAP, OOM, NAN = MemoryCapExceeded(1000, 2000, 3), OutOfMemory(2, "no memory", torch.device("cpu")), NonFiniteLoss(5, float("nan"))
PREDICTED = PredictedOverCap(1000, 2000, "cpu", "batch 8, micro-batch 8, fp32, checkpointing none")

# class -> (an instance, its exit status, its lines)
EXAMPLES = {
    CkrunError: (CkrunError("stopped"), 2, ["ckrun: stopped"]),
    InputError: (InputError([PROBLEM]), 2, ["r.yaml:3:1: train.steps: input should be greater than 0"]),
    AcrossSections: (AcrossSections([PROBLEM]), 2, ["r.yaml:3:1: train.steps: input should be greater than 0"]),
    KeyedError: (KeyedError("train.steps", "too many"), 2, ["<recipe>: train.steps: too many"]),
    BuildError: (BuildError("model.name", "no such class"), 2, ["<recipe>: model.name: no such class"]),
    UsageError: (UsageError("ckrun: unknown verb 'tnue' (did you mean tune?)"), 2,
                 ["ckrun: unknown verb 'tnue' (did you mean tune?)"]),
    CheckpointError: (CheckpointError("step-1: state.pt is damaged"), 2, ["ckrun: step-1: state.pt is damaged"]),
    EstimateUnavailable: (EstimateUnavailable("reads tensor values"), 2, ["ckrun: reads tensor values"]),
    UnknownDevice: (UnknownDevice("no GPU named 'h1000'"), 2, ["ckrun: no GPU named 'h1000'"]),
    MemoryCapExceeded: (CAP, 3, [f"ckrun: {CAP}; lower memory.micro_batch or checkpoint more blocks"]),
    OutOfMemory: (OOM, 3, [f"ckrun: {OOM}; {OOM.advice}"]),
    PredictedOverCap: (PREDICTED, 3, ["ckrun: memory cap 1.0 kB: `ckrun estimate` predicts a peak of 2.0 kB per step on cpu "
                                      "(batch 8, micro-batch 8, fp32, checkpointing none), so the run stops before step "
                                      f"1; {PredictedOverCap.advice}"]),
    RanksOverCap: (RanksOverCap(1000), 3, [f"ckrun: {RanksOverCap(1000)}; {RanksOverCap.advice}"]),
    NothingFits: (NothingFits("no plan fits under 1 MB"), 3, ["ckrun tune: no plan fits under 1 MB"]),
    NonFiniteLoss: (NAN, 4, [f"ckrun: {NAN}"]),
    OutputError: (OutputError(28, "cannot write m.jsonl: No space left on device"), 5,
                  ["ckrun: cannot write m.jsonl: No space left on device"]),
    RecordValueError: (RecordValueError("lr", object()), 1,
                       ["ckrun: the run's record 'lr' holds a builtins.object (no shape), not a number; it cannot be "
                        "written to metrics.jsonl or a checkpoint"]),
    RanksEnded: (RanksEnded(4), 4, []),  # each rank said why already
    # the Python API's (autotune/api.py): raised at the caller, never a verb's ending, but one line like the rest
    MemoryPlanError: (MemoryPlanError("nothing fits\nwithin 1 MB"), 2, ["ckrun: nothing fits within 1 MB"]),
}


def _every_module() -> None:
    """Import all of runner/ and autotune/ so every error class is defined (a __main__ would run a command)."""
    for package in (runner, autotune):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)


def _subclasses(cls: type) -> set[type]:
    return {cls} | {sub for direct in cls.__subclasses__() for sub in _subclasses(direct)}


def test_every_error_a_verb_can_end_with_is_in_the_map():
    _every_module()
    assert _subclasses(CkrunError) == set(EXAMPLES), "give the new error's status and lines in EXAMPLES"


@pytest.mark.parametrize("cls", list(EXAMPLES), ids=lambda cls: cls.__name__)
def test_each_error_ends_with_its_status_and_its_lines(cls, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    err, status, lines = EXAMPLES[cls]
    assert ending(err) == (status, lines)
    assert status in EXIT_STATUSES and all("\n" not in line for line in lines)


def test_rank_zero_alone_says_what_every_rank_met():
    """The cap and the loss are reduced over the ranks: one line from rank 0, not one per rank; a
    rank's own allocator running out is said by that rank."""
    assert ending(CAP) == (3, EXAMPLES[MemoryCapExceeded][2])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RANK", "1")
        assert ending(CAP) == (3, []) and ending(NAN) == (4, [])
        assert ending(OOM) == EXAMPLES[OutOfMemory][1:] and ending(InputError([PROBLEM]))[1]


def test_what_is_not_ours_ends_as_before():
    assert ending(KeyboardInterrupt()) == (130, ["ckrun: interrupted"])
    assert ending(SystemExit(3))[0] == 3
    assert ending(ValueError("boom\nmore")) == (1, ["ckrun: internal error: ValueError: boom "
                                                    "(run with -v for the traceback)"])


GLOO_LOST = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
                         "[127.0.0.1]:40137")


def test_a_rank_that_lost_its_peer_leaves_the_line_to_the_launcher(monkeypatch):
    # a killed rank's surviving peer printed "internal error: RuntimeError: ... gloo ... Connection closed by
    # peer" before the launcher's line naming the rank that was killed
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("CKRUN_LAUNCHER_PID", "12345")
    assert ending(GLOO_LOST) == (1, [])  # status 1: the launcher counts it as a consequence, not the cause
    monkeypatch.delenv("CKRUN_LAUNCHER_PID")  # a torchrun of the user's: one line pointing at the other rank
    assert ending(GLOO_LOST) == (1, ["ckrun: rank 1 lost its connection to another rank, which ended first; that "
                                     "rank's own line (or torchrun's summary) says why"])
    monkeypatch.delenv("WORLD_SIZE")  # one process: no peer to lose, so a bug of ours
    assert ending(GLOO_LOST)[1][0].startswith("ckrun: internal error: RuntimeError: ")
