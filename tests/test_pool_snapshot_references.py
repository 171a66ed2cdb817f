"""Segments are read from torch's snapshot without letting it free what it was handed.

torch's ``_cuda_memorySnapshot`` releases one reference to each element of the tuple it
is handed (the pool id's two ints and the ``include_traces`` flag), one it never took.
The CPU tests replace that C entry point with one that does the same through
``Py_DecRef`` and keeps every tuple it was handed, under torch's own Python wrapper, and
check the counts of what it was handed: rising by the spares alone where it takes, and
the process alive through 20,000 reads with another thread holding references meanwhile.
The GPU test reads the segments of 400 real pools, ids past 256, in a child process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vmm_backends.cuda import pool_snapshot
from vmm_backends.cuda.pool_snapshot import memory_snapshot, pool_segments

STAND_IN = """
import ctypes, gc, sys, threading, time
import torch
from vmm_backends.cuda import pool_snapshot

dec_ref = ctypes.pythonapi.Py_DecRef
dec_ref.argtypes = [ctypes.py_object]
dec_ref.restype = None
TAKES, WRAPPER, READS = {takes}, {wrapper!r}, {reads}
SEGMENTS = [{{"segment_pool_id": (0, 1000), "device": 0, "address": 1}},
            {{"segment_pool_id": (0, 1001), "device": 0, "address": 2}},
            {{"segment_pool_id": (0, 1000), "device": 1, "address": 3}}]
handed = []

def c_snapshot(arg):  # torch._C._cuda_memorySnapshot as torch 2.11 has it
    handed.append(arg)
    if TAKES:
        for item in arg:
            dec_ref(item)
    return {{"segments": SEGMENTS}}

torch._C._cuda_memorySnapshot = c_snapshot
if WRAPPER == "old":  # a torch whose wrapper has no include_traces: the pair goes as it is
    def old(mempool_id=None):
        return c_snapshot(mempool_id)["segments"]
    torch.cuda.memory_snapshot = old
elif WRAPPER == "outer":  # someone's wrapper without the flag: torch's default, True, goes
    inner = torch.cuda.memory_snapshot
    def outer(mempool_id=None):
        return inner(mempool_id)
    torch.cuda.memory_snapshot = outer

class Pool:
    id = (0, 1000)

stop = threading.Event()
def hold_everything():  # what a memory profiler does: hold every tracked object a while
    while not stop.is_set():
        held = gc.get_objects()
        time.sleep(0.0002)
        del held
holder = threading.Thread(target=hold_everything, daemon=True)

def counts():
    first = handed[0]
    return [sys.getrefcount(first[i]) for i in range(2)] + \
        [sys.getrefcount(True), sys.getrefcount(False)]

assert [s["address"] for s in pool_snapshot.pool_segments(Pool(), 0)] == [1]
assert all(a is b for a, b in zip(handed[0], handed[-1]))  # one pair per pool id
before = counts()  # read while nothing else holds references
gc.collect()
blocks = sys.getallocatedblocks()
holder.start()
sys.setswitchinterval(1e-5)
for _ in range(READS):
    assert [s["address"] for s in pool_snapshot.pool_segments(Pool(), 0)] == [1]
    del handed[1:]
stop.set()
holder.join()
gc.collect()
grown = sys.getallocatedblocks() - blocks
after = counts()
print("counts", before, after, "grown", grown)
assert handed[0][2:] == {{"old": (), "outer": (True,)}}.get(WRAPPER, (False,)), handed[0]
assert all(a is b for a, b in zip(handed[0], pool_snapshot._own_parts((0, 1000))))
if TAKES:  # what the reads gave and what was taken balance, but for the spares
    spare = pool_snapshot.SPARE - 1
    assert after[0] - before[0] == after[1] - before[1] == spare * READS, (before, after)
    if sys.version_info < (3, 12):  # True and False are not immortal there
        assert min(after[2] - before[2], after[3] - before[3]) >= READS // 2, \
            (before, after)  # a spare to each a read, less what other code moved
assert grown < READS // 4, grown
print("ok")
"""


@pytest.mark.parametrize("takes, wrapper", [(True, "torch"), (True, "old"), (True, "outer"),
                                            (False, "torch")])
def test_20000_reads_lose_nothing_while_another_thread_holds_references(takes, wrapper):
    """Through torch's own wrapper, an older one without ``include_traces`` or someone's
    wrapper of torch's that leaves the flag to its default, a C entry point
    that releases a reference to everything it is handed (as torch 2.11's does) or
    not: every read finds the pool's segment, the parts are one pair for the pool id,
    their counts rise by the spares, True and False gain more than they lose, nothing piles
    up."""
    child = STAND_IN.format(takes=takes, wrapper=wrapper, reads=20000)
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", child],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), \
        result.stdout[-2000:] + result.stderr[-3000:]


def test_the_pools_own_id_is_never_handed_over(monkeypatch):
    import torch

    handed: list = []
    monkeypatch.setattr(torch._C, "_cuda_memorySnapshot",
                        lambda arg: handed.append(arg) or {"segments": []}, raising=False)
    pool_id = (0, 10 ** 6 + 1)

    class Pool:
        id = pool_id

    assert pool_segments(Pool(), 0) == []
    assert list(handed[0][:2]) == list(pool_id) and handed[0][2] is False
    assert not any(a is b for a in handed[0] for b in pool_id)


def test_a_type_error_of_the_snapshot_itself_is_raised(monkeypatch):
    import torch

    def refuses(arg):
        raise TypeError("mempool_id must be a tuple of 2 integers")

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_memorySnapshot",
                        lambda arg: calls.append(arg) or refuses(arg), raising=False)
    monkeypatch.setattr(pool_snapshot, "_without_flag", False)
    with pytest.raises(TypeError, match="mempool_id must be a tuple"):
        memory_snapshot((0, 5))
    assert len(calls) == 1 and pool_snapshot._without_flag is False  # not retried


def test_a_wrapper_without_the_flag_is_called_once_a_read(monkeypatch):
    import torch

    calls = []

    def old(mempool_id=None):  # a torch before include_traces
        calls.append(mempool_id)
        return []

    monkeypatch.setattr(torch.cuda, "memory_snapshot", old)
    monkeypatch.setattr(pool_snapshot, "_without_flag", False)
    for _ in range(3):
        memory_snapshot((0, 7))
    assert len(calls) == 3 and pool_snapshot._without_flag is True


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
