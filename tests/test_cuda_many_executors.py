"""Many GraphExecutors made, captured and closed one after another in one process.

Skipped without CUDA; fails instead under VMM_CORE_REQUIRE=cuda.  Each executor
captures vLLM's 51 decode sizes of a 4-layer bf16 MLP (hidden 1024), checks one batch
against eager, and is closed before the next is made, as a process that rebuilds its
engine does.  The child runs with faulthandler on, so a crash prints where it was.

Every key of a GraphPool is a framework pool of its own, so such a process makes
hundreds of them; once torch's pool ids passed 256 its memory snapshot (which the escape
guard reads at every capture's end) freed the ints of the ids it was handed, and on one
H200 (torch 2.11.0+cu130) the sixth executor died of a segmentation fault.  The snapshot
is now handed ints of its own (``vmm_backends.cuda.pool_snapshot``).
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


def test_seven_executors_of_51_sizes_made_and_closed_in_turn(cuda):
    result = subprocess.run([sys.executable, "-c",
                             textwrap.dedent(CHILD).replace("EXECUTORS", "7")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), \
        result.stdout[-2000:] + result.stderr[-4000:]
