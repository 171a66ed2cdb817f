#!/usr/bin/env bash
# The whole GPU check in one command, on a machine with an NVIDIA GPU: build, GPU suite,
# bench.
# Logs go to ${OUT:-./out}.  Usage: bash scripts/device_check.sh [bench args...]
#
# The script keeps to DEADLINE (under ten minutes), so a hang ends in a timeout with the
# logs so far kept.  The GPU suite runs in two parts so that a run cut short still reports the contract and unit tests: first every CUDA test except those that start
# benchmark children (FAST_TIMEOUT s, default 240), then the benchmark-child tests
# (tests/test_bench_cuda.py, tests/test_rl_bench.py and the engine_runner example) with
# what is left of TEST_DEADLINE s (default 540) from this script's start.  On the H100
# (2026-11-23) the benchmark-child tests alone took more than 300 s, so the bench below
# (up to DEADLINE, default 570) rarely finds the 90 s it needs: SKIP_BENCH=1 skips it
# always.  Each part prints one line per test as it ends (-v: a part cut by its timeout
# still says which passed) and its slowest tests, so the next run can be planned.
# Commands run as `python3 -m vmm_core.cli` (what `vmm-core` runs), whichever bin
# directory pip put the console script in.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-570}
FAST_TIMEOUT=${FAST_TIMEOUT:-240}
TEST_DEADLINE=${TEST_DEADLINE:-540}
bash scripts/device_install.sh "$OUT/install.log" || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m vmm_core.cli info 2>&1 | tee "$OUT/info.log"
SLOW=(tests/test_bench_cuda.py tests/test_rl_bench.py tests/test_examples.py)
deselect=(); for f in "${SLOW[@]}"; do deselect+=(--ignore "$f"); done
# every CUDA test but the benchmark children (tests/test_examples.py names the CUDA
# example by its file only, so it is picked with -k engine_runner in the second part)
VMM_CORE_REQUIRE=cuda timeout "$FAST_TIMEOUT" python3 -m pytest tests -k cuda "${deselect[@]}" \
    -v -p no:warnings -p no:cacheprovider -rfE --durations=10 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?
[ "$tests_rc" = 124 ] && echo "GPU suite, first part: stopped by its ${FAST_TIMEOUT} s timeout" \
    | tee -a "$OUT/gpu_tests.log"
slow_left=$((TEST_DEADLINE - SECONDS))
if [ "$slow_left" -lt 60 ]; then
    echo "GPU suite, benchmark-child tests: not started, ${slow_left} s left; run them with" \
         "VMM_CORE_REQUIRE=cuda python3 -m pytest ${SLOW[*]} -k 'cuda or engine_runner'" \
        | tee "$OUT/gpu_tests_slow.log"
    tests_rc=1
else
    VMM_CORE_REQUIRE=cuda timeout "$slow_left" python3 -m pytest "${SLOW[@]}" \
        -k "cuda or engine_runner" -v -p no:warnings -p no:cacheprovider -rfE --durations=10 \
        2>&1 | tee "$OUT/gpu_tests_slow.log"
    slow_rc=$?
    [ "$slow_rc" = 124 ] && echo "GPU suite, benchmark-child tests: stopped by the" \
        "${slow_left} s left" | tee -a "$OUT/gpu_tests_slow.log"
    [ "$slow_rc" = 0 ] || tests_rc=$slow_rc
fi
left=$((DEADLINE - SECONDS))
if [ "${SKIP_BENCH:-0}" = 1 ]; then
    echo "bench: skipped (SKIP_BENCH=1)"
elif [ "$left" -lt 90 ]; then
    echo "bench: skipped, ${left} s left of DEADLINE=${DEADLINE}; run it on its" \
         "own: python3 -m vmm_core.cli bench --json \$OUT/bench.json" | tee "$OUT/bench.log"
else
    echo "bench: up to ${left} s"
    timeout "$left" python3 -m vmm_core.cli bench --json "$OUT/bench.json" \
        --plot "$OUT/bench.png" "$@" 2>&1 | tee "$OUT/bench.log"
    echo "bench: exit ${PIPESTATUS[0]} after $((SECONDS)) s of the script" | tee -a "$OUT/bench.log"
fi
exit $tests_rc
