#!/usr/bin/env bash
# The torch_memory_saver API's GPU checks and numbers, one GPU (two for the multi-device
# tests, which skip with one).
#   STEP=tests  (about 3 minutes, estimated): the GPU tests of the whole-process mode, a
#               caller's pool named mid-capture, NCCL graph registration, the current
#               device, the margin, disk backups, and the integrations' sleep rows
#   STEP=bench  (about 5 minutes, estimated): the sleep rows at 4 GiB (tms-compat at
#               torch_memory_saver's defaults, retained, to disk, beside
#               torch_memory_saver's own rows) and --scenario train-offload (a training
#               step with the whole process routed, against plain and torch_memory_saver)
# Usage: STEP=tests|bench bash scripts/device_tms.sh [TMS_WHEEL]
#   TMS_WHEEL: torch_memory_saver's released wheel (pip download torch_memory_saver==0.0.10
#   --no-deps -d DIR where there is network), for its own rows; without it they say so.
#   TMS_DISK_BACKUP_DIR: where both disk rows write (default: a new folder under TMPDIR).
# Logs and JSON in $OUT (default ./out); exits 1 when a test or a target failed.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# two GPUs run its multi-device tests: NVLink multicast stays off (on a shared host it
# can take the GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP=${STEP:-tests}
WHEEL=${1:-}
timeout 120 bash scripts/device_install.sh "$OUT/install.log" || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0), \
'GPUs:', torch.cuda.device_count())" | tee "$OUT/env_tms.log"
if [ -n "$WHEEL" ]; then
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/tms_site.XXXXXX")
    if timeout 60 python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEEL" \
            >"$OUT/tms_install.log" 2>&1; then
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "installing $WHEEL failed (see $OUT/tms_install.log)" | tee -a "$OUT/env_tms.log"
    fi
fi
rc=0
if [ "$STEP" = tests ]; then
    VMM_CORE_REQUIRE=cuda timeout 400 python3 -m pytest tests/test_cuda_tms_process.py \
        tests/test_cuda_integrations.py tests/test_cuda_sleep_bench.py -q -p no:warnings \
        -rfE 2>&1 | tee "$OUT/gpu_tests_tms.log" || rc=1
fi
if [ "$STEP" = bench ]; then
    timeout 240 python3 -m vmm_core.cli bench --sleep-only --sleep-gib 4 --sleep-rows \
        vmm,tms-compat,tms-compat-retain,torch_memory_saver,tms-compat-disk,torch_memory_saver-disk \
        --quiet --json "$OUT/sleep_tms.json" 2>&1 | tee "$OUT/sleep_tms.log" || rc=1
    timeout 210 python3 -m vmm_core.cli bench --scenario train-offload --quiet \
        --json "$OUT/train_offload.json" 2>&1 | tee "$OUT/train_offload.log" || rc=1
fi
echo "device_tms.sh STEP=$STEP: ${SECONDS} s in all" | tee -a "$OUT/env_tms.log"
exit $rc
