"""The ctypes side of the CUDA graph-executable calls, which needs no GPU.

``vmm_backends/cuda/graph_exec.py`` declares its libcuda calls and structs by hand.
A wrong layout or argument type would first show on the device, as garbage in a refused
update's reason or a crash.  Here the driver's functions are replaced by C callbacks of
the declared signatures, so what is checked is ctypes' marshalling of our declarations:
the struct as ``cuda.h`` lays it out, the out-parameter of instantiate, and the reason read
back from a refused update.  Whether the driver refuses or accepts is the device's to say.
"""

from __future__ import annotations

import ctypes
import threading

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

    ptr_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
    dev_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
    retain_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int)
    stream_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
    seen["current"] = 0xC0  # a context is current unless a test says otherwise

    def ctx_get(out):
        seen["ctx_get"] = seen.get("ctx_get", 0) + 1
        out[0] = seen["current"]
        return 0

    def ctx_set(ctx):
        seen.setdefault("ctx_set", []).append(ctx)
        seen["current"] = ctx
        return 0

    def device_get(out, ordinal):
        seen.setdefault("device_get", []).append(ordinal)
        out[0] = 10 + ordinal
        return 0

    def primary_retain(out, device):
        seen.setdefault("retain", []).append(device)
        out[0] = 0xFFFF_FFFF_0000_C000
        return 0

    def stream_create(out, flags):
        seen.setdefault("stream_create", []).append(flags)
        out[0] = 0xFFFF_FFFF_0000_5700
        return 0

    def stream_sync(stream):
        seen.setdefault("stream_sync", []).append(stream)
        return 0

    keep = [inst_t(instantiate), upd_t(update), launch_t(launch), void1_t(destroy),
            ptr_t(ctx_get), void1_t(ctx_set), dev_t(device_get), retain_t(primary_retain),
            stream_t(stream_create), void1_t(stream_sync)]
    (ex._instantiate, ex._update, ex._launch, ex._destroy, ex._ctx_get, ex._ctx_set,
     ex._device_get, ex._primary_retain, ex._stream_create, ex._stream_sync) = keep
    ex.device, ex._primary, ex._preload_stream = 0, None, None
    ex._bind_lock, ex._bound = threading.Lock(), threading.local()
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


# -------------------------------------------------------------------------
# Executables made ahead, on a thread of the policy's own
# -------------------------------------------------------------------------
def test_a_thread_without_a_context_gets_the_devices_primary_context_once(calls):
    ex = calls["ex"]
    ex.device = 2
    calls["current"] = None  # a thread no framework call ever touched
    handle = ex.instantiate(_Graph())
    assert calls["device_get"] == [2] and calls["retain"] == [12]
    assert calls["ctx_set"] == [0xFFFF_FFFF_0000_C000]
    asked = calls["ctx_get"]
    # this thread's context is the one it set: not asked again (a driver call per use,
    # taken from a step's launches on a preparer's thread)
    assert ex.update(handle, _Graph()) is None
    ex.destroy(ex.instantiate(_Graph()))
    assert calls["ctx_get"] == asked

    def another_such_thread():
        calls["current"] = None
        ex.destroy(handle)

    worker = threading.Thread(target=another_such_thread)
    worker.start()
    worker.join()
    assert calls["ctx_get"] == asked + 1  # asked there, and given the context retained
    assert calls["retain"] == [12] and len(calls["ctx_set"]) == 2


def test_a_thread_with_a_current_context_is_asked_at_every_call(calls):
    """The framework may make another context current on its own threads (another
    device's): the one found is used, and found again at each call."""
    ex = calls["ex"]
    ex.destroy(ex.instantiate(_Graph()))
    calls["current"] = 0xC1
    ex.destroy(ex.instantiate(_Graph()))
    assert calls["ctx_get"] == 4 and "ctx_set" not in calls


def test_a_thread_with_a_current_context_is_left_as_it_is(calls):
    ex = calls["ex"]
    ex.destroy(ex.instantiate(_Graph()))
    assert "ctx_set" not in calls and "retain" not in calls


def test_preload_uploads_on_a_stream_of_its_own_and_waits_for_it(calls, listing):
    ex = calls["ex"]
    for _ in range(2):
        ex.preload(ctypes.c_void_p(0x1234))
    stream = 0xFFFF_FFFF_0000_5700
    assert calls["stream_create"] == [1]  # CU_STREAM_NON_BLOCKING, made once
    assert calls["upload"] == (0x1234, stream) and calls["stream_sync"] == [stream, stream]


def test_the_bound_launcher_launches_on_torchs_current_raw_stream(calls, monkeypatch):
    import torch

    from vmm_core.errors import CaptureError

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream",
                        lambda device: 0xFFFF_FFFF_0000_6000 + device, raising=False)
    ex = calls["ex"]
    ex.device = 1
    launch = ex.launcher()
    launch(ctypes.c_void_p(0x1234))
    assert calls["launch"] == (0x1234, 0xFFFF_FFFF_0000_6001)
    failing = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
        lambda exe, stream: 719)
    calls["keep"].append(failing)
    ex._launch = failing
    with pytest.raises(CaptureError, match="cuGraphLaunch failed with CUresult 719"):
        ex.launcher()(ctypes.c_void_p(0x1234))

