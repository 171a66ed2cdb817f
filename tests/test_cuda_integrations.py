"""GPU suite for the engine integrations: skipped without CUDA, failing under
VMM_CORE_REQUIRE=cuda.

torch_memory_saver's API with real tensors and graphs (regions, pause/resume, a captured
graph paused and replayed against eager, a library's lazily made counter), an offload
that copies the live blocks of a region's pool and not its cached free blocks, and vLLM's
levels on VmmMemAllocator (without vLLM, which the GPU machine does not have: the plugin's
registration with vLLM is tested on the CPU, tests/test_vllm_plugin.py).

    VMM_CORE_REQUIRE=cuda python -m pytest tests/test_cuda_integrations.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import vmm_core
from vmm_core.errors import CaptureEscapeError
from vmm_core.integrations import torch_memory_saver as compat
from vmm_core.integrations import vllm as plugin
from vmm_core.memory import offload, tagged

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_tags", "fresh_compat")]

MIB = 1 << 20


@pytest.fixture
def fresh_compat(monkeypatch):
    from vmm_core.integrations.torch_memory_saver import settings, state

    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP", raising=False)
    state.reset()
    settings.reset()
    yield
    state.reset()
    settings.reset()
    import torch

    torch.cuda.synchronize()
    assert offload.wait_for_prepared(30)
    for tag in tagged.tags():
        for alloc in tagged.allocators(tag):
            if alloc.asleep:
                alloc.wake(keep_host_buffers=False)


def _scrub(nbytes: int) -> None:
    """Fill freed device pages with a pattern, so that memory that comes back discarded
    instead of restored reads wrong (fresh pages may otherwise still hold the old bytes)."""
    import torch

    junk = torch.full((nbytes,), 0x7F, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    del junk
    torch.cuda.empty_cache()


def test_cuda_tms_region_pause_resume_frees_and_restores(cuda):
    import torch

    tms = compat.TorchMemorySaver(backend=cuda)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with tms.region("weights", enable_cpu_backup=True):
        weights = torch.randn(64 * MIB // 4, device="cuda", generator=gen)
    with tms.region("kv_cache"):
        kv = torch.ones(32 * MIB // 4, device="cuda")
    expected, addresses = weights.clone(), (weights.data_ptr(), kv.data_ptr())
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    tms.pause()
    assert torch.cuda.mem_get_info()[0] - free_before >= 96 * MIB - 4 * MIB
    backup = tms.get_cpu_backup(weights)
    assert backup.device.type == "cpu" and torch.equal(backup, expected.cpu())
    _scrub(256 * MIB)
    tms.resume()
    assert (weights.data_ptr(), kv.data_ptr()) == addresses
    assert torch.equal(weights, expected)
    kv.fill_(2.0)  # usable at the same address
    assert float(kv.sum()) == 2.0 * kv.numel()


def test_cuda_tms_graph_paused_resumed_and_replayed_matches_eager(cuda):
    import torch

    tms = compat.TorchMemorySaver(backend=cuda)
    gen = torch.Generator(device="cuda").manual_seed(1)
    with tms.region("weights", enable_cpu_backup=True):
        w1 = torch.randn(1024, 4096, device="cuda", generator=gen) / 32
        w2 = torch.randn(4096, 1024, device="cuda", generator=gen) / 64
    static_in = torch.zeros(64, 1024, device="cuda")

    def model(x):
        return torch.relu(x @ w1) @ w2

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: cuBLAS workspaces outside the capture
        model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with tms.cuda_graph(graph, tag="graph"):
        static_out = model(static_in)
    for _ in range(2):
        tms.pause("graph")
        tms.pause("weights")
        _scrub(512 * MIB)
        tms.resume("weights")
        tms.resume("graph")
        x = torch.randn(64, 1024, device="cuda", generator=gen)
        static_in.copy_(x)
        graph.replay()
        torch.testing.assert_close(static_out, model(x), rtol=1e-4, atol=1e-4)


class _LazyCounter:
    """A library's persistent device state, made on first call: inside a capture the
    allocation lands in the capture's pool, it is zeroed once outside the graph, and
    every replay reads it and adds one."""

    def __init__(self) -> None:
        self.value = None

    def step(self):
        import torch

        if self.value is None:
            self.value = torch.empty(1, dtype=torch.int64, device="cuda")
            self.fresh = True
        self.value.add_(1)
        return self.value

    def initialize(self) -> None:
        if getattr(self, "fresh", False):
            self.value.zero_()
            self.fresh = False


def test_cuda_lazy_counter_refused_by_vmm_pool_and_kept_by_tms_graph(cuda):
    import torch

    pool = vmm_core.GraphPool(backend=cuda)
    counter = _LazyCounter()
    with pytest.raises(CaptureEscapeError):
        with pool.space(1) as handle:
            with torch.cuda.graph(torch.cuda.CUDAGraph(), pool=handle,
                                  stream=pool.capture_stream):
                counter.step()
    counter = None
    pool = None

    tms = compat.TorchMemorySaver(backend=cuda)
    counter = _LazyCounter()
    graph = torch.cuda.CUDAGraph()
    with tms.cuda_graph(graph, tag="graph", enable_cpu_backup=False):
        counter.step()
    counter.initialize()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert int(counter.value.item()) == 3
    tms.pause("graph")
    _scrub(256 * MIB)
    tms.resume("graph")
    graph.replay()
    assert int(counter.value.item()) == 4, "the counter must come back, not as garbage"


def test_cuda_offload_copies_live_blocks_not_the_pools_cached_ones(cuda):
    import torch

    with vmm_core.region("live-w", backend=cuda) as alloc:
        a = torch.full((64 * MIB,), 1, dtype=torch.uint8, device="cuda")
        b = torch.full((64 * MIB,), 2, dtype=torch.uint8, device="cuda")
        c = torch.full((64 * MIB,), 3, dtype=torch.uint8, device="cuda")
    del b  # a cached free block of the region's pool
    torch.cuda.synchronize()
    assert alloc.physical_bytes >= 192 * MIB
    vmm_core.sleep("live-w", offload="live-w")
    assert alloc.host_bytes == 128 * MIB, "live bytes only, not the pool's reserved bytes"
    assert alloc.last_transfer.nbytes == 128 * MIB
    _scrub(512 * MIB)
    vmm_core.wake_up("live-w", keep_host_buffers=False)
    assert int(a.min()) == int(a.max()) == 1 and int(c.min()) == int(c.max()) == 3


def test_cuda_vllm_levels_on_the_vmm_allocator(cuda):
    """In a fresh process, as a vLLM worker is one: after the tests above dropped their
    graph pools, a capture on torch's default capture stream in this process replayed
    into an illegal address on the H100 (2026-11-25), while the same steps alone, in a
    fresh process, replayed exactly every time (with and without the scrub, each sleep
    level alone or all together)."""
    proc = subprocess.run([sys.executable, __file__, "vllm-levels"], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0 and "vllm-levels: ok" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]


def _vllm_levels() -> None:
    import torch

    cuda = vmm_core.get_backend("cuda")
    allocator = plugin.VmmMemAllocator(backend=cuda)
    mode = plugin.VmmSleepMode(allocator)
    gen = torch.Generator(device="cuda").manual_seed(2)
    with allocator.use_memory_pool("weights"):
        w = torch.randn(2048, 2048, device="cuda", generator=gen) / 45
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.zeros(16 * MIB, dtype=torch.uint8, device="cuda")
    static_in = torch.zeros(32, 2048, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.relu(static_in @ w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with allocator.cudagraph_pool() as handle:
        with torch.cuda.graph(graph, pool=handle):
            static_out = torch.relu(static_in @ w)
    expected_w = w.clone()
    assert offload.wait_for_prepared(30)
    mode.suspend(1)
    (weights,) = tagged.allocators("vllm:weights")
    assert weights.last_transfer.strategy == "pinned", "announced: the first sleep is pinned"
    assert vmm_core.memory_summary()["vllm:kv_cache"]["host_bytes"] == 0
    _scrub(256 * MIB)
    mode.resume(["weights"])  # kv_cache waits
    assert vmm_core.memory_summary()["vllm:kv_cache"]["asleep"]
    mode.resume()
    assert torch.equal(w, expected_w)
    kv.fill_(1)
    x = torch.randn(32, 2048, device="cuda", generator=gen)
    static_in.copy_(x)
    graph.replay()
    torch.testing.assert_close(static_out, torch.relu(x @ w), rtol=1e-4, atol=1e-4)
    mode.suspend(2)  # weights discarded: vLLM reloads them
    assert vmm_core.memory_summary()["vllm:weights"]["host_bytes"] == 0
    mode.resume()
    print("vllm-levels: ok")


if __name__ == "__main__":
    {"vllm-levels": _vllm_levels}[sys.argv[1]]()
