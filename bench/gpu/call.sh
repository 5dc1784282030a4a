#!/usr/bin/env bash
# The GPU campaign in one call of at most 9 minutes, the machine's start included (issue 35):
#   bash bench/gpu/call.sh                 # every step, in order of value: facts, plans, knobs, tune, cuda_tests
#   bash bench/gpu/call.sh tune cuda_tests # a second call on the warm machine: the steps the first left
#   bash bench/gpu/call.sh --dry-run       # the same control flow at toy size on a CPU (the default tests run it)
# Ask for it with the device tool's timeout_s 400 (bench/gpu/budget.py RUN_TIMEOUT_S), carry .whl
# (bench/gpu/wheels.sh fills it), and give the machine back as soon as it returns. It installs the wheels
# into /tmp/site, puts the working tree first on the path (the wheel's ckrun only brings its entry points),
# takes what the install cost off the campaign's budget and runs bench/gpu/campaign.py with results in $OUT;
# `timeout` here is only the backstop, BACKSTOP_S after the campaign's own deadline.
set -uo pipefail
started=$(date +%s)
python=${PYTHON:-python3}
dry=0
for arg in "$@"; do [ "$arg" = --dry-run ] && dry=1; done
out=${OUT:-/tmp/ckrun-campaign}
mkdir -p "$out"
budget_of() { PYTHONPATH=$PWD "$python" -c "from bench.gpu import budget; print(budget.$1)"; }
if [ $dry = 1 ]; then seconds=$(budget_of DRY_RUN_S)            # toy steps on a busy CPU: no GPU time to account
elif [ $# -gt 0 ]; then seconds=$(budget_of SECOND_CALL_S)      # named steps: a second call
else seconds=$(budget_of COMMAND_S); fi
seconds=${CAMPAIGN_S:-$seconds}
backstop=$(budget_of BACKSTOP_S)
if [ $dry = 0 ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "call.sh: could not install .whl/ (run bash bench/gpu/wheels.sh here, and carry .whl)"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
  nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv > "$out/nvidia-smi.txt" 2>&1
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
left=$((seconds - ($(date +%s) - started)))
echo "call.sh: ${left} s for the campaign (install took $(($(date +%s) - started)) s; results in $out)"
timeout -k 3 $((left + backstop - 3)) "$python" bench/gpu/campaign.py "$out" "$@" --budget-s "$left"
code=$?
case $code in
  3) echo "call.sh: the campaign reached its deadline; campaign.json says which step was cut short" ;;
  124|137) echo "call.sh: the campaign overran its own deadline and was stopped by the backstop" ;;
esac
exit $code
