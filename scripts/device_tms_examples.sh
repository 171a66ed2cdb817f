#!/usr/bin/env bash
# torch_memory_saver's own example programs (its test/examples), unchanged, against
# vmm_core's compatible module through the alias, each in a fresh process; then the same
# programs against the released torch_memory_saver 0.0.10 when its wheel is in .whl/.
# Prints PASS/FAIL per program and, for a failure, why (the last lines of its output),
# then what asking a region for its live blocks costs on this device.  Logs: $OUT.
#
# Preparation, once, where the network is (both folders are git-ignored):
#   git clone https://github.com/fzyzcjy/torch_memory_saver /tmp/torch_memory_saver
#   mkdir -p .tms_examples && git -C /tmp/torch_memory_saver archive HEAD test/examples \
#       | tar x -C .tms_examples --strip-components=2
#   pip download torch_memory_saver==0.0.10 --no-deps -d .whl    # optional: the real one
# Usage: bash scripts/device_tms_examples.sh    (about 4 minutes on one GPU)
#
# What each program needs, as torch_memory_saver's test_examples.py runs it: the
# TMS_INIT_* variables make every cudaMalloc of the process go through its LD_PRELOAD hook,
# which vmm_core does not have (it routes only what region() and cuda_graph() allocate), so
# those programs are expected to fail here with vmm_core's error saying so; cpu_backup
# asserts torch_memory_saver's default retain_cpu_backup=False (TMS_RETAIN_CPU_BACKUP=0
# gives it) and then reads torch_memory_saver's private _impl.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-570}
EXAMPLES=${EXAMPLES:-.tms_examples}
LOG="$OUT/tms_examples.log"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

if [ ! -f "$EXAMPLES/simple.py" ]; then
    say "no torch_memory_saver examples in $EXAMPLES: prepare them as this script's header says"
    exit 1
fi
timeout 120 bash scripts/device_install.sh "$OUT/install.log" || exit 1
ALIAS=$(python3 -m vmm_core.integrations.torch_memory_saver) || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    | tee -a "$LOG"

# program, extra environment (as torch_memory_saver's tests set it), why it may fail here
PROGRAMS=(
    "simple||"
    "cuda_graph||"
    "rl_example||"
    "cpu_backup|TMS_RETAIN_CPU_BACKUP=0|reads torch_memory_saver's private _impl at its end"
    "training_engine|TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1|TMS_INIT_ENABLE: every cudaMalloc hooked"
    "nested_region|TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1|TMS_INIT_ENABLE, and its _impl._binary_wrapper"
    "cuda_vmm_granularity|TMS_INIT_ENABLE=1|calls cudaMalloc and the tms_pause C symbol directly"
)

# run_set NAME PYTHONPATH PRELOAD
run_set() {
    local set=$1 path=$2 preload=$3 passed=0 failed=0
    for entry in "${PROGRAMS[@]}"; do
        IFS='|' read -r name env why <<<"$entry"
        local left=$((DEADLINE - SECONDS))
        if [ "$left" -lt 30 ]; then
            say "[$set] $name: not run, ${left} s left of DEADLINE=$DEADLINE"
            continue
        fi
        local limit=$((left < 150 ? left : 150)) out="$OUT/tms_${set}_${name}.log"
        local t0=$SECONDS
        # shellcheck disable=SC2086  # env holds NAME=VALUE words
        env $env PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" LD_PRELOAD="$preload" \
            timeout "$limit" python3 "$EXAMPLES/$name.py" preload >"$out" 2>&1
        local rc=$?
        if [ "$rc" = 0 ]; then
            passed=$((passed + 1)); say "[$set] $name: PASS ($((SECONDS - t0)) s)"
        else
            failed=$((failed + 1))
            say "[$set] $name: FAIL rc=$rc ($((SECONDS - t0)) s)${why:+; expected: $why}"
            grep -E "Error|error|assert|Exception" "$out" | tail -3 | sed 's/^/    /' | tee -a "$LOG"
        fi
    done
    say "[$set] $passed passed, $failed failed"
}

run_set vmm_core "$ALIAS" ""

WHEEL=$(ls .whl/torch_memory_saver-0.0.10-*.whl 2>/dev/null | head -1)
if [ -z "$WHEEL" ]; then
    say "[torch_memory_saver] no .whl/torch_memory_saver-0.0.10-*.whl: its own run skipped"
else
    REAL=$(mktemp -d /tmp/tms_real.XXXXXX)
    if timeout 60 python3 -m pip install --quiet --no-deps --no-index --target "$REAL" \
            "$WHEEL" >>"$LOG" 2>&1; then
        PRELOAD=$(PYTHONPATH="$REAL" python3 -c "from torch_memory_saver.utils import \
get_binary_path_from_package as g; print(g('torch_memory_saver_hook_mode_preload'))") \
            && run_set torch_memory_saver "$REAL" "$PRELOAD" \
            || say "[torch_memory_saver] its preload library was not found"
    else
        say "[torch_memory_saver] installing $WHEEL failed (see $LOG)"
    fi
fi

left=$((DEADLINE - SECONDS))
if [ "$left" -gt 40 ]; then
    timeout 40 python3 scripts/live_blocks_cost.py --backend cuda --tensors 2000 2>&1 | tee -a "$LOG"
    timeout 30 python3 scripts/live_blocks_cost.py --backend cuda --tensors 200 2>&1 | tee -a "$LOG"
fi
say "done in $SECONDS s"
