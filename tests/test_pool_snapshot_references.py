"""A pool's segments are read from torch's snapshot without losing a reference.

torch's ``_cuda_memorySnapshot`` releases one reference to each element of the pool-id
tuple it is handed that it never took; past the interpreter's shared small ints that
frees a pool id's int while a tuple still holds it.  The CPU tests hand
``pool_segments`` snapshot functions that take a reference the same way (and ones that
do not) and check that every part keeps exactly the references it had; the GPU test
reads the segments of 400 real pools, ids past 256 included, in a child process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vmm_backends.cuda.pool_snapshot import pool_segments

STAND_IN = """
import ctypes, sys
import torch
from vmm_backends.cuda.pool_snapshot import pool_segments

dec_ref = ctypes.pythonapi.Py_DecRef
dec_ref.argtypes = [ctypes.py_object]
dec_ref.restype = None
TAKES, TRACED, FAILS = {takes}, {traced}, {fails}
SEGMENTS = [{{"segment_pool_id": (0, 1000), "device": 0, "address": 1}},
            {{"segment_pool_id": (0, 1001), "device": 0, "address": 2}},
            {{"segment_pool_id": (0, 1000), "device": 1, "address": 3}}]
handed = []

def snapshot(mempool_id, include_traces=True):
    handed.append(tuple(type(p).__name__ for p in mempool_id))
    if TAKES:  # what torch does: release a reference it never took
        for part in mempool_id:
            dec_ref(part)
    if FAILS:
        raise RuntimeError("snapshot failed")
    return SEGMENTS

torch.cuda.memory_snapshot = snapshot if TRACED else (lambda mempool_id: snapshot(mempool_id))

class Pool:
    id = (0, 1000)

blocks = sys.getallocatedblocks()
for _ in range(20000):
    try:
        got = pool_segments(Pool(), 0)
    except RuntimeError:
        assert FAILS
    else:
        assert [s["address"] for s in got] == [1], got
    handed.clear()
grown = sys.getallocatedblocks() - blocks
print("grown", grown)
assert grown < 2000, grown  # 20000 calls leaking two ints each would be 40000
print("ok")
"""


@pytest.mark.parametrize("takes,traced,fails", [
    (True, True, False), (True, False, False), (True, True, True),
    (False, True, False), (False, False, False)])
def test_no_reference_lost_or_left_over_in_20000_reads(takes, traced, fails):
    """A snapshot that takes a reference (as torch does) or not, with or without
    ``include_traces``, and one that raises after taking it: the child survives every
    read (a reference lost frees a part still held: the process dies) and nothing piles
    up (a reference given back that was never taken leaks two ints a read)."""
    child = STAND_IN.format(takes=takes, traced=traced, fails=fails)
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", child],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), \
        result.stdout[-2000:] + result.stderr[-3000:]


def test_the_pools_own_id_is_never_handed_over(monkeypatch):
    import torch

    handed: list = []
    monkeypatch.setattr(torch.cuda, "memory_snapshot",
                        lambda mempool_id, include_traces=True: handed.extend(mempool_id) or [])
    pool_id = (0, 10 ** 6 + 1)

    class Pool:
        id = pool_id

    assert pool_segments(Pool(), 0) == []
    assert handed == list(pool_id) and not any(a is b for a in handed for b in pool_id)


CHILD = """
import torch
from vmm_backends.cuda.pool_snapshot import pool_segments

pools = []
for n in range(400):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        block = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        found = [b for s in pool_segments(pool, 0) for b in s["blocks"]
                 if b["state"] == "active_allocated"]
        assert [int(b["address"]) for b in found] == [block.data_ptr()], (n, found)
    pools.append((pool, block))
print("ok", pools[-1][0].id[1] > 256)
"""


@pytest.mark.gpu
def test_segments_of_400_pools_read_in_one_process(cuda):
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                             textwrap.dedent(CHILD)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0 and result.stdout.endswith("ok True\n"), \
        result.stdout[-2000:] + result.stderr[-4000:]
