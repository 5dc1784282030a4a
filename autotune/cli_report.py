"""`ckrun report DIR`: the Pareto table of a study, finished or still running, and its plot; or,
for a run's output.dir, its training curves (runner/train/output/curves.py)."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from ckrun.runner.cli import Command
from ckrun.runner.problems import InputError, Place, Problem
from ckrun.runner.train.output.curves import report_run
from ckrun.runner.train.output.directory import METRICS

from .outputs.report import publish
from .search.study import STUDY_NAME, trial_records


def add_arguments(parser) -> None:
    parser.add_argument("directory", metavar="DIR",
                        help="a run's output.dir (draws DIR/curves.png) or a study directory written by `ckrun tune`")


def run(args) -> int:
    directory = Path(args.directory)
    journal = directory / "study.journal"
    if not journal.is_file() and (directory / METRICS).is_file():
        print(report_run(directory))
        return 0
    if not journal.is_file():
        raise InputError([Problem(Place(str(directory)), "", "holds no run (no metrics.jsonl) and no study (no "
                                  "study.journal); give a run's output.dir, or the directory `ckrun tune` wrote")])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # reading the journal takes no lock: a report of a running study is fine
    study = optuna.load_study(study_name=STUDY_NAME, storage=JournalStorage(JournalFileBackend(str(journal))))
    print(publish(directory, trial_records(study), study.user_attrs["config"],
                  study.user_attrs.get("screening")))
    return 0


COMMAND = Command(
    "report", "draw a run's training curves, or print a tuning study's Pareto table and plot", add_arguments, run,
    epilog="examples:\n  ckrun report runs/bert_tiny        # loss, eval, throughput, memory -> runs/bert_tiny/curves.png\n"
    "  ckrun report runs/bert_tiny/tune\n"
    "  ckrun report runs/t   # also while `ckrun tune --output runs/t` is running",
)
