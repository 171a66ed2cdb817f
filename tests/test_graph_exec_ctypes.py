"""The ctypes side of the CUDA graph-executable calls, which needs no GPU.

``vmm_backends/cuda/graph_exec.py`` declares four libcuda calls and one struct by hand.
A wrong layout or argument type would first show on the device, as garbage in a refused
update's reason or a crash.  Here the driver's functions are replaced by C callbacks of
the declared signatures, so what is checked is ctypes' marshalling of our declarations:
the struct as ``cuda.h`` lays it out, the out-parameter of instantiate, and the reason read
back from a refused update.  Whether the driver refuses or accepts is the device's to say.
"""

from __future__ import annotations

import ctypes

import pytest

from vmm_backends.cuda import graph_exec


def test_the_update_result_struct_has_cuda_h_layout():
    # struct { CUgraphExecUpdateResult result; CUgraphNode errorNode;
    #          CUgraphNode errorFromNode; }: a 4-byte enum, padded, then two pointers
    info = graph_exec._UpdateResultInfo
    assert ctypes.sizeof(ctypes.c_void_p) == 8
    assert (info.result.offset, info.errorNode.offset, info.errorFromNode.offset) == (0, 8, 16)
    assert ctypes.sizeof(info) == 24
    assert graph_exec.UPDATE_REFUSED == 910  # CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE


class _Graph:
    def raw_cuda_graph(self) -> int:
        return 0xFFFF_FFFF_FFFF_F000  # an address above 2**63: ctypes must pass it whole


@pytest.fixture
def calls():
    """GraphExecutables over C callbacks of the declared signatures (no libcuda)."""
    seen: dict = {}
    ex = object.__new__(graph_exec.GraphExecutables)

    inst_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.c_void_p, ctypes.c_ulonglong)
    upd_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.POINTER(graph_exec._UpdateResultInfo))
    void1_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    launch_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def instantiate(out, graph, flags):
        seen["instantiate"] = (graph, flags)
        out[0] = 0x1234
        return 0

    def update(exe, graph, info):
        seen["update"] = (exe, graph)
        code = seen.get("refuse", 0)
        info[0].result = code
        return graph_exec.UPDATE_REFUSED if code else 0

    def launch(exe, stream):
        seen["launch"] = (exe, stream)
        return 0

    def destroy(exe):
        seen["destroy"] = exe
        return seen.get("destroy_rc", 0)

    keep = [inst_t(instantiate), upd_t(update), launch_t(launch), void1_t(destroy)]
    ex._instantiate, ex._update, ex._launch, ex._destroy = keep
    seen["ex"], seen["keep"] = ex, keep
    return seen


def test_instantiate_launch_update_and_destroy_pass_handles_whole(calls):
    ex = calls["ex"]
    handle = ex.instantiate(_Graph())
    assert handle.value == 0x1234
    assert calls["instantiate"] == (_Graph().raw_cuda_graph(), 0)
    ex.launch(handle, 0)
    assert calls["launch"] == (0x1234, None)  # stream 0: NULL, the legacy default stream
    assert ex.update(handle, _Graph()) is None
    assert calls["update"] == (0x1234, _Graph().raw_cuda_graph())
    ex.destroy(handle)
    assert calls["destroy"] == 0x1234


@pytest.mark.parametrize("code, reason", [(2, "topology changed"), (4, "function changed"),
                                          (8, "attributes changed"), (42, "result 42")])
def test_a_refused_update_reads_the_drivers_reason(calls, code, reason):
    calls["refuse"] = code
    assert calls["ex"].update(ctypes.c_void_p(0x1234), _Graph()) == reason


def test_a_failing_call_raises_naming_it(calls):
    from vmm_core.errors import CaptureError

    calls["destroy_rc"] = 400
    with pytest.raises(CaptureError, match="cuGraphExecDestroy failed with CUresult 400"):
        calls["ex"].destroy(ctypes.c_void_p(0x1234))
