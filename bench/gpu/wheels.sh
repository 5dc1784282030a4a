#!/usr/bin/env bash
# Fills .whl/ with what the lent GPU machine lacks, for bench/gpu/call.sh (which installs it there):
# the workplace's list (/work/shared/tools/device-wheels.sh: optuna, pydantic and what they need, for
# Python 3.12 on x86-64), ckrun's own wheel (the `ckrun` script and its entry points; the working tree
# itself comes first on the path there: rebuild after pyproject.toml changes), and any extra requirement
# given, e.g. `bash bench/gpu/wheels.sh torchao==0.18.0` when issue 33's knobs need it. .whl/ is emptied
# first: two versions of one package stop the whole install. Works in a clone and in a git worktree
# (where .git is a file, into which the shared script cannot write its exclude line: there it runs in a
# scratch repository and its wheels are moved over; .gitignore keeps /.whl/ out of git either way).
# Ends by printing what a call carries (tracked and untracked-not-ignored files, plus .whl) against
# the device's 64 MiB.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
shared=${DEVICE_WHEELS:-/work/shared/tools/device-wheels.sh}
rm -rf .whl && mkdir -p .whl
if [ -d .git ]; then
  bash "$shared" "$@" >/dev/null
else
  scratch=$(mktemp -d)
  git -C "$scratch" init -q
  (cd "$scratch" && bash "$shared" "$@" >/dev/null)
  mv "$scratch"/.whl/*.whl .whl/
  rm -rf "$scratch"
fi
python3 -m pip wheel -q --no-deps -w .whl . 2>&1 | grep -v '^WARNING: Location' || true
ls .whl
tree=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | du -cb --files0-from=- | tail -1 | cut -f1)
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
echo "a call carries $((tree / 1024)) KiB of working tree + $((wheels / 1024)) KiB of .whl =" \
     "$(((tree + wheels) / 1048576)) MiB of the device's 64 MiB"
