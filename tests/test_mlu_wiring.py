"""MLU allocator adapter and graph ops, wired against the CPU stand-in of torch_mlu.

torch_mlu is not on PyPI and needs Neuware, so tests/standins/torch_mlu mirrors the public
names the backend uses.  Three guards keep that stand-in honest:

(a) the adapter and graph ops run end to end against it;
(b) every attribute they read from ``torch_mlu`` / ``torch.mlu`` goes through a strict proxy:
    a name missing from the stand-in fails the test, and every name read must be listed in
    ``REAL_SIGNATURES``;
(c) the stand-in's signatures equal the real ones recorded in ``REAL_SIGNATURES``, copied
    from Cambricon/torch_mlu, branch r2.4_develop, commit 9e95f972d3bf (fetched from the
    public GitHub repository).  No MLU hardware is involved.
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

from vmm_backends.mlu import allocator_adapter, vmm_api
from vmm_core.errors import CaptureError
from vmm_core.memory import routing
from vmm_core.memory.shim import ALLOC_SYMBOL, FREE_SYMBOL, load_shim

STANDINS = Path(__file__).resolve().parent / "standins"
SOURCE = "Cambricon/torch_mlu@r2.4_develop (9e95f972d3bf)"

#: name as the backend reads it -> (member compared, file:line in SOURCE, real signature)
REAL_SIGNATURES = {
    "torch.mlu.memory.MLUPluggableAllocator": (
        "__init__", "torch_mlu/mlu/memory.py:741",
        "(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str)"),
    "torch.mlu.memory.MLUPluggableAllocator.allocator": (
        None, "torch_mlu/mlu/memory.py:735", "(self)"),
    "torch.mlu.memory.change_current_allocator": (
        None, "torch_mlu/mlu/memory.py:768", "(allocator: _MLUAllocator) -> None"),
    "torch.mlu.MLUGraph": ("__new__", "torch_mlu/mlu/graphs.py:46", "(cls)"),
    "torch.mlu.MLUGraph.capture_begin": (
        None, "torch_mlu/mlu/graphs.py:50", "(self, pool=None, capture_error_mode='relaxed')"),
    "torch.mlu.MLUGraph.capture_end": (None, "torch_mlu/mlu/graphs.py:70", "(self)"),
    "torch.mlu.MLUGraph.replay": (None, "torch_mlu/mlu/graphs.py:81", "(self)"),
    "torch.mlu.MLUGraph.reset": (None, "torch_mlu/mlu/graphs.py:87", "(self)"),
    "torch.mlu.MLUGraph.pool": (None, "torch_mlu/mlu/graphs.py:93", "(self)"),
    "torch.mlu.graph": (
        "__init__", "torch_mlu/mlu/graphs.py:143",
        "(self, mlu_graph, pool=None, stream=None, capture_error_mode: str = 'relaxed')"),
    "torch.mlu.graph_pool_handle": (None, "torch_mlu/mlu/graphs.py:34", "()"),
    "torch.mlu.synchronize": (
        None, "torch_mlu/mlu/__init__.py:278", "(device: _device_t = None) -> None"),
    "torch.mlu.current_stream": (
        None, "torch_mlu/mlu/__init__.py:726",
        "(device: Optional[_device_t] = None) -> Stream"),
    "torch.mlu.stream": (
        None, "torch_mlu/mlu/__init__.py:892",
        "(stream: Optional['torch.mlu.Stream']) -> StreamContext"),
    "torch.mlu.Stream": (
        "__new__", "torch_mlu/mlu/streams.py:32", "(cls, device=None, priority=0, **kwargs)"),
    "torch.mlu.Stream.wait_stream": (None, "torch_mlu/mlu/streams.py:54", "(self, stream)"),
    # torch_mlu/mlu/__init__.py:940-941 export these two in torch.mlu's __all__
    "torch.mlu.MLUPluggableAllocator": (
        "__init__", "torch_mlu/mlu/memory.py:741",
        "(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str)"),
    "torch.mlu.change_current_allocator": (
        None, "torch_mlu/mlu/memory.py:768", "(allocator: _MLUAllocator) -> None"),
    "torch_mlu.__version__": (None, "torch_mlu/__init__.py:34", None),  # a str attribute
}
#: absent from every branch of the real repository (git grep MemPool: no hit in torch_mlu/)
REAL_ABSENT = ("torch.mlu.MemPool", "torch.mlu.use_mem_pool", "torch.mlu.memory.MemPool")


class _Strict:
    """Proxy of a stand-in module that records reads and refuses names it lacks."""

    def __init__(self, target, label: str, seen: list, missing: list) -> None:
        object.__setattr__(self, "_t", (target, label, seen, missing))

    def __getattr__(self, name):
        target, label, seen, missing = object.__getattribute__(self, "_t")
        if name.startswith("__") and name.endswith("__") and name != "__version__":
            return getattr(target, name)  # the import system's own reads (__spec__, ...)
        path = f"{label}.{name}"
        seen.append(path)
        if not hasattr(target, name):
            missing.append(path)
            raise AttributeError(f"vmm_backends.mlu reads {path}, which the torch_mlu "
                                 f"stand-in lacks: add it (with the real signature) or stop "
                                 f"using it")
        value = getattr(target, name)
        if isinstance(value, types.ModuleType):
            return _Strict(value, path, seen, missing)
        return value


def _drop_torch_mlu_modules():
    for key in [k for k in sys.modules if k == "torch_mlu" or k.startswith("torch_mlu.")]:
        del sys.modules[key]


@pytest.fixture
def standin(monkeypatch):
    """The stand-in imported as ``torch_mlu`` and ``torch.mlu``, behind strict proxies."""
    saved = {k: v for k, v in sys.modules.items()
             if k == "torch_mlu" or k.startswith("torch_mlu.")}
    _drop_torch_mlu_modules()
    monkeypatch.syspath_prepend(str(STANDINS))
    pkg = importlib.import_module("torch_mlu")
    assert Path(pkg.__file__).resolve().is_relative_to(STANDINS), pkg.__file__
    seen: list = []
    missing: list = []
    sys.modules["torch_mlu"] = _Strict(pkg, "torch_mlu", seen, missing)
    monkeypatch.setattr(torch, "mlu", _Strict(pkg.mlu, "torch.mlu", seen, missing),
                        raising=False)
    monkeypatch.setattr(allocator_adapter, "_allocator", None)
    ns = types.SimpleNamespace(pkg=pkg, seen=seen, missing=missing)
    try:
        yield ns
    finally:
        _drop_torch_mlu_modules()
        sys.modules.update(saved)
    assert not missing, f"names missing from the stand-in: {missing}"


def _assert_known(seen):
    unknown = sorted({p for p in seen if p not in REAL_SIGNATURES
                      and not any(k.startswith(p + ".") for k in REAL_SIGNATURES)})
    assert not unknown, (f"vmm_backends.mlu reads {unknown}: record their real signatures "
                         f"from {SOURCE} in REAL_SIGNATURES")


# ------------------------------------------------------------------ (a) + (b): wiring
def test_graph_ops_warm_up_capture_and_replay_on_one_stream(standin):
    ops = vmm_api.backend.vmm_graph_ops(device=0)
    assert ops.device_type == "mlu"
    streams = []

    def fn():
        streams.append(torch.mlu.current_stream(0))
        return torch.ones(3) * 2

    ops.warmup(fn)
    g = ops.new_graph()
    pool = ops.shared_pool_handle()
    out = ops.capture(g, fn, pool)
    assert torch.equal(out, torch.full((3,), 2.0))
    assert g.pool() == pool and g.capture_error_mode == "relaxed"
    assert streams[0] is streams[1], "warm-up and capture must use the same stream"
    ops.replay(g)
    ops.replay(g)
    assert g.replays == 2
    ops.synchronize()
    ops.reset(g)
    private = ops.new_graph()
    ops.capture(private, fn, None)  # pool=None: a private pool
    assert private.pool() is not None and private.pool() != pool
    _assert_known(standin.seen)


def test_adapter_loads_the_shim_once_and_refuses_pools(standin):
    adapter = vmm_api.backend.vmm_allocator_adapter(device=0)
    assert adapter.supports_pools is False
    for call in (adapter.new_pool, lambda: adapter.use_pool(None),
                 lambda: adapter.pool_handle(None), lambda: adapter.live_blocks(None)):
        with pytest.raises(CaptureError, match="no MemPool.*shared pool"):
            call()

    alloc = adapter.pluggable_allocator()
    assert alloc is adapter.pluggable_allocator(), "one allocator object per process"
    shim = load_shim()
    assert alloc.path == shim.path
    addr = lambda name: ctypes.cast(getattr(shim.lib, name), ctypes.c_void_p).value  # noqa: E731
    assert (alloc.alloc_fn, alloc.free_fn) == (addr(ALLOC_SYMBOL), addr(FREE_SYMBOL))

    class Target:
        def allocate(self, size):
            return 0x7000_0000 + size

    with routing.target(0, Target()):  # the shim callback routes to vmm_core
        assert shim.lib.vmm_shim_alloc(4096, 0, None) == 0x7000_0000 + 4096

    adapter.install_as_current_allocator()
    assert standin.pkg.mlu.memory.current_allocator == alloc.allocator()
    standin.pkg.mlu.memory.current_allocator = None
    _assert_known(standin.seen)


def test_a_call_missing_from_the_standin_fails(standin):
    with pytest.raises(AttributeError, match="stand-in lacks"):
        torch.mlu.MemPool  # noqa: B018  (what a MemPool-based adapter would read)
    standin.missing.clear()


# ------------------------------------------------------------------ (c): signatures
def _real(text: str) -> inspect.Signature:
    ns: dict = {}
    exec(f"from __future__ import annotations\ndef _f{text}: pass", ns)
    return inspect.signature(ns["_f"])


def _shape(sig: inspect.Signature):
    return [(p.name, p.kind, p.default) for p in sig.parameters.values()]


def _resolve(pkg, name: str):
    parts = name.split(".")
    obj = pkg if parts[0] == "torch_mlu" else pkg.mlu
    for part in parts[2 if parts[0] == "torch" else 1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", sorted(REAL_SIGNATURES))
def test_standin_signatures_match_real_torch_mlu(standin, name):
    member, where, text = REAL_SIGNATURES[name]
    obj = _resolve(standin.pkg, name)
    if text is None:
        assert isinstance(obj, str), f"{name} must be a str, as at {SOURCE} {where}"
        return
    target = getattr(obj, member) if member else obj
    assert _shape(inspect.signature(target)) == _shape(_real(text)), \
        f"stand-in {name} differs from {SOURCE} {where}: {text}"


@pytest.mark.parametrize("name", REAL_ABSENT)
def test_standin_has_no_mempool_like_the_real_package(standin, name):
    parts = name.split(".")
    obj = standin.pkg.mlu
    for part in parts[2:-1]:
        obj = getattr(obj, part)
    assert not hasattr(obj, parts[-1])



def test_capture_entry_collects_garbage_and_empties_the_cache(standin):
    """torch_mlu's graph.__enter__ runs gc.collect() and torch.mlu.empty_cache() before
    capture_begin (torch_mlu/mlu/graphs.py:168-172): garbage held in reference cycles is
    gone, and the cache was emptied, before the first captured op runs."""
    import gc
    import weakref

    class Cycle:
        pass

    ops = vmm_api.backend.vmm_graph_ops(device=0)
    ops.warmup(lambda: torch.ones(2))
    memory = standin.pkg.mlu.memory
    garbage = Cycle()
    garbage.me = garbage  # only the cycle collector frees it
    gone = weakref.ref(garbage)
    del garbage
    seen_at_capture = {}

    def fn():
        seen_at_capture["alive"] = gone() is not None
        seen_at_capture["empty_cache"] = memory.empty_cache_calls
        return torch.ones(2)

    before = memory.empty_cache_calls
    was_enabled = gc.isenabled()
    gc.disable()  # so only the capture entry can collect the cycle
    try:
        ops.capture(ops.new_graph(), fn, ops.shared_pool_handle())
    finally:
        if was_enabled:
            gc.enable()
    assert seen_at_capture == {"alive": False, "empty_cache": before + 1}


def test_non_owning_views_are_refused_saying_torch_mlu_has_no_way_to_make_one():
    """torch_mlu marks from_dlpack and frombuffer unsupported and binds no from_blob: a
    non-owning view of MLU memory cannot be made, and the refusal says what to do
    instead.  Nothing of torch_mlu is needed to say so."""
    from vmm_backends.mlu.graph_ops import MLUGraphOps
    from vmm_core.errors import BackendError

    with pytest.raises(BackendError, match=r"torch_mlu offers no public way.*GraphPool\.keep"):
        MLUGraphOps(0).non_owning_view(0x10000, 64)
    assert "torch_mlu" not in sys.modules
