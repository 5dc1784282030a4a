"""`python -m runner.cli ...`, the same as `ckrun ...` (handy with `python -X importtime`)."""

import sys

from . import main

sys.exit(main())
