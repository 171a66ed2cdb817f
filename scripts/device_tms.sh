#!/usr/bin/env bash
# torch_memory_saver served by vmm_core, checked on one GPU in one command that keeps to
# DEADLINE (default 420 s): the install, then, in this order
#
#   suite   torch_memory_saver's own test/test_examples.py (every program of its
#           test/examples in a fresh process per hook mode), unchanged, with
#           `import torch_memory_saver` resolving to vmm_core's (the alias directory first
#           on PYTHONPATH); SIDES="vmm_core torch_memory_saver" also runs it against the
#           released package
#   train   vmm-core bench --scenario train-offload: a training step with the whole
#           process routed into tagged memory (TMS_INIT_ENABLE, started as RL launchers
#           start their training processes) against the same step without it and against
#           torch_memory_saver's preload mode, and pause/resume of the whole process
#   sleep   vmm-core bench --sleep-only --sleep-gib 4: tms-compat (torch_memory_saver's
#           defaults), tms-compat-retain (retain_cpu_backup) and tms-compat-disk, beside
#           torch_memory_saver's own CPU backups and disk backup of the same bytes, and
#           their targets
#
# Inputs, made where there is network (nothing of torch_memory_saver is committed here,
# and the GPU machine needs no network), each the first argument given, else its
# variable, else a git-ignored folder of this checkout:
#   TMS_CHECKOUT  its repository's tree at the commit the results name (the suite needs
#                 its test/ folder), default .tms:
#                   git clone https://github.com/fzyzcjy/torch_memory_saver .tms
#                   git -C .tms checkout 4a43c97
#   TMS_WHEEL     its released wheel (Python 3.12 on the GPU machine), default the one
#                 .whl/torch_memory_saver-0.0.10-*.whl:
#                   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#                       --platform manylinux2014_x86_64 torch_memory_saver==0.0.10 -d .whl
#                 (torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl)
#
#   bash scripts/device_tms.sh                                  # all (about 7 min, est.)
#   bash scripts/device_tms.sh TMS_CHECKOUT TMS_WHEEL           # inputs elsewhere
#   STEP=sleep bash scripts/device_tms.sh                       # some steps
#
# A step starts only while MIN_START (45) s of DEADLINE are left and runs at most its own
# cap or what is left; a step not started says so, with its command.  The suite prints
# one line per test as it ends (a suite cut by its timeout still says which passed).
# Logs and JSON go to ${OUT:-./out}; the last line gives each step's seconds and exit
# code.  Exits 1 when a step failed: a test of the suite failed on vmm_core's side that
# docs/integrations.md does not list as passing only vacuously (NOT_SERVED), or a target
# was not met.  Two GPUs also run the suite's multi-device tests (they skip with one).
set -o pipefail
CHECKOUT=${1:-${TMS_CHECKOUT:-.tms}}
WHEEL=${2:-${TMS_WHEEL:-$(compgen -G ".whl/torch_memory_saver-0.0.10-*.whl" | head -n 1)}}
OUT=${OUT:-./out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
# with two GPUs the suite's multi-device tests run: NVLink multicast stays off (on a
# shared host it can take the GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP=${STEP:-suite train sleep}
SIDES=${SIDES:-vmm_core}
DEADLINE=${DEADLINE:-420}
MIN_START=${MIN_START:-45}
SLEEP_GIB=${SLEEP_GIB:-4}
# SUITE_K: a pytest -k expression choosing some of the suite's tests (default: all)
SUITE_K=${SUITE_K:-}
# the suite's tests docs/integrations.md names as passing only vacuously, and why: it
# calls torch_memory_saver's C symbols and the CUDA runtime's cudaMalloc through the
# process's global symbols
NOT_SERVED=${NOT_SERVED:-"test_cuda_vmm_granularity"}
for s in $STEP; do case $s in suite|sleep|train) ;; *)
    echo "STEP=$s: choose from suite train sleep" >&2; exit 2 ;; esac; done
# say, wanted and step (at most its cap or what is left of DEADLINE)
. scripts/deadline_steps.sh

if wanted suite && [ ! -f "$CHECKOUT/test/test_examples.py" ]; then
    echo "no test/test_examples.py under '$CHECKOUT': give torch_memory_saver's checkout" \
        "(usage: bash scripts/device_tms.sh TMS_CHECKOUT TMS_WHEEL; default .tms)" >&2
    exit 2
fi
say "install"
timeout 120 bash scripts/device_install.sh "$OUT/install.log" || exit 1
ALIAS=$(timeout 60 python3 -m vmm_core.integrations.torch_memory_saver) || exit 1
timeout 60 python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(0), 'GPUs:', torch.cuda.device_count())" 2>&1 | tee "$OUT/env_tms.log"
# the released package, beside (never instead of) vmm_core: its own rows and suite side
SITE=""
if [ -n "$WHEEL" ]; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/tms_site.XXXXXX")
    if ! timeout 60 python3 -m pip install -q --no-index --no-deps --target "$SITE" \
            "$WHEEL" >"$OUT/tms_install.log" 2>&1; then
        say "installing $WHEEL failed (see tms_install.log): torch_memory_saver's own rows" \
            "say they were not run" | tee -a "$OUT/env_tms.log"
        SITE=""
    fi
else
    say "no TMS_WHEEL given and none in .whl/: torch_memory_saver's own rows say they" \
        "were not run" \
        | tee -a "$OUT/env_tms.log"
fi
if [ -n "$CHECKOUT" ]; then
    CHECKOUT=$(cd "$CHECKOUT" && pwd)
    say "torch_memory_saver checkout: $(git -C "$CHECKOUT" rev-parse --short HEAD 2>/dev/null \
        || echo '(not a git checkout)'); wheel: ${WHEEL:-none}" | tee -a "$OUT/env_tms.log"
fi

if wanted suite; then
    for side in $SIDES; do
        case $side in
        vmm_core) path=$ALIAS ;;
        torch_memory_saver) path=$SITE
            if [ -z "$path" ]; then say "suite[$side]: no wheel installed, not run"; continue; fi ;;
        *) say "SIDES: $side is neither vmm_core nor torch_memory_saver"; failed=1; continue ;;
        esac
        # one process per test and hook mode (19 on one GPU, 11 skipped: XPU, two GPUs),
        # each a fresh interpreter that starts CUDA, some with pauses of 1 s to watch:
        # about 3 minutes (estimated)
        # from its test/ folder (it imports `examples`); -v: one line per test as it ends
        before=$failed
        step "suite[$side]" 200 "tms_suite_$side.log" env -C "$CHECKOUT/test" \
            PYTHONPATH="$path" python3 -m pytest test_examples.py ${SUITE_K:+-k "$SUITE_K"} \
            -p no:cacheprovider -v \
            -rfE --tb=short --junitxml="$OUT/tms_suite_$side.xml"
        if [ "$side" = vmm_core ] && [ "$last_rc" = 1 ]; then
            # pytest's 1: some test failed; only those not listed in NOT_SERVED count
            unexpected=$(grep -E "::test_\S+ (FAILED|ERROR)" "$OUT/tms_suite_$side.log" \
                | grep -v -E "::($(echo "$NOT_SERVED" | tr ' ' '|'))(\[| )" || true)
            if [ -n "$unexpected" ]; then
                say "suite[vmm_core]: failures docs/integrations.md does not list as passing only vacuously:"
                echo "$unexpected" | sed 's/^/    /'
            else
                failed=$before
            fi
        fi
        say "suite[$side]: $(grep -cE "::test_\S+ PASSED" "$OUT/tms_suite_$side.log") passed," \
            "$(grep -cE "::test_\S+ (FAILED|ERROR)" "$OUT/tms_suite_$side.log") failed," \
            "$(grep -cE "::test_\S+ SKIPPED" "$OUT/tms_suite_$side.log") skipped"
    done
fi

# the benchmarks import the released package beside vmm_core for its own rows
BENCH_PATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
# both disk rows write to one directory on a disk (not tmpfs, where files are host
# memory), removed after
DISK_DIR=${TMS_DISK_BACKUP_DIR:-$(mktemp -d "${TMPDIR:-/var/tmp}/tms_disk.XXXXXX")}
if wanted train; then
    # three fresh processes (plain, vmm, torch_memory_saver), 3 + 20 steps and two pauses
    # each: about 90 s (estimated)
    step train 100 train_offload.log env PYTHONPATH="$BENCH_PATH" python3 -m vmm_core.cli bench \
        --scenario train-offload --quiet --json "$OUT/train_offload.json"
fi
if wanted sleep; then
    # the pinned limit, then 4 GiB through each row (3 rounds, 2 for torch_memory_saver's
    # and the disk rows), one process: 1.5 to 2 minutes (estimated; the disk rows depend
    # on the disk).  Last, as it answers no question of the API: where the suite and the
    # training step leave it too little, the last line says so and STEP=sleep runs it
    step sleep 120 sleep_tms.log env PYTHONPATH="$BENCH_PATH" TMS_DISK_BACKUP_DIR="$DISK_DIR" \
        python3 -m vmm_core.cli bench --sleep-only --sleep-gib "$SLEEP_GIB" --sleep-rows \
        tms-compat,tms-compat-retain,torch_memory_saver,tms-compat-disk,torch_memory_saver-disk \
        --quiet --json "$OUT/sleep_tms.json"
fi
[ -z "${TMS_DISK_BACKUP_DIR:-}" ] && rm -rf "$DISK_DIR"
[ -n "$SITE" ] && rm -rf "$SITE"
say "device_tms.sh done in ${SECONDS} s:$summary" | tee -a "$OUT/env_tms.log"
exit $failed
