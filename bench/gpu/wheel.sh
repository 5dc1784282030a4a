#!/usr/bin/env bash
# Builds ckrun's own wheel into .whl/ for the GPU machine (no network there, so no pip install -e).
# The working tree comes first on PYTHONPATH there; the wheel supplies the `ckrun` script and the
# `ckrun.commands` entry points. Rebuild when pyproject.toml changes.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -f .whl/ckrun-*.whl
python3 -m pip wheel -q --no-deps -w .whl . 2>&1 | grep -v '^WARNING: Location' || true
ls .whl/ckrun-*.whl
