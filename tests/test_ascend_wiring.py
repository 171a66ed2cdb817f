"""The Ascend allocator adapter and graph ops, wired against the CPU stand-in of torch_npu.

No Ascend hardware or torch_npu is available here.  Three things keep the stand-in
honest: (a) the adapter and graph ops run end to end against it, allocating through the
real vmm_core C shim into a SharedVMMAllocator; (b) they run through a strict proxy of
``torch_npu`` that records every attribute they touch, and the test fails when one is
missing from the stand-in or absent from the table of real APIs below; (c) the stand-in's
signatures must equal the real ones recorded in that table, each with its source.
"""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path

import pytest

import vmm_core
from vmm_core.errors import BackendUnavailableError
from vmm_core.memory import routing
from vmm_core.memory.shim import load_shim

STANDINS = Path(__file__).resolve().parent / "standins"

# Real torch_npu APIs the Ascend backend (or this test) uses: qualified name ->
# (signature without annotations, or None for non-callables, source file).
# Source: github.com/Ascend/pytorch, master at 9e73e708ab9350d203475609f36f8a43f6a0c2ab
# (2026-08-21); torch.npu is torch_npu.npu.
REAL_API = {
    "torch_npu.__version__": (None, "torch_npu/__init__.py (from torch_npu.version)"),
    "torch_npu.npu": (None, "torch_npu/npu/__init__.py"),
    "torch_npu.npu.memory": (None, "torch_npu/npu/memory.py"),
    "torch_npu.npu.memory.NPUPluggableAllocator":
        ("(path_to_so_file, alloc_fn_name, free_fn_name)", "torch_npu/npu/memory.py"),
    "NPUPluggableAllocator.allocator": ("(self)", "torch_npu/npu/memory.py (_NPUAllocator)"),
    "torch_npu.npu.MemPool":
        ("(allocator=None, use_on_oom=False, no_split=False)", "torch_npu/npu/memory.py"),
    "MemPool.id": (None, "torch_npu/npu/memory.py (property)"),
    "MemPool.snapshot": ("(self)", "torch_npu/npu/memory.py"),
    "torch_npu.npu.use_mem_pool": ("(pool, device=None)", "torch_npu/npu/memory.py"),
    "torch_npu.npu.empty_cache": ("()", "torch_npu/npu/memory.py"),
    "torch_npu.npu.memory.caching_allocator_alloc":
        ("(size, device=None, stream=None)", "torch_npu/npu/memory.py"),
    "torch_npu.npu.memory.caching_allocator_delete": ("(mem_ptr)", "torch_npu/npu/memory.py"),
    "torch_npu.npu.memory.memory_snapshot": ("(mempool_id=None)", "torch_npu/npu/memory.py"),
    "torch_npu.npu.NPUGraph": ("()", "torch_npu/npu/graphs.py"),
    "NPUGraph.replay": ("(self)", "torch_npu/npu/graphs.py"),
    "NPUGraph.reset": ("(self)", "torch_npu/npu/graphs.py"),
    "NPUGraph.pool": ("(self)", "torch_npu/npu/graphs.py"),
    "NPUGraph.capture_begin":
        ("(self, pool=None, capture_error_mode='global')", "torch_npu/npu/graphs.py"),
    "NPUGraph.capture_end": ("(self)", "torch_npu/npu/graphs.py"),
    "torch_npu.npu.graph":
        ("(npu_graph, pool=None, stream=None, auto_dispatch_capture=False, "
         "capture_error_mode='global')", "torch_npu/npu/graphs.py"),
    "torch_npu.npu.graph_pool_handle": ("()", "torch_npu/npu/graphs.py"),
    "torch_npu.npu.Stream": ("(device=None, priority=0, **kwargs)", "torch_npu/npu/streams.py"),
    "Stream.wait_stream": ("(self, stream)", "torch_npu/npu/streams.py"),
    "Stream.synchronize": ("(self)", "torch_npu/npu/streams.py"),
    "torch_npu.npu.stream": ("(stream)", "torch_npu/npu/utils.py"),
    "torch_npu.npu.current_stream": ("(device=None)", "torch_npu/npu/utils.py"),
    "torch_npu.npu.synchronize": ("(device=None)", "torch_npu/npu/utils.py"),
}


class _Log:
    def __init__(self) -> None:
        self.used: set[str] = set()
        self.missing: set[str] = set()


def _unwrap(value):
    return object.__getattribute__(value, "_target") if isinstance(value, _Strict) else value


class _Strict:
    """Records every attribute read through it; an attribute the target lacks is logged."""

    def __init__(self, target, name: str, log: _Log) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, attr):
        target = object.__getattribute__(self, "_target")
        if attr.startswith("__") and attr != "__version__":
            return getattr(target, attr)
        log = object.__getattribute__(self, "_log")
        base = object.__getattribute__(self, "_name")
        full = f"{base}.{attr}"
        if not hasattr(target, attr):
            log.missing.add(full)
            raise AttributeError(f"the torch_npu stand-in has no {full}")
        log.used.add(full)
        value = getattr(target, attr)
        if isinstance(value, types.ModuleType):
            return _Strict(value, full, log)
        if callable(value):
            return _calling(value, log)
        return value


def _calling(fn, log: _Log):
    """Call ``fn`` with unwrapped arguments; wrap stand-in objects it returns."""

    def call(*args, **kwargs):
        result = fn(*[_unwrap(a) for a in args], **{k: _unwrap(v) for k, v in kwargs.items()})
        module = getattr(type(result), "__module__", "") or ""
        if module.startswith("torch_npu") and not hasattr(type(result), "__enter__"):
            return _Strict(result, type(result).__name__, log)
        return result

    return call


@pytest.fixture(params=["2.13"])
def mimic(request, monkeypatch):
    """Which torch_npu release the stand-in mimics (read when it is imported)."""
    if request.param == "2.12":
        monkeypatch.setenv("VMM_CORE_STANDIN_TORCH_NPU", "2.12")
    else:
        monkeypatch.delenv("VMM_CORE_STANDIN_TORCH_NPU", raising=False)
    return request.param


@pytest.fixture
def standin(mimic, monkeypatch):
    """The stand-in torch_npu behind a strict proxy, for this test only."""
    before = {k for k in sys.modules if k == "torch_npu" or k.startswith("torch_npu.")}
    assert not before, "a real torch_npu is imported; this test needs the stand-in"
    monkeypatch.syspath_prepend(str(STANDINS))
    import torch_npu

    assert Path(torch_npu.__file__).resolve().is_relative_to(STANDINS)
    del sys.modules["torch_npu"]  # so that monkeypatch removes the proxy afterwards
    log = _Log()
    monkeypatch.setitem(sys.modules, "torch_npu", _Strict(torch_npu, "torch_npu", log))
    from vmm_backends.ascend import allocator_adapter

    monkeypatch.setattr(allocator_adapter, "_pluggable", None)
    monkeypatch.delenv(allocator_adapter.ENV_POOLS_NEVER_RELEASED, raising=False)
    yield types.SimpleNamespace(module=torch_npu, log=log)
    for name in [k for k in sys.modules if k.startswith("torch_npu.")]:
        del sys.modules[name]


@pytest.fixture
def host_alloc():
    backend = vmm_core.get_backend("host")
    g = backend.capabilities(0).granularity
    a = vmm_core.SharedVMMAllocator(backend, device=0, reserve_bytes=16384 * g)
    yield a
    a.close()


def _run_wiring(standin, host_alloc):
    from vmm_backends.ascend.allocator_adapter import AscendAllocatorAdapter
    from vmm_backends.ascend.graph_ops import AscendGraphOps

    mem = standin.module.npu.memory
    adapter, ops = AscendAllocatorAdapter(0), AscendGraphOps(0)
    held = []

    def step():
        held.append(mem.caching_allocator_alloc(3000))
        return held[-1]

    ops.warmup(lambda: mem.caching_allocator_delete(mem.caching_allocator_alloc(100)))
    shim_before = load_shim().counters()["allocs"]
    pool = adapter.new_pool()
    graph = ops.new_graph()
    with routing.target(0, host_alloc), adapter.use_pool(pool):
        address = ops.capture(graph, step, adapter.pool_handle(pool))
    base = host_alloc.space_base(host_alloc.current_space)
    assert base <= address < base + host_alloc.reserve_bytes, "segment must come from vmm_core"
    assert load_shim().counters()["allocs"] == shim_before + 1
    assert adapter.live_blocks(pool) == [(address, 3072)]  # rounded to 512 like the allocator
    mem.caching_allocator_delete(held.pop())
    assert adapter.live_blocks(pool) == []
    ops.replay(graph)
    assert _unwrap(graph).replay_count == 1
    assert isinstance(ops.shared_pool_handle(), tuple)
    ops.synchronize()
    adapter.release_pool(pool)
    return adapter, ops


def test_adapter_and_graph_ops_run_against_standin(standin, host_alloc):
    _run_wiring(standin, host_alloc)
    assert not standin.log.missing


def test_every_torch_npu_call_exists_in_standin_and_real_table(standin, host_alloc):
    _run_wiring(standin, host_alloc)
    assert not standin.log.missing, f"stand-in lacks {sorted(standin.log.missing)}"
    unknown = sorted(standin.log.used - REAL_API.keys())
    assert not unknown, (f"the Ascend backend uses {unknown}, which the table of real "
                         f"torch_npu APIs does not record: verify them and add them")
    assert "torch_npu.npu.memory.NPUPluggableAllocator" in standin.log.used
    assert "torch_npu.npu.use_mem_pool" in standin.log.used


def test_strict_proxy_fails_on_a_missing_api(standin, monkeypatch):
    monkeypatch.delattr(standin.module.npu, "graph_pool_handle")
    from vmm_backends.ascend.graph_ops import AscendGraphOps

    with pytest.raises(AttributeError, match="stand-in has no torch_npu.npu.graph_pool_handle"):
        AscendGraphOps(0).shared_pool_handle()
    assert standin.log.missing == {"torch_npu.npu.graph_pool_handle"}


def _plain_signature(obj) -> str:
    sig = inspect.signature(obj)
    parts = []
    for p in sig.parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is p.empty else f"={p.default!r}"
        parts.append(f"{prefix}{p.name}{default}")
    return f"({', '.join(parts)})"


def _resolve(root, qualified: str):
    head, *rest = qualified.split(".")
    if head == "torch_npu":
        obj = root
    else:  # Class.method: find the class in the stand-in's npu namespace
        obj = getattr(root.npu, head, None) or getattr(root.npu.memory, head)
    for attr in rest:
        obj = inspect.getattr_static(obj, attr) if isinstance(obj, type) else getattr(obj, attr)
    return obj


@pytest.mark.parametrize("name", sorted(REAL_API))
def test_standin_signature_matches_real(name, standin):
    expected, source = REAL_API[name]
    obj = _resolve(standin.module, name)
    if expected is None:
        assert obj is not None, f"stand-in lacks {name} ({source})"
        return
    target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    assert _plain_signature(target) == expected, f"{name} differs from {source}"


def test_old_torch_npu_release_path_is_refused(standin, monkeypatch):
    from vmm_backends.ascend import allocator_adapter

    monkeypatch.setattr(standin.module, "__version__", "2.12.0.post1")
    adapter = allocator_adapter.AscendAllocatorAdapter(0)
    with pytest.raises(BackendUnavailableError, match="aclrtFree.*VMM_CORE_ASCEND_POOLS_NEVER"):
        adapter.new_pool()
    monkeypatch.setenv(allocator_adapter.ENV_POOLS_NEVER_RELEASED, "1")
    pool = adapter.new_pool()
    adapter.release_pool(pool)  # a no-op: the pool must never be released on this release
    assert any(p is pool for p in adapter._kept)


@pytest.mark.parametrize("version, safe", [
    ("2.13.0", True), ("2.14.0.post1", True), ("2.13.0.dev20260801", True),
    ("2.13.0.dev20260601", False), ("2.12.0.post1", False), ("2.8.0", False),
    ("garbage", False), (None, False),
])
def test_release_path_cutoff(version, safe):
    from vmm_backends.ascend.allocator_adapter import release_path_verdict

    ok, why = release_path_verdict(version, {})
    assert ok is safe, why
    assert release_path_verdict(version, {"VMM_CORE_ASCEND_POOLS_NEVER_RELEASED": "1"})[0] \
        is (version is not None)


def test_hooks_return_adapter_and_ops_only_with_torch_npu(monkeypatch, standin):
    from vmm_backends.ascend.allocator_adapter import AscendAllocatorAdapter
    from vmm_backends.ascend.graph_ops import AscendGraphOps
    from vmm_backends.ascend.vmm_api import AscendBackend

    be = AscendBackend()
    assert isinstance(be.vmm_graph_ops(device=0), AscendGraphOps)
    assert isinstance(be.vmm_allocator_adapter(device=0), AscendAllocatorAdapter)
    monkeypatch.delitem(sys.modules, "torch_npu")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(STANDINS)])
    assert be.vmm_graph_ops(device=0) is None and be.vmm_allocator_adapter(device=0) is None


@pytest.fixture
def ascend_emulated():
    import emulated

    try:
        backend = emulated.backend_for("ascend")
    except emulated.NotBuildable as exc:
        pytest.skip(str(exc))
    yield backend
    emulated.release("ascend")


@pytest.mark.parametrize("mimic", ["2.13", "2.12"], indirect=True)
def test_graph_pool_runs_on_the_ascend_path(mimic, standin, ascend_emulated, monkeypatch):
    """GraphPool uses only graph ops and the adapter: on the emulated driver plus the
    stand-in torch_npu, spaces alias real (emulated) device pages and the guard holds.
    On torch_npu 2.12 (MemPool without snapshot(), pools never released) too."""
    from vmm_backends.ascend import allocator_adapter
    from vmm_core.errors import CaptureError, CaptureEscapeError
    from vmm_core.testing import read_bytes, write_bytes

    if mimic == "2.12":
        monkeypatch.setenv(allocator_adapter.ENV_POOLS_NEVER_RELEASED, "1")
    # the capability reads torch_npu's installed version; the stand-in is not installed
    monkeypatch.setattr(allocator_adapter, "graph_pool_verdict",
                        lambda: allocator_adapter.release_path_verdict(
                            standin.module.__version__))
    monkeypatch.setattr(ascend_emulated, "_caps", {})
    # the adapter core keeps is made with this stand-in: it must not outlive it
    monkeypatch.setattr(ascend_emulated, "_adapters", {})

    npu, mem = standin.module.npu, standin.module.npu.memory
    pool = vmm_core.GraphPool(0, backend=ascend_emulated)
    outs = {}
    for key in (8, 2):
        graph = npu.NPUGraph()
        with pool.space(key) as handle:
            with npu.graph(graph, pool=handle):  # what an engine's runner writes
                outs[key] = mem.caching_allocator_alloc(3000)
            pool.keep(outs[key])
    alloc = pool.allocator
    assert outs[2] != outs[8] and outs[2] == alloc.translate(outs[8], alloc.current_space)
    write_bytes(ascend_emulated, 0, outs[8], b"npu pages")
    assert read_bytes(ascend_emulated, 0, outs[2], 9) == b"npu pages"
    pool.before_replay(8)
    with pytest.raises(CaptureEscapeError, match="capture space 4"):
        with pool.space(4) as handle:
            with npu.graph(npu.NPUGraph(), pool=handle):
                mem.caching_allocator_alloc(100)
    with pytest.raises(CaptureError, match="unusable"):
        pool.before_replay(8)
    assert standin.log.missing == ({"MemPool.snapshot"} if mimic == "2.12" else set())
    alloc.close()


@pytest.mark.parametrize("mimic", ["2.12"], indirect=True)
def test_every_pool_of_a_device_shares_the_one_adapter_core_keeps(mimic, standin,
                                                                  ascend_emulated,
                                                                  monkeypatch):
    """On a torch_npu that would aclrtFree vmm_core's memory, the adapter keeps every
    pool it made alive: that holds only if every GraphPool of the device gets the same
    adapter, which core keeps (the contract's test of it, on the Ascend path)."""
    from vmm_backends.ascend import allocator_adapter
    from vmm_core.testing.contract import roles

    monkeypatch.setenv(allocator_adapter.ENV_POOLS_NEVER_RELEASED, "1")
    monkeypatch.setattr(allocator_adapter, "graph_pool_verdict",
                        lambda: allocator_adapter.release_path_verdict(
                            standin.module.__version__))
    monkeypatch.setattr(ascend_emulated, "_caps", {})
    monkeypatch.setattr(ascend_emulated, "_adapters", {})  # one made with this stand-in
    roles.test_contract_allocator_adapter_is_one_per_device(ascend_emulated, 0)
    npu, mem = standin.module.npu, standin.module.npu.memory
    pools = [vmm_core.GraphPool(0, backend=ascend_emulated) for _ in range(2)]
    adapter = pools[0].adapter
    assert isinstance(adapter, allocator_adapter.AscendAllocatorAdapter)
    assert pools[1].adapter is adapter is ascend_emulated.allocator_adapter(0)
    for key, pool in enumerate(pools):
        with pool.space(key) as handle:
            with npu.graph(npu.NPUGraph(), pool=handle):
                pool.keep(mem.caching_allocator_alloc(1000))
    assert len(adapter._kept) == 2, "a pool of either GraphPool would be released"
    for pool in pools:
        pool.allocator.close()


@pytest.mark.parametrize("mimic", ["2.12"], indirect=True)
def test_live_blocks_on_torch_npu_2_12_without_mempool_snapshot(mimic, standin, host_alloc,
                                                                monkeypatch):
    """torch_npu 2.1-2.12: MemPool has no snapshot() and memory_snapshot() takes no
    mempool_id; the adapter lists a pool's live blocks from the whole snapshot."""
    from vmm_backends.ascend import allocator_adapter
    from vmm_core.errors import BackendError

    npu, mem = standin.module.npu, standin.module.npu.memory
    assert standin.module.__version__.startswith("2.12")
    assert not hasattr(_unwrap(npu.MemPool), "snapshot")
    assert _plain_signature(_unwrap(mem).memory_snapshot) == "()"
    monkeypatch.setenv(allocator_adapter.ENV_POOLS_NEVER_RELEASED, "1")
    adapter = allocator_adapter.AscendAllocatorAdapter(0)
    pool, other = adapter.new_pool(), adapter.new_pool()
    with routing.target(0, host_alloc):
        with adapter.use_pool(other):
            mem.caching_allocator_alloc(1000)  # another pool's block is not this pool's
        with adapter.use_pool(pool):
            address = mem.caching_allocator_alloc(3000)
    assert adapter.live_blocks(pool) == [(address, 3072)]
    mem.caching_allocator_delete(address)
    assert adapter.live_blocks(pool) == []
    # a snapshot that does not say which pool a segment belongs to is refused, not
    # read as "nothing left allocated"
    monkeypatch.setattr(_unwrap(mem), "memory_snapshot",
                        lambda: [{"address": 1, "total_size": 2, "blocks": []}])
    with pytest.raises(BackendError, match="segment_pool_id.*upgrade torch_npu"):
        adapter.live_blocks(pool)


def test_capture_entry_releases_cached_memory_as_torch_npu_does(standin, host_alloc):
    """torch_npu's graph.__enter__ calls empty_cache() and host_empty_cache() before
    capture_begin: a dropped pool's free segments go back through the shim right there."""
    from vmm_backends.ascend.allocator_adapter import AscendAllocatorAdapter

    npu, mem = standin.module.npu, _unwrap(standin.module.npu.memory)
    adapter = AscendAllocatorAdapter(0)
    pool = adapter.new_pool()
    with routing.target(0, host_alloc), adapter.use_pool(pool):
        address = mem.caching_allocator_alloc(3000)
    mem.caching_allocator_delete(address)
    del pool  # dropped, every block free: empty_cache may give its segment back
    frees = load_shim().counters()["frees"]
    calls = dict(mem.calls)
    with routing.target(0, host_alloc):
        with npu.graph(npu.NPUGraph()):
            assert load_shim().counters()["frees"] == frees + 1  # before capture began
    assert mem.calls["empty_cache"] == calls["empty_cache"] + 1
    assert mem.calls["host_empty_cache"] == calls["host_empty_cache"] + 1


@pytest.mark.parametrize("mimic", ["2.12"], indirect=True)
def test_standin_2_12_releases_a_dropped_custom_pool_the_unsafe_way(mimic, standin, host_alloc):
    """torch_npu <= 2.12 frees a released custom-allocator pool's segments with aclrtFree
    (the hazard VMM_CORE_ASCEND_POOLS_NEVER_RELEASED exists for): the 2.12 stand-in must
    make that loud, not hand the segments back through the allocator as 2.13 does."""
    from vmm_core.memory.shim import ALLOC_SYMBOL, FREE_SYMBOL

    npu, mem = standin.module.npu, _unwrap(standin.module.npu.memory)
    shim = load_shim()
    shim.ensure_routing()
    pool = npu.MemPool(mem.NPUPluggableAllocator(shim.path, ALLOC_SYMBOL,
                                                 FREE_SYMBOL).allocator())
    with routing.target(0, host_alloc), npu.use_mem_pool(pool):
        address = mem.caching_allocator_alloc(3000)
    mem.caching_allocator_delete(address)
    del pool
    frees = shim.counters()["frees"]
    with pytest.raises(RuntimeError, match="aclrtFree"):
        mem.empty_cache()
    assert shim.counters()["frees"] == frees


@pytest.mark.parametrize("mimic", ["2.12"], indirect=True)
def test_adapter_on_torch_npu_2_12_never_lets_a_pool_reach_release(mimic, standin, host_alloc,
                                                                  monkeypatch):
    """With VMM_CORE_ASCEND_POOLS_NEVER_RELEASED=1 on 2.12 the adapter keeps every pool, so
    capture entry (empty_cache) never reaches the unsafe release, whatever the caller drops."""
    import gc

    from vmm_backends.ascend import allocator_adapter

    npu, mem = standin.module.npu, _unwrap(standin.module.npu.memory)
    monkeypatch.setenv(allocator_adapter.ENV_POOLS_NEVER_RELEASED, "1")
    adapter = allocator_adapter.AscendAllocatorAdapter(0)
    pool = adapter.new_pool()
    with routing.target(0, host_alloc), adapter.use_pool(pool):
        address = mem.caching_allocator_alloc(3000)
    mem.caching_allocator_delete(address)
    adapter.release_pool(pool)
    del pool
    gc.collect()
    with routing.target(0, host_alloc):
        with npu.graph(npu.NPUGraph()):
            pass
    assert mem.calls["empty_cache"] >= 1


def test_a_torch_npu_without_its_dlpack_import_refuses_non_owning_views(standin):
    """torch_npu's public way to a tensor over NPU memory it did not allocate is
    ``torch.utils.dlpack.from_dlpack`` (releases since November 2025); the stand-in, like
    earlier releases, has no ``torch_npu._C._npu_from_dlpack``: the view is refused,
    naming the releases that have it, instead of a tensor that owns the memory.  The
    capsule itself is checked against stock torch in tests/test_views_host.py."""
    from vmm_backends.ascend.graph_ops import AscendGraphOps
    from vmm_core.errors import BackendError

    with pytest.raises(BackendError, match=r"need torch_npu's DLPack import, which torch_npu "
                                           r"2\.13\.0 lacks .*November 2025.*GraphPool\.keep"):
        AscendGraphOps(0).non_owning_view(0x10000, 64)
    assert standin.log.missing == {"torch_npu._C"}
