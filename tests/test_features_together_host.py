"""Where features meet: live-bytes offload, announced offload, executables owned by a
pool, the engine integrations and the fork hooks, used together on the host backend, in
the timings and orders of calls where one could undo another."""

from __future__ import annotations

import ctypes

import pytest
import torch
from proc_state import fork_while_held
from test_executables_host import _execs, _pool, piece

import vmm_core
from vmm_core.errors import CaptureError
from vmm_core.integrations import torch_memory_saver as compat
from vmm_core.integrations import vllm as vllm_plugin
from vmm_core.integrations.torch_memory_saver import state as compat_state

MIB = 1 << 20
pytestmark = pytest.mark.usefixtures("clean_tags")


# ------------------------------------------------------------------ fork

def test_a_child_forked_while_a_pause_holds_the_compat_lock_can_pause(host, fresh_compat):
    """``torch_memory_saver.pause()`` holds the compat's lock while it waits for the
    tagged-memory lock; a fork that gives up waiting for that lock gives the child fresh
    compat locks, so the child's first pause, resume or region returns."""
    tms = compat.TorchMemorySaver(backend=host)
    with tms.region("w", enable_cpu_backup=True) as alloc:
        p = alloc.allocate(MIB)
    ctypes.memset(p, 7, MIB)

    def child():
        tms.pause("w")
        tms.resume("w")
        assert ctypes.string_at(p, MIB) == bytes([7]) * MIB

    fork_while_held(compat_state.lock(), child, "on the torch_memory_saver compat's lock")


def test_a_child_forked_while_the_vllm_allocator_is_locked_can_use_it(host):
    """The same for vLLM's allocator: its lock is held while its graph pool is made,
    which waits for the tagged-memory lock (a capture on another thread)."""
    allocator = vllm_plugin.VmmMemAllocator(backend=host)
    with allocator.use_memory_pool("kv_cache") as alloc:
        alloc.allocate(MIB)

    def child():
        with allocator.use_memory_pool("kv_cache") as alloc:
            alloc.allocate(MIB)
        allocator.sleep(offload_tags=())
        allocator.wake_up()
        vllm_plugin.VmmMemAllocator.get_instance()

    fork_while_held(allocator._lock, child, "on the vLLM allocator's lock")
    fork_while_held(vllm_plugin.VmmMemAllocator._instance_lock, child,
                    "on the vLLM allocator class's lock")


# ------------------------------------------------------------------ executables
@pytest.mark.parametrize("executables", [None, 2], ids=["made-at-capture", "budget"])
def test_a_capture_that_raised_raises_its_own_error_and_leaves_nothing_captured(
        host, executables):
    """On the host a failed capture ends the graph's capture and resets it; a pool that owns
    the executables hears that the capture failed: the function's own error is raised (not
    "instantiate of a host graph that was never captured"), and the graph is neither counted
    nor replayable."""
    pool = _pool(host, executables)
    g = pool.new_graph()
    with pytest.raises(ZeroDivisionError):
        with pool.space(1):
            pool.capture(g, lambda: 1 / 0)
    assert _execs(pool)["graphs"] == 0 and _execs(pool)["resident"] == 0
    with pytest.raises(CaptureError, match="never captured or was reset"):
        g.replay()
    # the same graph captures and replays normally afterwards
    x, w = torch.randn(2, 8), torch.randn(8, 8)
    with pool.space(1):
        out = pool.capture(g, piece(x, w))
    x.copy_(torch.randn(2, 8))
    g.replay()
    torch.testing.assert_close(out, torch.tanh(x @ w))
    assert _execs(pool)["graphs"] == 1
    pool.close()


# ------------------------------------------------------------------ live-bytes offload
def test_an_allocator_its_last_graph_pool_gave_back_offloads_every_byte_again(host):
    """A GraphPool on a caller's allocator tells it which bytes a sleep keeps (the blocks
    declared with keep(), and even through a discarding sleep); once the last pool on it
    was closed the allocator kept both, so its owner's next ``sleep(offload=True)``
    copied nothing and every byte came back as garbage."""
    import random

    alloc = vmm_core.SharedVMMAllocator(host)
    mine = alloc.live_ranges = lambda: []  # the owner's own choice
    for _ in range(2):  # a second family after the first keeps working the same way
        pool = vmm_core.GraphPool(backend=host, allocator=alloc, reads=())
        assert alloc.preserve_live
        with pool.space(1):
            pass
        pool.close()
        assert alloc.live_ranges is mine and not alloc.preserve_live
    alloc.live_ranges = None
    p = alloc.allocate(MIB)
    data = random.Random(0).randbytes(MIB)
    ctypes.memmove(p, data, MIB)
    alloc.sleep(offload=True)
    alloc.wake()
    assert ctypes.string_at(p, MIB) == data
    alloc.close()
