"""Ascend and MLU declare no graph executables apart from the framework (their graph
classes offer no kept graph, see ``executables()`` in their graph ops): a GraphPool there
refuses a budget, naming the capability, and by default keeps today's behaviour.

Run against the emulated vendor drivers and the CPU stand-ins of torch_npu and torch_mlu.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

import vmm_core
from vmm_core.errors import CaptureError, VMMFallbackWarning

STANDINS = Path(__file__).resolve().parent / "standins"
pytestmark = pytest.mark.usefixtures("clean_tags")


def _emulated(platform: str):
    import emulated

    try:
        return emulated.backend_for(platform)
    except emulated.NotBuildable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def npu(monkeypatch):
    """The stand-in torch_npu and the Ascend backend over the emulated driver."""
    assert "torch_npu" not in sys.modules, "a real torch_npu is imported"
    monkeypatch.syspath_prepend(str(STANDINS))
    torch_npu = importlib.import_module("torch_npu")
    from vmm_backends.ascend import allocator_adapter

    monkeypatch.setattr(allocator_adapter, "_pluggable", None)
    monkeypatch.setattr(allocator_adapter, "graph_pool_verdict",
                        lambda: allocator_adapter.release_path_verdict(torch_npu.__version__))
    backend = _emulated("ascend")
    monkeypatch.setattr(backend, "_caps", {})
    # the adapter core keeps is made with this stand-in: it must not outlive it
    monkeypatch.setattr(backend, "_adapters", {})
    yield backend, torch_npu.npu
    import emulated

    emulated.release("ascend")
    for name in [k for k in sys.modules if k == "torch_npu" or k.startswith("torch_npu.")]:
        del sys.modules[name]


@pytest.fixture
def mlu(monkeypatch):
    """The stand-in torch_mlu (as torch.mlu) and the MLU backend over the emulated driver."""
    saved = {k: v for k, v in sys.modules.items()
             if k == "torch_mlu" or k.startswith("torch_mlu.")}
    monkeypatch.syspath_prepend(str(STANDINS))
    pkg = importlib.import_module("torch_mlu")
    monkeypatch.setattr(torch, "mlu", pkg.mlu, raising=False)
    from vmm_backends.mlu import allocator_adapter

    monkeypatch.setattr(allocator_adapter, "_allocator", None)
    backend = _emulated("mlu")
    yield backend, pkg.mlu
    import emulated

    emulated.release("mlu")
    for name in [k for k in sys.modules if k == "torch_mlu" or k.startswith("torch_mlu.")]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.mark.parametrize("vendor", ["npu", "mlu"])
def test_vendor_graph_ops_declare_no_executables_and_refuse_kept_graphs(vendor):
    from vmm_backends.ascend.graph_ops import AscendGraphOps
    from vmm_backends.mlu.graph_ops import MLUGraphOps

    ops = {"npu": AscendGraphOps, "mlu": MLUGraphOps}[vendor](0)
    assert ops.executables() is None
    with pytest.raises(CaptureError, match=r"cannot keep a captured graph apart from its "
                                           r"executable \(GraphOps.executables\(\) is None\)"):
        ops.new_graph(keep=True)


@pytest.mark.parametrize("executables", [2, vmm_core.ExecutablePolicy(),
                                         vmm_core.ExecutablePolicy(max_bytes=1 << 20)])
@pytest.mark.parametrize("vendor", ["npu", "mlu"])
def test_a_budget_on_a_vendor_without_executables_is_refused_naming_the_capability(
        request, vendor, executables):
    backend, _ = request.getfixturevalue(vendor)
    with pytest.raises(CaptureError, match=r"offer no graph executables apart from the "
                                           r"framework \(GraphOps.executables\(\) is None\)"
                                           r".* Drop executables="):
        vmm_core.GraphPool(0, backend=backend, executables=executables)
    assert vmm_core.memory_summary() == {}  # refused before anything was registered


@pytest.mark.parametrize("vendor", ["npu", "mlu"])
def test_by_default_a_vendor_pool_keeps_the_frameworks_graphs(request, vendor):
    backend, module = request.getfixturevalue(vendor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # MLU: no custom-allocator pool, a shared one
        pool = vmm_core.GraphPool(0, backend=backend)
    assert all(issubclass(w.category, VMMFallbackWarning) for w in caught)
    graph = pool.new_graph()
    cls = getattr(module, {"npu": "NPUGraph", "mlu": "MLUGraph"}[vendor])
    assert type(graph) is cls
    with pool.space(4) as handle:
        with module.graph(graph, pool=handle):
            pass
    with pool.replaying(4):
        graph.replay()
        graph.replay()
    replays = getattr(graph, "replay_count", None)
    if replays is None:
        replays = graph.replays
    assert replays == 2 and pool.stats()["executables"] is None
    pool.close()
