#!/usr/bin/env bash
# One call of the GPU campaign on the lent machine: bash bench/gpu/call.sh STAGE [ARGS]
#   facts (<= 4 min), plans (<= 7 min), tune (<= 8 min): 20 GPU-minutes in all, machine starts included.
# Each script keeps to its budget itself (--budget-s; see bench/gpu/budget.py); `timeout` here is only
# the backstop, 20 s later. It installs the carried wheels (.whl/: optuna, pydantic and their needs,
# and ckrun's own wheel, which gives `ckrun` and its entry points) into /tmp/site, puts the working
# tree first on the path, then runs STAGE with its results under $OUT. No CPU test suite here: CI runs it.
set -uo pipefail
stage=${1:?stage: facts, plans or tune}; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "call.sh: could not install .whl/ (run ../shared/tools/device-wheels.sh and bench/gpu/wheel.sh)"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
case $stage in
  facts) budget=${FACTS_S:-220}; timeout $((budget + 20)) python3 bench/gpu/facts.py "$out" --budget-s "$budget" "$@" ;;
  plans) budget=${PLANS_S:-400}; timeout $((budget + 20)) python3 bench/gpu/plans.py "$out" --budget-s "$budget" "$@" ;;
  tune)  budget=${TUNE_S:-455}; timeout $((budget + 20)) python3 bench/gpu/tune.py "$out" --budget-s "$budget" "$@" ;;
  *) echo "call.sh: unknown stage $stage"; exit 2 ;;
esac
