#!/usr/bin/env bash
# The GPU check on one GPU, in parts that each finish well inside 600 s: build, then one
# part of the CUDA suite (or the decode benchmark).  Logs go to ${OUT:-./out}.
#
#   PART=fast  bash scripts/device_check.sh   # every CUDA test but the benchmark children
#   PART=bench bash scripts/device_check.sh   # tests/test_bench_cuda.py (7 benchmark children)
#   PART=rl    bash scripts/device_check.sh   # tests/test_rl_bench.py (4) + the CUDA example
#   PART=decode bash scripts/device_check.sh [bench args]   # vmm-core bench (decode)
#
# The benchmark-child tests start a benchmark process each (30-60 s apiece on an H100):
# all eleven did not fit the time left after the rest of the suite (cut after 8 of 11 on
# 2026-11-28), so they are two parts of their own.  Each part has one timeout (PART_TIMEOUT,
# default 540 s), prints one line per test as it ends (-v: a part cut by its timeout still
# says which passed) and its slowest tests, and ends with the seconds it took, to be
# written into the table of scripts/README.md.  Commands run as `python3 -m vmm_core.cli`
# (what `vmm-core` runs), whichever bin directory pip put the console script in.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PART=${PART:-fast}
PART_TIMEOUT=${PART_TIMEOUT:-540}
case $PART in fast|bench|rl|decode) ;; *)
    echo "PART=$PART: choose fast, bench, rl or decode" >&2; exit 2 ;; esac
bash scripts/device_install.sh "$OUT/install.log" || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m vmm_core.cli info 2>&1 | tee "$OUT/info.log"
BENCH_CHILDREN=(tests/test_bench_cuda.py tests/test_rl_bench.py tests/test_examples.py)
left=$((PART_TIMEOUT - SECONDS))
run_tests() {  # log name, pytest arguments...
    local log=$1; shift
    VMM_CORE_REQUIRE=cuda timeout "$left" python3 -m pytest "$@" -v -p no:warnings \
        -p no:cacheprovider -rfE --durations=15 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "PART=$PART: stopped by its ${left} s timeout" | tee -a "$OUT/$log"
    return "$rc"
}
rc=0
case $PART in
fast)  # every CUDA test except the benchmark children (the example is picked in PART=rl)
    ignore=(); for f in "${BENCH_CHILDREN[@]}"; do ignore+=(--ignore "$f"); done
    run_tests gpu_tests.log tests -k cuda "${ignore[@]}" || rc=$? ;;
bench)
    run_tests gpu_tests_bench.log tests/test_bench_cuda.py -k cuda || rc=$? ;;
rl)  # tests/test_examples.py names the CUDA example by its file only
    run_tests gpu_tests_rl.log tests/test_rl_bench.py tests/test_examples.py \
        -k "cuda or engine_runner" || rc=$? ;;
decode)
    timeout "$left" python3 -m vmm_core.cli bench --json "$OUT/bench.json" \
        --plot "$OUT/bench.png" "$@" 2>&1 | tee "$OUT/bench.log"
    rc=${PIPESTATUS[0]} ;;
esac
echo "device_check.sh PART=$PART: exit $rc after ${SECONDS} s in all" | tee -a "$OUT/env.log"
exit "$rc"
