#!/usr/bin/env bash
# Multi-GPU memory on the GPU machine, in one command (needs 2 GPUs of one host): the
# offline install, the facts the run depends on (torch, NCCL, peer
# access, POSIX-fd handles), the GPU tests of vmm_core.distributed with
# VMM_CORE_REQUIRE=cuda,cuda-2gpu (mapped kinds, and gather/scatter of every kind over NCCL,
# the distributed kind included), then the two-rank benchmark, whose output ends with the
# gather/scatter table (4 KiB and 256 B rows: continuous direct and mt.gather, distributed
# mt.gather and mt.scatter, all_to_all_single of the same bytes).
#
#   bash scripts/device_distributed.sh              # everything (about 4 min)
#   STEP=tests bash scripts/device_distributed.sh   # install, facts, GPU tests
#   STEP=bench bash scripts/device_distributed.sh   # install, facts, benchmark
#
# Every step has its own timeout and together they stay under ten minutes, so a hang in
# one step cannot lose the logs of the others.  Logs and results go to ${OUT:-./out}.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off (on a shared host it can take the GPUs out of service): set
# here, not only inherited, so the ranks torchrun and the tests start get it whatever the
# caller's environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP=${STEP:-all}
case $STEP in all|tests|bench) ;; *) echo "STEP=$STEP: choose all, tests or bench" >&2; exit 2 ;; esac
step() { echo "[$(date +%H:%M:%S)] $*"; }

step "install"
timeout 120 bash scripts/device_install.sh "$OUT/install.log" || exit 1

step "facts"
env | grep -E '^(NCCL_|TORCH_NCCL_|TORCH_SYMM_MEM_|NVSHMEM_)' | sort | tee "$OUT/env.log"
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m; } \
    >"$OUT/devices.log" 2>&1; cat "$OUT/devices.log"
timeout 45 python3 - <<'PY' 2>&1 | tee "$OUT/facts.log"
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
from cuda.bindings import driver

driver.cuInit(0)
attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
print("POSIX-fd handles", [driver.cuDeviceGetAttribute(attr, driver.cuDeviceGet(i)[1])[1]
                           for i in range(n)])
PY
timeout 30 python3 -m vmm_core.cli info 2>&1 | tee "$OUT/info.log"

tests_rc=0
if [ "$STEP" = all ] || [ "$STEP" = tests ]; then
    step "GPU tests: two ranks with NCCL (test_cuda_distributed) + one-GPU sharing contract"
    VMM_CORE_REQUIRE=cuda,cuda-2gpu timeout 240 python3 -m pytest \
        tests/test_cuda_distributed.py tests/test_contract.py -k cuda -q -p no:warnings -rfE \
        2>&1 | tee "$OUT/dist_tests.log"
    tests_rc=$?
fi

bench_rc=0
if [ "$STEP" = all ] || [ "$STEP" = bench ]; then
    step "benchmark: torch.distributed.run --nproc-per-node 2 vmm_core.cli bench --distributed"
    timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        -m vmm_core.cli bench --distributed --json "$OUT/dist_bench.json" \
        --plot "$OUT/dist_bench.png" 2>&1 | tee "$OUT/dist_bench.log"
    bench_rc=$?
fi

step "done: tests rc=$tests_rc, bench rc=$bench_rc (logs in $OUT; 124 = timed out)"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
