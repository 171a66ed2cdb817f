#!/usr/bin/env bash
# Multi-GPU memory on the device machine, in one command (needs 2 GPUs): the GPU tests of
# vmm_core.distributed with VMM_CORE_REQUIRE=cuda,cuda-2gpu (mapped kinds, and gather/scatter
# of every kind over NCCL, the distributed kind included), then the torchrun benchmark, whose
# output ends with the gather/scatter table (4 KiB and 256 B rows: continuous direct and
# mt.gather, distributed mt.gather and mt.scatter, all_to_all_single of the same bytes).
# Run after `bash scripts/device_install.sh` (an offline editable install).
# Logs and results go to ${OUT:-./out}.  NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST
# and NVSHMEM_DISABLE_NVLS are passed through untouched (multicast stays off).
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "[$(date +%H:%M:%S)] $*"; }

step "devices"
{ nvidia-smi --query-gpu=index,name,memory.total --format=csv; nvidia-smi topo -m; } \
    >"$OUT/devices.log" 2>&1; cat "$OUT/devices.log"
env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' \
    | tee "$OUT/env.log"
timeout 60 vmm-core info 2>&1 | tee "$OUT/info.log"

step "GPU tests: two ranks with NCCL (test_cuda_distributed) + one-GPU sharing contract"
VMM_CORE_REQUIRE=cuda,cuda-2gpu timeout 420 python3 -m pytest tests/test_cuda_distributed.py \
    tests/test_contract.py -k cuda -q -p no:warnings -rfE 2>&1 | tee "$OUT/dist_tests.log"
tests_rc=$?

step "benchmark: torchrun --nproc-per-node 2 vmm-core bench --distributed"
timeout 420 torchrun --standalone --nproc-per-node 2 -m vmm_core.cli bench --distributed \
    --json "$OUT/dist_bench.json" --plot "$OUT/dist_bench.png" 2>&1 | tee "$OUT/dist_bench.log"
bench_rc=$?

step "done: tests rc=$tests_rc, bench rc=$bench_rc (logs in $OUT)"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
