"""Measurements every graph benchmark shares: device memory, growth per capture, orders.

Graph memory is read from the driver (``mem_get_info``) with the caching allocator emptied
first, so it counts what the graphs hold, not what the allocator keeps for later.  Reading
after every capture gives the growth curve; the time spent reading is kept apart from the
capture time, so the probes do not inflate it.
"""

from __future__ import annotations

import random
import time
from typing import Any, NamedTuple

__all__ = ["ORDERS", "VLLM_DECODE_SIZES", "ordered", "DeviceMemory", "EmulatedMemory",
           "Device", "open_device", "GrowthRecorder", "measure_executables", "device_name",
           "as_backend", "current_device"]

ORDERS = ("ascending", "descending", "random")

#: the batch sizes every decode scenario runs: vLLM's default CUDA-graph capture sizes,
#: 1, 2, 4, 8..248 step 8, 256..512 step 16
VLLM_DECODE_SIZES = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def ordered(sizes, order: str, seed: int = 0) -> list:
    """``sizes`` in capture order: ascending, descending or shuffled by ``seed``."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    sizes = sorted(sizes)
    if order == "descending":
        return sizes[::-1]
    if order == "random":
        random.Random(seed).shuffle(sizes)
    return sizes


class DeviceMemory:
    """Readings of one device through its framework module (``torch.cuda``, ``torch.npu``...)."""

    #: the caching allocator's id of its default pool (tensors made outside any graph pool)
    DEFAULT_POOL = (0, 0)

    def __init__(self, ops) -> None:
        import torch

        self.mod = getattr(torch, ops.device_type)
        self.device = ops.torch_device

    def used_bytes(self) -> int:
        """Device bytes in use by anyone, after the caching allocator gave back its cache."""
        self.mod.synchronize()
        self.mod.empty_cache()
        free, total = self.mod.mem_get_info(self.device)
        return total - free

    def _segments(self) -> list[tuple[tuple, int]] | None:
        """``(pool id, bytes)`` of every caching-allocator segment on this device, or None
        where the framework has no snapshot that tells pools apart."""
        snapshot = getattr(self.mod, "memory_snapshot", None)
        if getattr(self.mod, "__name__", None) == "torch.cuda":
            # torch's own releases references it never took (vmm_backends.cuda.pool_snapshot)
            from vmm_backends.cuda.pool_snapshot import memory_snapshot as snapshot
        if snapshot is None:
            return None
        try:
            segments = snapshot()
        except Exception:  # a framework without a usable snapshot: say "not measured"
            return None
        index = self.device.index or 0
        out = []
        for seg in segments:
            if seg.get("device", index) != index:
                continue
            if "segment_pool_id" not in seg:
                return None
            out.append((tuple(seg["segment_pool_id"]), int(seg["total_size"])))
        return out

    def segment_bytes(self) -> dict | None:
        """Bytes of the caching allocator's segments: ``{"default": n, "pools": m}``, where
        ``pools`` is every graph or memory pool and ``default`` the rest (persistent
        buffers, library workspaces).  None where the framework cannot tell pools apart."""
        segments = self._segments()
        if segments is None:
            return None
        out = {"default": 0, "pools": 0}
        for pool, size in segments:
            out["default" if pool == self.DEFAULT_POOL else "pools"] += size
        return out

    def pool_segments(self) -> dict | None:
        """The caching allocator's segment sizes per pool id (``{(a, b): [n, ...]}``, the
        default pool left out, largest first), or None where the framework has no such
        snapshot.  A GraphPool space's bytes compared with its own pool's segments tell
        whether the framework gave segments back and asked again (the space keeps the
        first ones); the sizes show how the framework packed the key."""
        segments = self._segments()
        if segments is None:
            return None
        out: dict = {}
        for pool, size in segments:
            if pool != self.DEFAULT_POOL:
                out.setdefault(pool, []).append(size)
        return {pool: sorted(sizes, reverse=True) for pool, sizes in out.items()}


class EmulatedMemory:
    """The host backend's readings, for the engine-runner children its tests run there.

    A CPU has no device memory to read: what is "used" is the physical pages of every
    host allocator (graph spaces, regions) plus what the emulated driver took for graph
    executables (``HostExecutables``: taken in 2 MiB steps, never shown free again after
    a destroy, as on a GPU).  The framework's own CPU allocations are not seen, and its
    allocator has no segments to tell pools apart."""

    def __init__(self, ops) -> None:
        self._executables = ops.executables()
        self._free0 = self._executables.device_free_bytes() if self._executables else 0

    def used_bytes(self) -> int:
        import vmm_core

        pages = sum(e["device_bytes"] for e in vmm_core.memory_summary().values()
                    if e["backend"] == "host")
        taken = self._free0 - self._executables.device_free_bytes() \
            if self._executables else 0
        return pages + taken

    def segment_bytes(self) -> None:
        return None

    def pool_segments(self) -> None:
        return None


def device_name(mod, device) -> str:
    """The device's name, or the backend's where the framework module has none (host)."""
    get = getattr(mod, "get_device_name", None)
    return get(device) if get is not None else "host (emulated graph executables)"


class Device(NamedTuple):
    """One device of a backend, as a benchmark child measures on it."""

    backend: Any
    ops: Any          # the backend's graph ops on this device
    mod: Any          # its framework module: torch.cuda, torch.npu, torch.mlu
    torch_device: Any
    memory: DeviceMemory | EmulatedMemory


def as_backend(backend):
    """A Backend as given; a name, or None (detected), through ``vmm_core.get_backend``:
    what every ``backend=`` argument of vmm_core accepts."""
    import vmm_core

    return vmm_core.get_backend(backend) if backend is None or isinstance(backend, str) \
        else backend


def current_device(backend) -> int:
    """The framework's current device of ``backend``, as PyTorch's ``device=None`` means
    it (0 on the host backend, whose device is the CPU)."""
    ops = backend.graph_ops(0)
    if ops is None or ops.device_type == "cpu":
        return 0
    import torch

    return torch.accelerator.current_device_index()


def open_device(backend_name: str | None, index: int = 0) -> Device:
    """Device ``index`` of the backend called ``backend_name`` (default: detected)."""
    import torch

    import vmm_core

    backend = vmm_core.get_backend(backend_name)
    ops = backend.graph_ops(index)
    memory = EmulatedMemory(ops) if ops.device_type == "cpu" else DeviceMemory(ops)
    return Device(backend, ops, getattr(torch, ops.device_type), ops.torch_device, memory)


class GrowthRecorder:
    """Capture one graph at a time and read memory after each: the growth curve.

    ``probe()`` returns bytes in use; ``growth_bytes[i]`` is the growth after ``i + 1``
    captures, against the reading taken when the recorder was made.  ``capture_s`` sums
    each capture up to ``synchronize()``; ``probe_s`` is the time spent reading.
    """

    def __init__(self, probe, synchronize=lambda: None) -> None:
        self._probe, self._synchronize = probe, synchronize
        self.baseline = probe()
        self.growth_bytes: list[int] = []
        self.capture_s = 0.0
        self.probe_s = 0.0

    def capture(self, fn) -> None:
        t0 = time.perf_counter()
        fn()
        self._synchronize()
        t1 = time.perf_counter()
        self.growth_bytes.append(self._probe() - self.baseline)
        self.capture_s += t1 - t0
        self.probe_s += time.perf_counter() - t1

    @property
    def total_bytes(self) -> int:
        return self.growth_bytes[-1] if self.growth_bytes else 0


#: graphs instantiated per executable probe, at least (mem_get_info moves in 2 MiB steps;
#: executables are a few hundred KiB each)
EXEC_PROBE_GRAPHS = 64


def measure_executables(ops, make_fns, memory: DeviceMemory) -> float | None:
    """Device bytes one graph executable holds, measured without any pool accounting.

    ``make_fns()`` gives the callables of one forward's graphs.  They are captured again,
    enough times for :data:`EXEC_PROBE_GRAPHS` graphs, into one private pool with
    ``keep_graph=True`` (torch >= 2.9: the capture does not instantiate), so every pool
    block exists before the first reading; then all are instantiated and the device's
    free memory read again.  The drop, divided by the graphs, is what
    ``cudaGraphInstantiate`` allocated per graph.  None where the framework cannot keep a
    graph un-instantiated (not CUDA, or an older torch)."""
    import torch

    if ops.device_type != "cuda":
        return None
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return None
    fns = make_fns()
    copies = max(1, -(-EXEC_PROBE_GRAPHS // max(1, len(fns))))
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    with torch.no_grad():
        ops.warmup(lambda: [fn() for fn in fns])  # this stream's library workspaces
        for _ in range(copies):
            for fn in fns:
                g = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.graph(g, pool=pool, stream=ops.capture_stream):
                    fn()
                graphs.append(g)
    before = memory.used_bytes()
    for g in graphs:
        g.instantiate()
    after = memory.used_bytes()
    for g in graphs:
        g.reset()
    del graphs
    memory.used_bytes()
    return (after - before) / (copies * len(fns))
