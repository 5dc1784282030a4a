"""`ckrun`: one module per verb; verbs outside runner (tune, report) plug in by entry point.

`ckrun RECIPE [k=v ...]` is short for `ckrun run RECIPE [k=v ...]`. Bad input of any kind is
printed as one line per problem on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Callable

from ..problems import EXIT_BAD_INPUT, InputError

log = logging.getLogger("ckrun")



@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    epilog: str = ""  # examples shown by --help


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """RECIPE [KEY=VALUE ...], as every verb that reads a recipe takes them."""
    parser.add_argument("recipe", help="recipe file or library name (see `ckrun ls`)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.steps=10")


def _commands() -> dict[str, Command]:
    # every module in this package is one verb
    found = {info.name: importlib.import_module(f"{__name__}.{info.name}").COMMAND for info in pkgutil.iter_modules(__path__)}
    for entry in entry_points(group="ckrun.commands"):
        if entry.name not in found:
            found[entry.name] = entry  # loaded only when used: keeps `ckrun validate` fast
    return found


def _parser(commands: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckrun",
        description="Train PyTorch models from YAML recipes; find the fastest memory plan under a cap.",
        epilog="examples:\n  ckrun recipes/bert_tiny.yaml train.steps=10\n  ckrun tune --max-mem 40GB\n"
        "  ckrun estimate recipes/bert_large.yaml --device cuda --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, command in commands.items():
        if not isinstance(command, Command):
            command = commands[name] = command.load()
        sub = verbs.add_parser(
            name, help=command.help, description=command.help, epilog=command.epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    first = next((a for a in argv if a not in ("-v", "--verbose")), None)
    if first is not None and not first.startswith("-") and first not in commands:
        argv.insert(argv.index(first), "run")  # `ckrun RECIPE ...` means `ckrun run RECIPE ...`
    parser = _parser(commands)
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling KEY=VALUE positionals at the first flag; gather the ones after it
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    if args.verb is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return commands[args.verb].run(args) or 0
    except InputError as err:
        for problem in err.problems:
            print(problem, file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as err:
        print("ckrun: interrupted", file=sys.stderr)
        return getattr(err, "exit_code", 130)  # 143 when a second SIGTERM abandoned a step
    except Exception as err:  # noqa: BLE001 - a bug (ours or in user code) is one line; -v shows where
        if args.verbose:
            traceback.print_exc()
        detail = str(err).strip().splitlines()[0][:300] if str(err).strip() else "no message"
        print(f"ckrun: internal error: {type(err).__name__}: {detail}"
              f"{'' if args.verbose else ' (run with -v for the traceback)'}", file=sys.stderr)
        return 1
