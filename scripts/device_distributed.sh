#!/usr/bin/env bash
# Two GPUs of one host, in one command that keeps to DEADLINE (default 540 s): the
# install, the device facts, then, most telling first:
#
#   probe   scripts/probe_group_copy.py under torchrun: a fresh group's first collective
#           (time, device memory), every rank's copy rate alone and all at once into
#           pinned, registered-mmap, near- and far-node memory, where a real round 1's
#           kept copy landed, and communicator suspend (bytes freed, cost) where it exists
#   sleep   vmm-core bench --sleep-only --sleep-gib $SLEEP_GIB (4) under torchrun: every
#           rank alone, all at once without a group, the group sleep with its phases, a
#           cold communicator; each rank's pinned limit; the three targets
#   rl      vmm-core bench --scenario rl on the 16-layer Llama-3-8B shape: vmm on one GPU
#           (the round-1 reference), then under torchrun (per-rank phase table, targets),
#           then python -m vmm_bench.group_report compares round 1
#   tests   VMM_CORE_REQUIRE=cuda,cuda-2gpu: tests/test_cuda_distributed.py and the
#           one-GPU sharing contract
#   gather  vmm-core bench --distributed: mapped-tensor setup, remote gather against the
#           peer copy, every kind's gather/scatter against all_to_all_single
#
#   bash scripts/device_distributed.sh                  # all of it (about 7-8 min, est.)
#   STEP="sleep rl" bash scripts/device_distributed.sh  # some steps
#
# A step starts only while MIN_START (60) s of DEADLINE are left, and runs at most its own
# cap or what is left; a step not started says so on its line, with its command.  Logs and
# JSON go to ${OUT:-./out}; the last line gives each step's seconds and exit code.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (on a shared host it can take the GPUs out of service): set
# here, not only inherited, so the ranks torchrun and the tests start get it whatever the
# caller's environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP=${STEP:-probe sleep rl tests gather}
DEADLINE=${DEADLINE:-540}
MIN_START=${MIN_START:-60}
SLEEP_GIB=${SLEEP_GIB:-4}
RL_ARGS=${RL_ARGS:---model llama8b --layers 16 --steps 4}
for s in $STEP; do case $s in probe|sleep|rl|tests|gather) ;; *)
    echo "STEP=$s: choose from probe sleep rl tests gather" >&2; exit 2 ;; esac; done
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
# say, wanted and step (at most its cap or what is left of DEADLINE)
. scripts/deadline_steps.sh

say "install"
timeout 120 bash scripts/device_install.sh "$OUT/install.log" || exit 1

say "facts"
env | grep -E '^(NCCL_|TORCH_NCCL_|TORCH_SYMM_MEM_|NVSHMEM_)' | sort | tee "$OUT/env.log"
{ nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv; nvidia-smi topo -m; } \
    >"$OUT/devices.log" 2>&1; cat "$OUT/devices.log"
timeout 45 python3 - <<'PY' 2>&1 | tee "$OUT/facts.log"
import glob
import os

import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())
n = torch.cuda.device_count()
print("devices", n, [torch.cuda.get_device_name(i) for i in range(n)])
if n >= 2:
    print("peer access 0->1", torch.cuda.can_device_access_peer(0, 1),
          "1->0", torch.cuda.can_device_access_peer(1, 0))
for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"):
    print(name, os.environ.get(name, "(unset: torch's default)"))
print("host NUMA nodes", sorted(glob.glob("/sys/devices/system/node/node[0-9]*")), "CPUs",
      os.cpu_count())
from cuda.bindings import driver

driver.cuInit(0)
attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
print("POSIX-fd handles", [driver.cuDeviceGetAttribute(attr, driver.cuDeviceGet(i)[1])[1]
                           for i in range(n)])
PY
timeout 30 python3 -m vmm_core.cli info >"$OUT/info.log" 2>&1

wanted probe && step probe 90 probe.log $RUN scripts/probe_group_copy.py
wanted sleep && step sleep 120 group_sleep.log $RUN -m vmm_core.cli bench --sleep-only \
    --sleep-gib "$SLEEP_GIB" --quiet --json "$OUT/group_sleep.json"
if wanted rl; then
    # shellcheck disable=SC2086  # RL_ARGS is a list of flags
    step rl-one-gpu 150 rl_one_gpu.log python3 -m vmm_core.cli bench --scenario rl \
        --strategies vmm $RL_ARGS --quiet --json "$OUT/rl_one_gpu.json"
    # shellcheck disable=SC2086
    step rl-group 180 rl_group.log $RUN -m vmm_core.cli bench --scenario rl $RL_ARGS \
        --quiet --json "$OUT/rl_group.json"
    if [ -f "$OUT/rl_one_gpu.json" ] && [ -f "$OUT/rl_group.json" ]; then
        timeout 30 python3 -m vmm_bench.group_report --one-gpu "$OUT/rl_one_gpu.json" \
            --group "$OUT/rl_group.json" 2>&1 | tee "$OUT/rl_round1.log"
    fi
fi
wanted tests && step tests 220 dist_tests.log env VMM_CORE_REQUIRE=cuda,cuda-2gpu \
    python3 -m pytest tests/test_cuda_distributed.py tests/test_contract.py -k cuda -v \
    -p no:warnings -p no:cacheprovider -rfE --durations=10
wanted gather && step gather 150 dist_bench.log $RUN -m vmm_core.cli bench --distributed \
    --json "$OUT/dist_bench.json" --plot "$OUT/dist_bench.png"

say "done in ${SECONDS} s (logs in $OUT; step=exit:seconds, 124 = timed out):$summary" \
    | tee -a "$OUT/env.log"
exit "$failed"
