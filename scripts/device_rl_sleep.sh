#!/usr/bin/env bash
# The RL step and sleep/wake on one GPU: the offload and RL GPU tests, the RL step
# benchmark and the sleep benchmark, logs and JSON in ${OUT:-./out}.  Together they can
# take longer than 10 minutes: run them as STEP=tests, STEP=rl and STEP=sleep (default:
# all).  STEP=group (two GPUs of one host): the vmm loop under torchrun with group
# sleep/wake, reporting the slowest rank.  STEP=integrations (one GPU, about 5 minutes):
# the engine integrations' targets, the RL step on the 16-layer Llama-3-8B shape (vmm,
# vLLM's way, tms-compat, vllm-plugin, and torch_memory_saver when its wheel is in .whl/)
# and the sleep rows that judge them at 4 GiB.
# Usage: bash scripts/device_rl_sleep.sh [extra args for the rl bench, e.g. --model llama8b]
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEP=${STEP:-all}
bash scripts/device_install.sh "$OUT/install.log" || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" \
    | tee "$OUT/env.log"
rc=0
if [ "$STEP" = all ] || [ "$STEP" = tests ]; then
    # a device fact first (seconds): may a thread page-lock host memory while another
    # captures a graph in global mode?  (not a test; the CUDA hooks use relaxed mode, and
    # test_cuda_sleep.py checks that a registration beside a capture breaks neither)
    timeout 60 python3 scripts/probe_capture_pinning.py 2>&1 | tee "$OUT/probe_pinning.log"
    VMM_CORE_REQUIRE=cuda timeout 300 python3 -m pytest tests/test_cuda_sleep.py \
        tests/test_rl_bench.py tests/test_cuda_sleep_bench.py tests/test_contract.py \
        -k "cuda" -q -p no:warnings -rfE \
        2>&1 | tee "$OUT/gpu_tests_rl_sleep.log" || rc=1
fi
if [ "$STEP" = all ] || [ "$STEP" = rl ]; then
    # vLLM's 51 decode sizes; 5 steps per strategy, each strategy in its own process
    timeout 420 python3 -m vmm_core.cli bench --scenario rl --steps "${STEPS:-5}" --quiet \
        --json "$OUT/rl.json" --plot "$OUT/rl.png" "$@" 2>&1 | tee "$OUT/rl.log" || rc=1
fi
if [ "$STEP" = all ] || [ "$STEP" = sleep ]; then
    timeout 300 python3 -m vmm_core.cli bench --sleep-only --sleep-gib "${SLEEP_GIB:-4}" --quiet \
        --json "$OUT/sleep.json" 2>&1 | tee "$OUT/sleep.log" || rc=1
fi
if [ "$STEP" = integrations ]; then
    # torch_memory_saver's released wheel, when it is in .whl/ (git-ignored): its rows
    # beside ours; a strategy or row whose package is missing says so and is skipped
    WHEEL=$(ls .whl/torch_memory_saver-*.whl 2>/dev/null | head -1)
    if [ -n "$WHEEL" ] && timeout 60 python3 -m pip install -q --no-index --no-deps \
            --target /tmp/tms_site "$WHEEL" >"$OUT/tms_install.log" 2>&1; then
        export PYTHONPATH=/tmp/tms_site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python3 -c "import torch_memory_saver as t; print('torch_memory_saver', t.__file__)" \
        2>&1 | tail -1 | tee -a "$OUT/env.log"
    # 5 strategies x 4 steps, each in its own process: about 230 s, estimated from step
    # 3 of scripts/README.md (three strategies in 120-140 s) and torch_memory_saver's
    # slower sleeps and wakes
    timeout 330 python3 -m vmm_core.cli bench --scenario rl --steps 4 --model llama8b \
        --layers 16 --strategies vmm,vllm,tms-compat,vllm-plugin,tms --quiet \
        --json "$OUT/rl_integrations.json" 2>&1 | tee "$OUT/rl_integrations.log" || rc=1
    # the rows the targets read: the pinned limit, vmm_core's own, vLLM-style, the two
    # integrations and torch_memory_saver (no grid): about 60 s
    timeout 180 python3 -m vmm_core.cli bench --sleep-only --sleep-gib 4 --sleep-rows \
        vmm,vLLM-style,tms-compat,vllm-plugin,torch_memory_saver --quiet \
        --json "$OUT/sleep_integrations.json" 2>&1 | tee "$OUT/sleep_integrations.log" || rc=1
fi
if [ "$STEP" = group ]; then
    # two GPUs: NVLink multicast stays off (on a shared host it can take the GPUs out of
    # service), set here so the ranks get it whatever the caller's environment; the
    # timeout leaves the install and the line above room within ten minutes;
    # torch.distributed.run is torchrun without relying on its console script being on
    # PATH, --standalone picks a free port
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    timeout 480 python3 -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
        -m vmm_core.cli bench --scenario rl --steps "${STEPS:-5}" --quiet \
        --json "$OUT/rl_group.json" --plot "$OUT/rl.png" "$@" 2>&1 \
        | tee "$OUT/rl_group.log" || rc=1
fi
# the elapsed time of this run, to correct the estimates in scripts/README.md
echo "device_rl_sleep.sh STEP=$STEP: ${SECONDS} s in all" | tee -a "$OUT/env.log"
exit $rc
