"""`python -m runner.cli ...`, the same as `ckrun ...` (handy with `python -X importtime`)."""

from . import entry

entry()
