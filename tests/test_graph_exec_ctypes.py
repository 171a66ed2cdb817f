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


# -------------------------------------------------------------------------
# The calls that list a graph's topology, upload, and streams given as objects
# -------------------------------------------------------------------------
NODES = [0xFFFF_FFFF_0000_1000, 0xFFFF_FFFF_0000_2000, 0xFFFF_FFFF_0000_3000]


def test_the_edge_data_struct_has_cuda_h_layout():
    # struct { unsigned char from_port, to_port, type; unsigned char reserved[5]; }
    data = graph_exec._EdgeData
    assert (data.from_port.offset, data.to_port.offset, data.type.offset,
            data.reserved.offset) == (0, 1, 2, 3)
    assert ctypes.sizeof(data) == 8


@pytest.fixture
def listing(calls):
    """cuGraphGetNodes / cuGraphNodeGetType / cuGraphGetEdges_v2 / cuGraphUpload as C
    callbacks of the declared signatures, over a three-node chain."""
    ex = calls["ex"]
    nodes_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                               ctypes.POINTER(ctypes.c_size_t))
    type_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
    edges_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                               ctypes.POINTER(ctypes.c_void_p),
                               ctypes.POINTER(graph_exec._EdgeData),
                               ctypes.POINTER(ctypes.c_size_t))
    upload_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    types = {NODES[0]: 0, NODES[1]: 1, NODES[2]: 0}  # kernel, memcpy, kernel
    edges = [(NODES[0], NODES[1], 0), (NODES[1], NODES[2], 0)]

    def get_nodes(graph, out, count):
        calls.setdefault("graphs", []).append(graph)
        if out:
            for i, node in enumerate(NODES[:count[0]]):
                out[i] = node
        count[0] = len(NODES)
        return 0

    def node_type(node, out):
        out[0] = types[node]
        return 0

    def get_edges(graph, src, dst, data, count):
        if src:
            for i, (a, b, kind) in enumerate(edges[:count[0]]):
                src[i], dst[i] = a, b
                data[i].type = kind
        count[0] = len(edges)
        return 0

    def upload(exe, stream):
        calls["upload"] = (exe, stream)
        return 0

    keep = [nodes_t(get_nodes), type_t(node_type), edges_t(get_edges), upload_t(upload)]
    ex._get_nodes, ex._node_type, ex._get_edges, ex._upload = keep
    calls["keep2"] = keep
    return calls


def test_topology_is_node_types_and_edges_by_position(listing):
    ex = listing["ex"]
    assert ex.topology(_Graph()) == ((0, 1, 0), ((0, 1, 0), (1, 2, 0)))
    assert set(listing["graphs"]) == {_Graph().raw_cuda_graph()}


def test_without_the_edge_call_the_node_types_alone_decide(listing):
    ex = listing["ex"]
    ex._get_edges = None
    assert ex.topology(_Graph()) == ((0, 1, 0), None)


def test_nbytes_is_the_h100_fit_of_the_node_count(listing):
    assert listing["ex"].nbytes(_Graph()) == (100 << 10) + 3 * 2560


def test_launch_and_upload_take_a_stream_object_or_its_handle(calls, listing):
    class Stream:
        cuda_stream = 0xFFFF_FFFF_0000_4000

    ex = calls["ex"]
    ex.launch(ctypes.c_void_p(0x1234), Stream())
    assert calls["launch"] == (0x1234, Stream.cuda_stream)
    ex.upload(ctypes.c_void_p(0x1234), Stream.cuda_stream)
    assert listing["upload"] == (0x1234, Stream.cuda_stream)


def test_without_a_stream_the_launch_reads_torchs_current_raw_stream(calls, listing,
                                                                     monkeypatch):
    import torch

    asked = []

    def current_raw(device):
        asked.append(device)
        return 0xFFFF_FFFF_0000_5000

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", current_raw, raising=False)
    ex = calls["ex"]
    ex.device = 3
    ex.launch(ctypes.c_void_p(0x1234))
    ex.upload(ctypes.c_void_p(0x1234))
    assert asked == [3, 3]
    assert calls["launch"] == listing["upload"] == (0x1234, 0xFFFF_FFFF_0000_5000)
