#!/usr/bin/env bash
# The whole GPU check in one command (for the device machine): build, GPU suite, bench.
# Logs go to ${OUT:-./out}.  Usage: bash scripts/device_check.sh [bench args...]
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
bash scripts/device_install.sh "$OUT/install.log" || exit 1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
vmm-core info 2>&1 | tee "$OUT/info.log"
VMM_CORE_REQUIRE=cuda timeout 420 python3 -m pytest tests -k cuda -q -p no:warnings -rfE \
    2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=$?
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    timeout 420 vmm-core bench --json "$OUT/bench.json" --plot "$OUT/bench.png" "$@" \
        2>&1 | tee "$OUT/bench.log"
fi
exit $tests_rc
