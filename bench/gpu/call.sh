#!/usr/bin/env bash
# One call of the GPU campaign on the lent machine: bash bench/gpu/call.sh STAGE [ARGS]
# It installs the carried wheels (.whl/: optuna, pydantic and their needs, and ckrun's own wheel,
# which gives `ckrun` and its entry points) into /tmp/site, puts the working tree first on the
# path, then runs STAGE with its results under $OUT. See bench/gpu/README section in README.md.
set -uo pipefail
stage=${1:?stage: facts, plans or tune}; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "call.sh: could not install .whl/ (run ../shared/tools/device-wheels.sh and bench/gpu/wheel.sh)"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
out=${OUT:-/tmp/out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$out/nvidia-smi.txt"
case $stage in
  facts)
    python3 bench/gpu/facts.py "$out"
    timeout "${CUDA_TESTS_S:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tee "$out/pytest-cuda.log" | tail -40
    CUDA_VISIBLE_DEVICES= timeout "${CPU_TESTS_S:-200}" python3 -m pytest -q -n 12 -p no:cacheprovider 2>&1 \
      | tee "$out/pytest-cpu.log" | tail -15 ;;
  plans) python3 bench/gpu/plans.py "$out" "$@" ;;
  tune)  python3 bench/gpu/tune.py "$out" "$@" ;;
  *) echo "call.sh: unknown stage $stage"; exit 2 ;;
esac
