#!/usr/bin/env bash
# Issue 14 on the device machine, one command: every engine-runner scenario on the
# Llama-3-8B shape (random init, bf16), each part's JSON, PNG and log into ${OUT:-./out}.
#
#   bash scripts/device_issue14.sh                 # all parts below, in order
#   PARTS="piecewise ondemand" bash scripts/device_issue14.sh
#   LAYERS=8 SIZES=1,2,4,8,16,32,64 bash scripts/device_issue14.sh   # shorter
#
# Parts: piecewise (vmm, vllm in ascending and random order; keep, vmm-keep ascending),
# ondemand (sglang, vmm-keep, vllm, vmm), whole (sglang and vmm-keep, descending and
# ascending), record-stream (16 layers x 64 MiB, flag off/on, torch and GraphPool),
# exec-cache (all executables vs an LRU budget), families (vmm, vllm; random order).
# Each part runs under its own timeout (PART_TIMEOUT seconds, default 170) so one slow part
# cannot take the others' time.  The durations are NOT measured yet: the first run's
# part logs say how long each took; split PARTS over several calls if they do not fit.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LAYERS=${LAYERS:-32}
SIZES=${SIZES:-}
PARTS=${PARTS:-"piecewise ondemand whole record-stream exec-cache families"}
PART_TIMEOUT=${PART_TIMEOUT:-170}
bash scripts/device_install.sh "$OUT/install.log" || exit 1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/versions.log"
common=(--backend cuda --model llama8b --layers "$LAYERS" --quiet)
[ -n "$SIZES" ] && common+=(--sizes "$SIZES")
rc=0
run() {  # run NAME ARGS...: one vmm-core bench call, its JSON, PNG and log
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: vmm-core bench ${common[*]} $*" | tee "$OUT/$name.log"
    timeout "$PART_TIMEOUT" vmm-core bench "${common[@]}" "$@" --json "$OUT/$name.json" \
        --plot "$OUT/$name.png" 2>&1 | tee -a "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    echo "== $name: exit $status after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
    [ "$status" = 0 ] || rc=1
}
for part in $PARTS; do
    case $part in
        piecewise)
            run piecewise --scenario piecewise --strategies vmm,vllm --orders ascending,random
            run piecewise-keep --scenario piecewise --strategies keep,vmm-keep \
                --orders ascending ;;
        ondemand) run ondemand --scenario ondemand --strategies sglang,vmm-keep,vllm,vmm ;;
        whole) run whole --scenario whole --strategies sglang,vmm-keep \
                   --orders descending,ascending ;;
        record-stream)  # its own shape: --layers is the number of 64 MiB temporaries
            common_saved=("${common[@]}")
            common=(--backend cuda --quiet --layers 16 --sizes 64)
            run record-stream --scenario record-stream
            common=("${common_saved[@]}") ;;
        exec-cache) run exec-cache --scenario exec-cache ;;
        families) run families --scenario families --strategies vmm,vllm --orders random ;;
        *) echo "unknown part $part" >&2; rc=2 ;;
    esac
done
exit $rc
