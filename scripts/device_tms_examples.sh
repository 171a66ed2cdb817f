#!/usr/bin/env bash
# torch_memory_saver's own test suite (its repository's test/test_examples.py, which runs
# every program of test/examples in a fresh process per hook mode), unchanged, against
# vmm_core's compatible object through the alias, then against the released package
# itself, one GPU (two for the multi-device tests, which skip with one).
#
# Inputs (nothing of torch_memory_saver is kept in this repository):
#   TMS_CHECKOUT  its repository at the commit the results name, e.g., with network:
#                   git clone https://github.com/fzyzcjy/torch_memory_saver tms-src
#                   git -C tms-src checkout 4a43c97
#   TMS_WHEEL     its released wheel (only for its own run), e.g.:
#                   pip download torch_memory_saver==0.0.10 --no-deps -d wheels
#   Carry both to a GPU machine without network.
# Usage: bash scripts/device_tms_examples.sh TMS_CHECKOUT [TMS_WHEEL]
#   ONLY=vmm_core or ONLY=torch_memory_saver runs one side; each side takes 3-5 minutes
#   on one H100 or H200 (estimated), both at most DEADLINE (570) seconds.
# Prints one line per test and side (PASSED / FAILED / SKIPPED), then per side the
# counts; logs and JUnit files in $OUT (default ./out).  Exits 1 when a test fails on
# vmm_core's side that docs/integrations.md does not list as not served.
set -o pipefail
CHECKOUT=${1:?usage: bash scripts/device_tms_examples.sh TMS_CHECKOUT [TMS_WHEEL]}
WHEEL=${2:-}
OUT=${OUT:-./out}; mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DEADLINE=${DEADLINE:-570}
ONLY=${ONLY:-}
export PYTHONUNBUFFERED=1
# two GPUs run its multi-device tests: NVLink multicast stays off (on a shared host it
# can take the GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/tms_examples.log"
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }
# the tests torch_memory_saver's own C symbols or cudaMalloc serve (docs/integrations.md)
NOT_SERVED=${NOT_SERVED:-"test_cuda_vmm_granularity"}

if [ ! -f "$CHECKOUT/test/test_examples.py" ]; then
    say "no test/test_examples.py under $CHECKOUT: check out torch_memory_saver there"
    exit 1
fi
CHECKOUT=$(cd "$CHECKOUT" && pwd)
say "torch_memory_saver checkout: $(git -C "$CHECKOUT" rev-parse --short HEAD 2>/dev/null || echo '(not a git checkout)')"
timeout 120 bash scripts/device_install.sh "$OUT/install.log" || exit 1
ALIAS=$(python3 -m vmm_core.integrations.torch_memory_saver) || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), \
'GPUs:', torch.cuda.device_count())" | tee -a "$LOG"

# run_side NAME PYTHONPATH: the suite from its test/ folder (it imports `examples`)
run_side() {
    local side=$1 path=$2 left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 60 ]; then
        say "[$side] not run: ${left} s left of DEADLINE=$DEADLINE"
        return 0
    fi
    (cd "$CHECKOUT/test" && PYTHONPATH="$path" timeout "$left" python3 -m pytest \
        test_examples.py -p no:cacheprovider -q -rA --tb=short \
        --junitxml="$OUT/tms_examples_$side.xml") >"$OUT/tms_examples_$side.log" 2>&1
    local rc=$?
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR) " "$OUT/tms_examples_$side.log" \
        | sed "s/^/[$side] /" | tee -a "$LOG"
    say "[$side] $(tail -1 "$OUT/tms_examples_$side.log")"
    return $rc
}

status=0
if [ -z "$ONLY" ] || [ "$ONLY" = vmm_core ]; then
    run_side vmm_core "$ALIAS"
    unexpected=$(grep -E "^FAILED " "$OUT/tms_examples_vmm_core.log" \
        | grep -v -E "$(echo "$NOT_SERVED" | tr ' ' '|')" || true)
    if [ -n "$unexpected" ]; then
        status=1
        say "[vmm_core] failures not listed in docs/integrations.md as not served:"
        echo "$unexpected" | sed 's/^/    /' | tee -a "$LOG"
    fi
fi

if [ -z "$ONLY" ] || [ "$ONLY" = torch_memory_saver ]; then
    if [ -z "$WHEEL" ]; then
        say "[torch_memory_saver] no wheel given: its own run skipped"
    else
        REAL=$(mktemp -d "${TMPDIR:-/tmp}/tms_real.XXXXXX")
        if timeout 60 python3 -m pip install --quiet --no-deps --no-index --target "$REAL" \
                "$WHEEL" >>"$LOG" 2>&1; then
            run_side torch_memory_saver "$REAL"
        else
            say "[torch_memory_saver] installing $WHEEL failed (see $LOG)"
        fi
        rm -rf "$REAL"
    fi
fi
say "done in $SECONDS s"
exit $status
