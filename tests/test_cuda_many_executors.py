"""Many GraphExecutors made, captured and closed one after another in one process.

Skipped without CUDA; fails instead under VMM_CORE_REQUIRE=cuda.  Each executor
captures vLLM's 51 decode sizes of a 4-layer bf16 MLP (hidden 1024), checks one batch
against eager, and is closed before the next is made, as a process that rebuilds its
engine does.  The child runs with faulthandler on, so a crash prints where it was.

Known defect, measured on one H200 (torch 2.11.0+cu130, 2026-11-29): the process
crashes with a segmentation fault while the sixth such executor captures, whether the
executors are closed or kept, whether the pool or torch owns the executables, and with
8 GiB instead of the device's memory reserved per space.  Executors of 1 or 10 sizes
(20 and 12 of them) do not crash.  Where the fault comes from is not yet known: the
faulting Python lines differ (a driver call, pure integer arithmetic, ``MemPool.id``),
which points at memory corrupted earlier.  The test is a strict expected failure: once
the defect is fixed it passes, and the marker must go.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu]

CHILD = """
import faulthandler
import torch
import vmm_core

faulthandler.enable()
gen = torch.Generator(device="cuda").manual_seed(0)
weights = [(torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02,
            torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02)
           for _ in range(4)]

def mlp(x):
    for up, down in weights:
        x = x + torch.nn.functional.silu(x @ up) @ down
    return x

sizes = [1, 2, 4] + list(range(8, 249, 8)) + list(range(256, 513, 16))
x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
for n in range(EXECUTORS):
    ex = vmm_core.GraphExecutor(mlp, [x], buckets=sizes)
    with torch.no_grad():
        mlp(x)
        ex.pool.warmup(lambda: mlp(x))
        for b in sizes:
            ex.capture_all([b])
        got, want = ex(x[:100]).float(), mlp(x[:100]).float()
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item(), n
    ex.close()
    del ex
    print("closed", n + 1, flush=True)
print("ok")
"""


@pytest.mark.xfail(strict=True, reason="segmentation fault in the sixth executor of 51 "
                   "sizes made in one process (H200, torch 2.11.0+cu130); cause not known")
def test_seven_executors_of_51_sizes_made_and_closed_in_turn(cuda):
    result = subprocess.run([sys.executable, "-c",
                             textwrap.dedent(CHILD).replace("EXECUTORS", "7")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), \
        result.stdout[-2000:] + result.stderr[-4000:]
