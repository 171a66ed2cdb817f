#!/usr/bin/env bash
# The whole GPU check in one command (for the device machine): build, GPU suite, bench.
# Logs go to ${OUT:-./out}.  Usage: bash scripts/device_check.sh [bench args...]
#
# One device call may run 600 s.  The suite gets TEST_TIMEOUT seconds (default 480: its
# bench tests start about 27 benchmark children, estimated at 250-300 s together); the
# bench then gets what is left of DEADLINE seconds from this script's start (default 570),
# or is skipped with a line saying so when less than 90 s are left (SKIP_BENCH=1 skips it
# always).  The suite prints one line per test as it ends (-v: a suite cut by its timeout
# still says which passed) and its 15 slowest tests, so the next call can be planned.
# Commands run as `python3 -m vmm_core.cli` (what `vmm-core` runs), whichever bin
# directory pip put the console script in.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-570}
TEST_TIMEOUT=${TEST_TIMEOUT:-480}
bash scripts/device_install.sh "$OUT/install.log" || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m vmm_core.cli info 2>&1 | tee "$OUT/info.log"
# every CUDA test, and the CUDA example (tests/test_examples.py names it by its file only)
VMM_CORE_REQUIRE=cuda timeout "$TEST_TIMEOUT" python3 -m pytest tests -k "cuda or engine_runner" \
    -v -p no:warnings -p no:cacheprovider -rfE --durations=15 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?
[ "$tests_rc" = 124 ] && echo "GPU suite: stopped by its ${TEST_TIMEOUT} s timeout" \
    | tee -a "$OUT/gpu_tests.log"
left=$((DEADLINE - SECONDS))
if [ "${SKIP_BENCH:-0}" = 1 ]; then
    echo "bench: skipped (SKIP_BENCH=1)"
elif [ "$left" -lt 90 ]; then
    echo "bench: skipped, ${left} s left of DEADLINE=${DEADLINE}; run it in a call of its" \
         "own: python3 -m vmm_core.cli bench --json \$OUT/bench.json" | tee "$OUT/bench.log"
else
    echo "bench: up to ${left} s"
    timeout "$left" python3 -m vmm_core.cli bench --json "$OUT/bench.json" \
        --plot "$OUT/bench.png" "$@" 2>&1 | tee "$OUT/bench.log"
    echo "bench: exit ${PIPESTATUS[0]} after $((SECONDS)) s of the script" | tee -a "$OUT/bench.log"
fi
exit $tests_rc
