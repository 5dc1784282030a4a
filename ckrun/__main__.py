"""`python -m ckrun ...`, the same as `ckrun ...`."""

from ckrun.runner.cli import entry

entry()
