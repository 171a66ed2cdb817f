"""The roles of the optional hooks (:mod:`vmm_core.plugin`): the copy queue, the allocator
adapter (kept by core, one per device; pools whose memory is vmm_core's) and the graph
ops (a new object per call; replays and executables equal to eager on fresh inputs).

A role a backend does not fill, or whose framework cannot run here, is skipped, saying
which; everything else of a role is checked through the same calls core makes.
"""

from __future__ import annotations

import warnings

import pytest

from ...errors import VMMFallbackWarning
from ...graphs.graph_ops import GraphOps
from ...memory import routing
from ...memory.adapter import AllocatorAdapter
from ...memory.allocator import SharedVMMAllocator
from ..tools import HookCounter
from .fixtures import pattern

#: the layer the graph tests capture: a matrix multiply (libraries' workspaces) and an
#: element-wise tail, small enough for any device
_ROWS, _COLS = 32, 64
#: a replay may run other library kernels than eager picks (a matrix multiply's algorithm)
_CLOSE = {"rtol": 1e-4, "atol": 1e-4}


def test_contract_copy_queue_copies_in_order(vmm_backend, vmm_device, granularity):
    import ctypes

    if not vmm_backend.implements("vmm_copy_queue"):
        pytest.skip("the backend has no vmm_copy_queue (optional)")
    assert vmm_backend.copy_queue(vmm_device) is not vmm_backend.copy_queue(vmm_device), \
        "vmm_copy_queue makes a new queue per call (core closes each one it gets)"
    g = granularity
    a = SharedVMMAllocator(vmm_backend, device=vmm_device, reserve_bytes=4 * g)
    try:
        p = a.allocate(2 * g)
        data = pattern(2 * g, 11)
        pinned = vmm_backend.host_buffer(vmm_device, 2 * g, pinned=True)
        buf = pinned if pinned is not None else ctypes.create_string_buffer(2 * g)
        host = int(pinned.address) if pinned is not None else ctypes.addressof(buf)
        ctypes.memmove(host, data, 2 * g)
        queue = vmm_backend.copy_queue(vmm_device)
        queue.from_host(host, p, g)
        queue.from_host(host + g, p + g, g)
        queue.wait(queue.record())
        ctypes.memset(host, 0, 2 * g)
        queue.to_host(p + g, host, g)  # in order: the second half lands first ...
        queue.to_host(p, host + g, g)  # ... then the first
        queue.record()  # never waited on: synchronize retires it
        queue.synchronize()
        assert ctypes.string_at(host, 2 * g) == data[g:] + data[:g]
        queue.close()
        queue.close()  # idempotent
    finally:
        a.close()


def _filled(be, dev, hook: str, without: str):
    """What the role ``hook`` gives for ``dev`` through core, or a skip saying why the
    backend does not fill it here."""
    if not be.implements(hook):
        pytest.skip(f"the backend has no {hook} (optional): {without}")
    role = getattr(be, hook.removeprefix("vmm_"))(dev)
    if role is None:
        pytest.skip(f"{hook}({dev}) returned None: the backend's framework is not "
                    f"installed here")
    return role


# --------------------------------------------------------------- the allocator adapter
def _adapter(be, dev) -> AllocatorAdapter:
    return _filled(be, dev, "vmm_allocator_adapter",
                   "pools of its framework cannot be served by vmm_core")


def test_contract_allocator_adapter_is_one_per_device(vmm_backend, vmm_device):
    """Core asks once per device and keeps the adapter (its process-wide framework state
    must be one): every later call gives that object, without the hook."""
    adapter = _adapter(vmm_backend, vmm_device)
    assert isinstance(adapter, AllocatorAdapter)
    with HookCounter(vmm_backend) as counter:
        again = [vmm_backend.allocator_adapter(vmm_device) for _ in range(3)]
    assert all(a is adapter for a in again)
    assert counter.calls["vmm_allocator_adapter"] == 0


def test_contract_adapter_pool_holds_vmm_core_memory(vmm_backend, vmm_device, granularity):
    """A pool made while core routes the thread to an allocator holds that allocator's
    memory: a block allocated into it lies in the allocator's current space, is listed
    live while allocated, and not once freed.  Where the framework's allocator cannot be
    redirected (no device graphs), code allocates from the routed allocator itself, as on
    the host backend."""
    import torch

    adapter = _adapter(vmm_backend, vmm_device)
    if not adapter.supports_pools:
        pytest.skip("the adapter declares supports_pools=False: its framework has no pool "
                    "usable during capture")
    routed = routing.framework_routed(vmm_backend, vmm_device)
    device = vmm_backend.graph_ops(vmm_device).torch_device if routed else None
    alloc = SharedVMMAllocator(vmm_backend, device=vmm_device, reserve_bytes=64 * granularity)
    nbytes = 3 * granularity + 512
    try:
        with routing.target(vmm_device, alloc):
            pool = adapter.new_pool()
        assert adapter.live_blocks(pool) == []
        with routing.target(vmm_device, alloc), adapter.use_pool(pool):
            if routed:
                block = torch.empty(nbytes, dtype=torch.uint8, device=device)
                address = block.data_ptr()
            else:
                address = alloc.allocate(nbytes)
        base = alloc.space_base(alloc.current_space)
        assert base <= address < base + alloc.reserve_bytes, \
            f"the pool's block at {address:#x} is not in the routed allocator's space"
        live = adapter.live_blocks(pool)
        assert any(a <= address < a + n for a, n in live), (hex(address), live)
        if routed:
            del block
        else:
            alloc.deallocate(address)
        assert not any(a <= address < a + n for a, n in adapter.live_blocks(pool))
        adapter.release_pool(pool)
        del pool
        adapter.flush()
    finally:
        alloc.close()


# --------------------------------------------------------------- the graph ops
def _graph_ops(be, dev) -> GraphOps:
    """The backend's graph ops, or a skip saying why its graphs cannot run here."""
    import torch

    ops = _filled(be, dev, "vmm_graph_ops", "graphs cannot be captured on it")
    try:
        torch.zeros(1, device=ops.torch_device)
        ops.synchronize()
    except (ImportError, RuntimeError) as exc:
        pytest.skip(f"{ops.device_type} tensors cannot be made here "
                    f"({type(exc).__name__}: {exc})")
    return ops


def _layer(x, w):
    import torch

    return torch.tanh(x @ w) + x


def _inputs(device, seed: int):
    """Weights and a fresh input, drawn on the CPU (the same numbers on every device)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(_COLS, _COLS, generator=gen) / 8
    return w.to(device), (lambda rows: torch.randn(rows, _COLS, generator=gen).to(device))


def test_contract_graph_ops_replay_like_eager_on_fresh_inputs(vmm_backend, vmm_device):
    """A new object per call (each owns the capture stream it warms up); a captured
    graph's replay rewrites its outputs from the inputs' current values."""
    import torch

    ops = _graph_ops(vmm_backend, vmm_device)
    other = vmm_backend.graph_ops(vmm_device)
    assert isinstance(ops, GraphOps) and other is not ops, \
        "vmm_graph_ops makes a new GraphOps per call"
    w, fresh = _inputs(ops.torch_device, 0)
    x = fresh(_ROWS)
    ops.warmup(lambda: _layer(x, w))  # libraries' workspaces outside every pool
    graph = ops.new_graph()
    out = ops.capture(graph, lambda: _layer(x, w), ops.shared_pool_handle())
    for _ in range(3):
        x.copy_(fresh(_ROWS))
        ops.replay(graph)
        ops.synchronize()
        torch.testing.assert_close(out, _layer(x, w), **_CLOSE)
    ops.reset(graph)


def test_contract_executables_launch_like_eager(vmm_backend, vmm_device):
    """Where the graph ops keep captured graphs apart from their executables, a GraphPool
    owning them under a budget of one (every other key's launch remakes or updates the
    one executable) replays every key as eager computes it, on fresh inputs."""
    import torch

    from ...graphs.pool import GraphPool

    ops = _graph_ops(vmm_backend, vmm_device)
    if ops.executables() is None:
        pytest.skip("GraphOps.executables() is None (optional): the framework keeps its "
                    "own executables")
    w, fresh = _inputs(ops.torch_device, 1)
    static = torch.zeros(_ROWS, _COLS, device=ops.torch_device)
    pool = GraphPool(vmm_device, backend=vmm_backend, tag="contract-executables", reads=(),
                     executables=1)
    graphs, outputs = {}, {}
    try:
        with warnings.catch_warnings():
            if not routing.framework_routed(vmm_backend, vmm_device):
                # the framework allocates nothing in the space there, which warns
                warnings.simplefilter("ignore", VMMFallbackWarning)
            pool.warmup(lambda: _layer(static, w))
            for rows in (_ROWS, _ROWS // 4):
                with pool.space(rows):
                    graph = pool.new_graph()
                    outputs[rows] = pool.capture(graph, lambda r=rows: _layer(static[:r], w))
                    pool.keep(outputs[rows])
                graphs[rows] = graph
        for rows in (_ROWS // 4, _ROWS, _ROWS // 4, _ROWS):
            x = fresh(rows)
            with pool.replaying(rows):
                static[:rows].copy_(x)
                graphs[rows].replay()
                got = outputs[rows].clone()
            ops.synchronize()
            torch.testing.assert_close(got, _layer(x, w), **_CLOSE)
        assert pool.stats()["executables"]["resident"] <= 1
    finally:
        for graph in graphs.values():
            graph.reset()
        pool.close()


__all__ = [n for n in list(globals()) if n.startswith("test_contract_")]
