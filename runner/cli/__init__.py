"""`ckrun`: one module per verb, imported only when that verb runs.

`ckrun RECIPE [k=v ...]` is short for `ckrun run RECIPE [k=v ...]`. Bad input of any kind is
printed as one line per problem on stderr with exit status 2, never as a traceback; every way a
command ends is turned into its exit status and lines in one place, `ending`.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

from ..builders.user_code import UserExit, describe_exit, exits_raised, stray_threads
from ..parallel.supervise import lost_peer, peer_lost_lines
from ..problems import (EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERNAL_ERROR, EXIT_INTERRUPTED, CkrunError,
                        first_line)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: str = ""  # examples shown by --help


# Verb -> (module holding its COMMAND, the one-line help `ckrun --help` shows). The help is written
# here as well as in the module so that listing the verbs imports none of them: tune's module pulls
# in optuna and torch, seconds before `ckrun --help` could answer. A test keeps the two equal.
VERBS: dict[str, tuple[str, str]] = {
    "run": ("ckrun.runner.cli.run", "train a recipe (the default verb: `ckrun RECIPE` is `ckrun run RECIPE`)"),
    "validate": ("ckrun.runner.cli.validate", "check a recipe and report every problem, one line each"),
    "show": ("ckrun.runner.cli.show", "print the resolved recipe as YAML (or its blocks with --blocks)"),
    "estimate": ("ckrun.runner.cli.estimate", "predict a training step's peak memory and time on fake tensors (no GPU, no real memory)"),
    "tune": ("ckrun.autotune.cli_tune", "search memory plans under a cap, write tuned.yaml, then train with the fastest"),
    "report": ("ckrun.autotune.cli_report", "draw a run's training curves, or print a tuning study's Pareto table and plot"),
    "ls": ("ckrun.runner.cli.ls", "list the recipe library: name, family, parameter count, description"),
    "cp": ("ckrun.runner.cli.cp", "copy a library recipe (with its comments) to a file you can edit"),
    "schema": ("ckrun.runner.cli.schema", "print the recipe's JSON Schema, for completion and checks in an editor"),
    "tokenizer": ("ckrun.runner.cli.tokenizer", "train a byte-level BPE tokenizer (GPT-2's kind) on local text for data.tokenizer"),
}


class UsageError(CkrunError):
    """A command line argparse cannot parse: reported as one line, not a usage dump."""

    def lines(self) -> list[str]:
        return [str(self)]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own prints the usage and exits; we want one line
        raise UsageError(f"{self.prog}: {message}; see `{self.prog} --help`")


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """RECIPE [KEY=VALUE ...], as every verb that reads a recipe takes them."""
    parser.add_argument("recipe", help="recipe file or library name (see `ckrun ls`)")
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",  # a default: not "required"
                        help="dotted overrides, e.g. train.steps=10")


def gpu_names() -> str:
    """The GPUs `--gpu` knows by a short name, for the help of the verbs that take it: read from the
    device table (runner/predict/gpus.py, which needs no torch) when the verb's parser is built."""
    from ..predict.gpus import GPUS

    return ", ".join(GPUS)


def _plugins() -> dict[str, object]:
    """Verbs other packages add through the `ckrun.commands` entry point, not loaded yet."""
    return {entry.name: entry for entry in entry_points(group="ckrun.commands") if entry.name not in VERBS}


def load_command(name: str, plugins: dict[str, object]) -> Command:
    if name in VERBS:
        return importlib.import_module(VERBS[name][0]).COMMAND
    return plugins[name].load()


def _parser(chosen: Command | None, plugins: dict[str, object]) -> argparse.ArgumentParser:
    """The whole command line's parser; only the chosen verb gets its arguments (and its import)."""
    parser = _Parser(
        prog="ckrun",
        description="Train PyTorch models from YAML recipes; find the fastest memory plan under a cap.",
        epilog="examples:\n  ckrun recipes/bert_tiny.yaml train.steps=10\n  ckrun tune --max-mem 40GB\n"
        "  ckrun estimate recipes/bert_large.yaml --device cuda --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    helps = {name: text for name, (_, text) in VERBS.items()}
    helps |= {name: load_command(name, plugins).help for name in plugins}  # a plugin's help is on its Command
    for name, text in helps.items():
        if chosen is not None and chosen.name == name:
            sub = verbs.add_parser(name, help=text, description=text, epilog=chosen.epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
            chosen.add_arguments(sub)
        else:
            verbs.add_parser(name, help=text)
    return parser


def _verb_and_argv(argv: list[str], plugins: dict[str, object]) -> tuple[str | None, list[str]]:
    """The verb asked for, and argv with `run` put in where a recipe stands in the verb's place."""
    first = next((a for a in argv if a not in ("-v", "--verbose")), None)
    if first is None or first.startswith("-"):
        return None, argv
    if first in VERBS or first in plugins:
        return first, argv
    meant = _mistyped_verb(first, [*VERBS, *plugins])
    if meant:
        raise UsageError(f"ckrun: unknown verb {first!r} (did you mean {meant}?)")
    argv = list(argv)
    argv.insert(argv.index(first), "run")  # `ckrun RECIPE ...` means `ckrun run RECIPE ...`
    return "run", argv


def _mistyped_verb(word: str, verbs: list[str]) -> str | None:
    """The verb `word` is a typo of; None when it may be a recipe: a file, part of a library name, or
    at least as close to one as to any verb (`ckrun bert` is a recipe typo, `ckrun tnue` a verb typo)."""
    from ..recipe.library import library_recipes

    if not word.replace("-", "_").isidentifier() or Path(word).expanduser().exists():
        return None  # paths and overrides (`a/b.yaml`, `x.yaml`, `train.steps=5`) are never verbs
    recipes = list(library_recipes())
    if any(word in name for name in recipes):
        return None
    likeness = {name: difflib.SequenceMatcher(None, word, name).ratio() for name in [*recipes, *verbs]}
    closest = max(likeness, key=likeness.get)  # the first of equals: a recipe wins a tie
    return closest if closest in verbs and likeness[closest] >= 0.7 else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        plugins = _plugins()
        verb, argv = _verb_and_argv(argv, plugins)
        command = load_command(verb, plugins) if verb else None
        parser = _parser(command, plugins)
        args = _parse(parser, argv)
    except UsageError as err:
        return _said(*ending(err))
    # the time on every log line: when a step, an eval or a checkpoint happened, as in HF and Lightning logs
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    if command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    return _run(command, args)


def entry() -> None:
    """The `ckrun` program: main(), then leave without waiting for threads the user's code left running
    (Python would wait for them forever after "done")."""
    code = main()
    threads = stray_threads()
    if threads:
        print(f"ckrun: leaving {len(threads)} thread(s) the model's code started still running "
              f"({', '.join(threads[:3])}); ckrun does not wait for them", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # what is left is the OS's to take back: a predicted search leaves its fake model and traces, millions of
    # objects in cycles, and the collection at exit would walk and free them for seconds (1.5 s of the 8B's);
    # files are flushed by their owners and logging's handlers at exit, before it
    gc.freeze()
    sys.exit(code)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling KEY=VALUE positionals at the first flag; gather the ones after it
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        prog = f"ckrun {args.verb}" if args.verb else "ckrun"
        raise UsageError(f"{prog}: unrecognized arguments: {' '.join(extra)}; see `{prog} --help`")
    return args


def _run(command: Command, args: argparse.Namespace) -> int:
    try:
        with exits_raised():  # os._exit in user code: a line below, not a silent end
            return command.run(args) or 0
    except BrokenPipeError:
        # stdout's reader is gone: point stdout at /dev/null so the interpreter's final flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (Exception, SystemExit, UserExit, KeyboardInterrupt) as err:
        status, lines = ending(err, args.verbose)
        if status == EXIT_INTERNAL_ERROR and args.verbose and not isinstance(err, (SystemExit, UserExit)):
            traceback.print_exc()
        return _said(status, lines)


def ending(err: BaseException, verbose: bool = False) -> tuple[int, list[str]]:
    """The one map from how a command ended to (its exit status, the lines that say why on stderr),
    for every verb: a CkrunError carries both (runner/problems.py has the table of statuses)."""
    if isinstance(err, CkrunError):
        return err.exit_status, err.lines() if err.every_rank or is_rank_zero() else []
    if isinstance(err, (SystemExit, UserExit)):  # user code ended the run; never a silent status 0
        code = err.code if isinstance(err.code, int) and 0 < err.code < 256 else EXIT_BAD_INPUT
        return code, [describe_exit(err)]
    if isinstance(err, KeyboardInterrupt):  # 143 when a second SIGTERM abandoned a step
        return getattr(err, "exit_code", EXIT_INTERRUPTED), ["ckrun: interrupted"]
    if lost_peer(err):  # another rank ended first: its line is the one that says why
        return EXIT_INTERNAL_ERROR, peer_lost_lines()
    # a bug (ours or in user code) is one line; -v shows where
    detail = first_line(err) if str(err).strip() else "no message"
    return EXIT_INTERNAL_ERROR, [f"ckrun: internal error: {type(err).__name__}: {detail}"
                                 f"{'' if verbose else ' (run with -v for the traceback)'}"]


def _said(status: int, lines: list[str]) -> int:
    for line in lines:
        print(line, file=sys.stderr)
    return status


def is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"
