"""Graph executables apart from torch: the driver calls an executable cache needs.

torch instantiates a ``CUDAGraph`` once and frees the executable only with the graph.  A
cache that drops executables of sizes not replayed lately and makes them again on demand
needs the captured graph kept (``CUDAGraph(keep_graph=True)``, whose ``raw_cuda_graph()``
gives the ``cudaGraph_t``) and the driver's instantiate, launch and destroy, declared here
as ``cuda.h`` declares them:

* ``CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
  unsigned long long flags)``
* ``CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)``
* ``CUresult cuGraphExecDestroy(CUgraphExec hGraphExec)``
* ``CUresult cuGraphExecUpdate_v2(CUgraphExec hGraphExec, CUgraph hGraph,
  CUgraphExecUpdateResultInfo *resultInfo)`` (CUDA 12+), where
  ``CUgraphExecUpdateResultInfo`` is ``{CUgraphExecUpdateResult result; CUgraphNode
  errorNode; CUgraphNode errorFromNode;}`` and a refused update returns
  ``CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE`` (910) with the reason in ``result``;
* ``CUresult cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream)``;

for an executable made ahead on a thread the framework never used (the driver API is
thread-safe, but each call needs a context current on the calling thread):

* ``CUresult cuCtxGetCurrent(CUcontext *pctx)``, ``CUresult cuCtxSetCurrent(CUcontext
  ctx)``, ``CUresult cuDeviceGet(CUdevice *device, int ordinal)`` and ``CUresult
  cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`` (the context torch uses);
* ``CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)`` with
  ``CU_STREAM_NON_BLOCKING`` (1) and ``CUresult cuStreamSynchronize(CUstream hStream)``:
  the stream such executables are uploaded on, waited for before they are launched
  elsewhere;

and, to tell which graphs one executable may be updated between (their topology):

* ``CUresult cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes)``
  (``nodes`` NULL: the count only);
* ``CUresult cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type)``;
* ``CUresult cuGraphGetEdges_v2(CUgraph hGraph, CUgraphNode *from, CUgraphNode *to,
  CUgraphEdgeData *edgeData, size_t *numEdges)`` (CUDA 12.3+), where ``CUgraphEdgeData``
  is ``{unsigned char from_port; unsigned char to_port; unsigned char type; unsigned char
  reserved[5];}``.

and, to tell which graphs draw random numbers (their kernels take torch's
``at::PhiloxCudaState``, whose offset only the framework's replay advances):

* ``CUresult cuGraphKernelNodeGetParams_v2(CUgraphNode hNode, CUDA_KERNEL_NODE_PARAMS
  *nodeParams)``, where ``CUDA_KERNEL_NODE_PARAMS_v2`` is ``{CUfunction func; unsigned
  int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes; void
  **kernelParams; void **extra; CUkernel kern; CUcontext ctx;}``;
* ``CUresult cuFuncGetName(const char **name, CUfunction hfunc)`` and ``CUresult
  cuKernelGetName(const char **name, CUkernel hfunc)`` (CUDA 12.3+);
* ``CUresult cuGraphChildGraphNodeGetGraph(CUgraphNode hNode, CUgraph *phGraph)``; node
  types ``CU_GRAPH_NODE_TYPE_KERNEL`` (0), ``CU_GRAPH_NODE_TYPE_GRAPH`` (4) and
  ``CU_GRAPH_NODE_TYPE_CONDITIONAL`` (13).

On an H100 (ARCHITECTURE.md section 4) one piece captured at several batch sizes had the
same node types but other kernel functions (cuBLAS picks other GEMMs), and the driver
updated one executable to every size and layer; so the topology is node types and edges,
not functions, and the driver has the last word.
"""

from __future__ import annotations

import ctypes
import threading

from vmm_core.errors import CaptureError
from vmm_core.plugin import Executables

from . import kernel_scan
from .generator_state import GeneratorState, KernelNodeParams

__all__ = ["GraphExecutables", "UPDATE_REFUSED", "estimated_bytes"]

#: ``CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE``: the update broke a rule of the driver's
UPDATE_REFUSED = 910
#: ``CUgraphExecUpdateResult`` values (cuda.h), the reason a refused update gives
_UPDATE_REASONS = {1: "error", 2: "topology changed", 3: "node type changed",
                   4: "function changed", 5: "parameters changed", 6: "not supported",
                   7: "unsupported function change", 8: "attributes changed"}


class _UpdateResultInfo(ctypes.Structure):
    _fields_ = [("result", ctypes.c_int), ("errorNode", ctypes.c_void_p),
                ("errorFromNode", ctypes.c_void_p)]


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


#: an executable's device memory: about 100 KiB plus about 2.5 KiB per node (the fit over
#: 1..256 kernel nodes measured on an H100, ARCHITECTURE.md section 4)
BASE_BYTES, NODE_BYTES = 100 << 10, 2560


#: ``CUgraphNodeType`` values (cuda.h) the random-number reading walks
_KERNEL_NODE, _CHILD_GRAPH_NODE, _CONDITIONAL_NODE = 0, 4, 13
#: a kernel whose (mangled) name holds one of these draws from a generator's philox
#: state: torch's random kernels take ``at::PhiloxCudaState`` by value
_RANDOM_NAME_PARTS = ("philox", "curand")


def estimated_bytes(nodes: int) -> int:
    return BASE_BYTES + NODE_BYTES * nodes


class GraphExecutables(Executables):
    """Instantiate, launch, update and destroy executables of kept CUDA graphs."""

    #: measured on an H200 (driver 580, CUDA 13, torch 2.11): 16 pieces of a Llama MLP
    #: updated from another batch size, uploaded, ran 1.00-1.14x (median 1.03x) the time
    #: of the same pieces instantiated from their graphs, launch after launch (updated
    #: away and back: 1.02-1.15x); a Llama-3-8B piecewise step over updated executables
    #: took 1.16-1.18x (scripts/probe_update_speed.py, scripts/probe_budget_steps.py)
    updated_runs_slower = True

    def __init__(self, device: int = 0) -> None:
        self.device = device
        lib = ctypes.CDLL("libcuda.so.1")
        self._instantiate = lib.cuGraphInstantiateWithFlags
        self._instantiate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                      ctypes.c_ulonglong]
        self._launch = lib.cuGraphLaunch
        self._launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._destroy = lib.cuGraphExecDestroy
        self._destroy.argtypes = [ctypes.c_void_p]
        self._update = lib.cuGraphExecUpdate_v2
        self._update.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.POINTER(_UpdateResultInfo)]
        self._upload = lib.cuGraphUpload
        self._upload.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._get_nodes = lib.cuGraphGetNodes
        self._get_nodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                    ctypes.POINTER(ctypes.c_size_t)]
        self._node_type = lib.cuGraphNodeGetType
        self._node_type.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        self._get_edges = getattr(lib, "cuGraphGetEdges_v2", None)  # CUDA 12.3+
        if self._get_edges is not None:
            self._get_edges.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(_EdgeData),
                                        ctypes.POINTER(ctypes.c_size_t)]
        self._kernel_params = getattr(lib, "cuGraphKernelNodeGetParams_v2", None)
        self._func_name = getattr(lib, "cuFuncGetName", None)  # CUDA 12.3+
        self._kernel_name = getattr(lib, "cuKernelGetName", None)  # CUDA 12.3+
        self._child_graph = lib.cuGraphChildGraphNodeGetGraph
        if self._kernel_params is not None:
            self._kernel_params.argtypes = [ctypes.c_void_p,
                                            ctypes.POINTER(KernelNodeParams)]
        for f in (self._func_name, self._kernel_name):
            if f is not None:
                f.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p]
        self._child_graph.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        #: the default generator's captured-state addresses (probed on first use) and
        #: the one pass over a graph's kernel nodes (the C library built beside this
        #: module); without either, a pool watches operators
        self._state = self._scan = None
        #: why kernels cannot be read here (None where they can)
        self.why_not_reading: str | None = None
        if self._kernel_params is None or self._func_name is None:
            self.why_not_reading = "this driver has no cuGraphKernelNodeGetParams_v2 or " \
                                   "cuFuncGetName (CUDA 12.3+)"
        else:
            self._state = GeneratorState(lib, device, self._kernel_params)
            try:
                self._scan = kernel_scan.KernelScan(self._kernel_params,
                                                    self._state.func_info,
                                                    self._state.kernel_info)
            except (OSError, RuntimeError) as error:
                self._state, self.why_not_reading = None, str(error)
        self.reads_random_kernels = self._scan is not None
        #: kernel function (or CUkernel) -> its name where it draws random numbers, else
        #: "".  Keyed by handle: torch never unloads its modules, but code that unloads
        #: one (CuPy, Numba, a user's Triton) may see a new kernel at an old handle judged
        #: by the old one's name
        self._random_names: dict[int, str] = {}
        self._ctx_get = lib.cuCtxGetCurrent
        self._ctx_get.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._ctx_set = lib.cuCtxSetCurrent
        self._ctx_set.argtypes = [ctypes.c_void_p]
        self._device_get = lib.cuDeviceGet
        self._device_get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self._primary_retain = lib.cuDevicePrimaryCtxRetain
        self._primary_retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self._stream_create = lib.cuStreamCreate
        self._stream_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._stream_sync = lib.cuStreamSynchronize
        self._stream_sync.argtypes = [ctypes.c_void_p]
        for f in (self._instantiate, self._launch, self._destroy, self._update, self._upload,
                  self._get_nodes, self._node_type, self._get_edges, self._ctx_get,
                  self._ctx_set, self._device_get, self._primary_retain, self._stream_create,
                  self._stream_sync, self._kernel_params, self._func_name, self._kernel_name,
                  self._child_graph):
            if f is not None:
                f.restype = ctypes.c_int
        self._bind_lock = threading.Lock()
        self._primary: ctypes.c_void_p | None = None  # the device's primary context
        #: ``made`` on a thread this object made the primary context current on (a
        #: preparer's, which nothing else runs on): its later calls skip the check, a
        #: driver call three times per executable made, each taking the interpreter
        #: from a step's launches
        self._bound = threading.local()
        self._preload_stream: ctypes.c_void_p | None = None

    def _current(self) -> None:
        """Make the device's primary context current on this thread if none is (a thread
        of the executables policy's own, which no framework call ever touched)."""
        if getattr(self._bound, "made", False):
            return
        ctx = ctypes.c_void_p()
        _check(self._ctx_get(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if ctx.value:
            return
        with self._bind_lock:
            if self._primary is None:
                dev, primary = ctypes.c_int(), ctypes.c_void_p()
                _check(self._device_get(ctypes.byref(dev), self.device), "cuDeviceGet")
                _check(self._primary_retain(ctypes.byref(primary), dev.value),
                       "cuDevicePrimaryCtxRetain")
                self._primary = primary
        _check(self._ctx_set(self._primary), "cuCtxSetCurrent")
        self._bound.made = True

    def instantiate(self, graph) -> ctypes.c_void_p:
        """An executable of ``graph`` (a ``torch.cuda.CUDAGraph`` captured with
        ``keep_graph=True``), made with the driver's default flags."""
        self._current()
        handle = ctypes.c_void_p()
        _check(self._instantiate(ctypes.byref(handle), graph.raw_cuda_graph(), 0),
               "cuGraphInstantiateWithFlags")
        return handle

    def launch(self, handle, stream=None) -> None:
        """Launch an executable on ``stream`` (a ``torch.cuda.Stream``, a ``cudaStream_t``
        as an int, or None: torch's current stream of this device), in the caller's
        current context (the pool's device inside its replay blocks)."""
        _check(self._launch(handle, ctypes.c_void_p(self._stream(stream))), "cuGraphLaunch")

    def launcher(self):
        """``launch(handle)`` on torch's current stream of this device, with the driver
        call and the stream lookup bound once (the per-launch path of a step)."""
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is None:
            return self.launch
        launch, device = self._launch, self.device

        def launch_on_current_stream(handle) -> None:
            rc = launch(handle, raw(device))
            if rc:
                _check(rc, "cuGraphLaunch")
        return launch_on_current_stream

    def upload(self, handle, stream=None) -> None:
        """Upload the executable on ``stream`` without running it (what the first launch
        of a new executable does, about 31 us of host time on an H100)."""
        _check(self._upload(handle, ctypes.c_void_p(self._stream(stream))), "cuGraphUpload")

    def preload(self, handle) -> None:
        """Upload on a non-blocking stream of this object's own and wait for it: made on
        another thread, the executable is then ready wherever it is launched next (the
        driver orders an upload before later launches of the same executable; waiting
        here keeps that from resting on it)."""
        self.preload_all([handle])

    def preload_all(self, handles) -> None:
        """:meth:`preload` of every handle, with one wait: each upload on the stream of
        this object's own, then one synchronize (a wait behind the device's work costs
        one wait per batch, not one per executable)."""
        self._current()
        with self._bind_lock:
            if self._preload_stream is None:
                stream = ctypes.c_void_p()
                _check(self._stream_create(ctypes.byref(stream), 1), "cuStreamCreate")
                self._preload_stream = stream
        for handle in handles:
            _check(self._upload(handle, self._preload_stream), "cuGraphUpload")
        _check(self._stream_sync(self._preload_stream), "cuStreamSynchronize")

    def _stream(self, stream) -> int:
        if stream is None:
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what inductor uses
            if raw is not None:
                return raw(self.device)
            return torch.cuda.current_stream(self.device).cuda_stream
        return getattr(stream, "cuda_stream", stream)

    def topology(self, graph):
        """Node types and edges (by node position), not kernels or parameters."""
        raw = graph.raw_cuda_graph()
        nodes = self._nodes(raw)
        types = []
        for node in nodes:
            kind = ctypes.c_int()
            _check(self._node_type(node, ctypes.byref(kind)), "cuGraphNodeGetType")
            types.append(kind.value)
        return tuple(types), self._edges(raw, nodes)

    def sees_generator_state(self) -> bool:
        """Whether :meth:`random_kernels` also reads every kernel's parameters for the
        default generator's captured state (:mod:`.generator_state`): then it sees a
        kernel handed that state inside a struct (attention's dropout) as well as by
        value, and a pool may read kernels instead of watching operators."""
        return self._state is not None and self._state.ready()

    def random_kernels(self, graph) -> tuple[str, ...]:
        """Kernels that draw random numbers, read from the graph's kernel nodes: those
        taking a philox state by name (names cached per function) and, where
        :meth:`sees_generator_state`, those whose parameters hold the default generator's
        captured state; about one driver call a node, where a dispatch-mode watch costs
        a Python call per captured operator.  A conditional node's bodies are not read:
        such a graph counts as drawing, as does one with a kernel whose parameters
        cannot be read."""
        pair = self._state.pair if self.sees_generator_state() else None
        return tuple(self._random_in(graph.raw_cuda_graph(), pair))

    def _random_in(self, raw, pair: bytes | None) -> list:
        found = []
        nodes, count = self._node_array(raw)
        verdicts, funcs, kerns, codes = self._scan.scan(nodes, count, pair)
        names = self._random_names
        kind = ctypes.c_int()
        for i in range(count):
            verdict = verdicts[i]
            if verdict != kernel_scan.NOT_READ:
                func, kern = funcs[i], kerns[i]
                name = names.get(func or kern)
                if name is None:
                    name = self._random_name(func, kern)
                if name:
                    found.append(name)
                elif verdict == kernel_scan.HANDED:
                    found.append(f"{self._name(func, kern)} (handed the generator's "
                                 f"captured state)")
                elif verdict != kernel_scan.PLAIN:
                    found.append(f"<a kernel whose parameters were not read: "
                                 f"{kernel_scan.UNREAD[verdict]}>")
                continue
            _check(self._node_type(nodes[i], ctypes.byref(kind)), "cuGraphNodeGetType")
            if kind.value == _KERNEL_NODE:  # a kernel whose parameters cannot be read
                _check(codes[i], "cuGraphKernelNodeGetParams_v2")
            elif kind.value == _CHILD_GRAPH_NODE:
                child = ctypes.c_void_p()
                _check(self._child_graph(nodes[i], ctypes.byref(child)),
                       "cuGraphChildGraphNodeGetGraph")
                found.extend(self._random_in(child, pair))
            elif kind.value == _CONDITIONAL_NODE:
                found.append("<a conditional node, whose bodies are not read>")
        return found

    def _name(self, func, kern) -> str:
        name = ctypes.c_char_p()
        if func:
            _check(self._func_name(ctypes.byref(name), func), "cuFuncGetName")
        elif kern and self._kernel_name is not None:
            _check(self._kernel_name(ctypes.byref(name), kern), "cuKernelGetName")
        else:
            return "<a kernel this driver cannot name>"
        return (name.value or b"").decode("utf-8", "replace")

    def _random_name(self, func, kern) -> str:
        if not (func or (kern and self._kernel_name is not None)):
            return "<a kernel this driver cannot name>"  # counted as drawing
        text = self._name(func, kern)
        lowered = text.lower()
        known = text if any(part in lowered for part in _RANDOM_NAME_PARTS) else ""
        self._random_names[func or kern] = known
        return known

    def nbytes(self, graph) -> int:
        return estimated_bytes(self._node_count(graph.raw_cuda_graph()))

    def device_free_bytes(self) -> int:
        import torch

        return int(torch.cuda.mem_get_info(self.device)[0])

    def _nodes(self, raw) -> list:
        array, count = self._node_array(raw)
        return list(array[:count])

    def _node_count(self, raw) -> int:
        count = ctypes.c_size_t(0)
        _check(self._get_nodes(raw, None, ctypes.byref(count)), "cuGraphGetNodes")
        return count.value

    def _node_array(self, raw):
        count = ctypes.c_size_t(self._node_count(raw))
        array = (ctypes.c_void_p * count.value)()
        _check(self._get_nodes(raw, array, ctypes.byref(count)), "cuGraphGetNodes")
        return array, count.value

    def _edges(self, raw, nodes: list):
        """Edges as sorted ``(from, to, type)`` node positions; None where the driver has
        no ``cuGraphGetEdges_v2`` (the node types alone then decide)."""
        if self._get_edges is None:
            return None
        count = ctypes.c_size_t(0)
        _check(self._get_edges(raw, None, None, None, ctypes.byref(count)),
               "cuGraphGetEdges_v2")
        n = count.value
        src, dst = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
        data = (_EdgeData * n)()
        _check(self._get_edges(raw, src, dst, data, ctypes.byref(count)), "cuGraphGetEdges_v2")
        position = {node: i for i, node in enumerate(nodes)}
        return tuple(sorted((position.get(src[i], -1), position.get(dst[i], -1), data[i].type)
                            for i in range(count.value)))

    def destroy(self, handle) -> None:
        self._current()
        _check(self._destroy(handle), "cuGraphExecDestroy")

    def update(self, handle, graph) -> str | None:
        """Make the executable ``handle`` run ``graph``'s nodes from its next launch (one
        executable for graphs of one topology, such as the batch sizes of one model).
        None when the driver did it, else its reason (910: the update "was not
        performed", in the driver's words; callers should not launch the handle again on
        that reading alone: the bench destroys it and instantiates anew).  An update does
        not change launches already made (CUDA programming guide, graph update: they are
        not impacted "even if they are running at the time of the update")."""
        self._current()
        info = _UpdateResultInfo()
        rc = self._update(handle, graph.raw_cuda_graph(), ctypes.byref(info))
        if rc == UPDATE_REFUSED:
            return _UPDATE_REASONS.get(info.result, f"result {info.result}")
        _check(rc, "cuGraphExecUpdate_v2")
        return None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CaptureError(f"{what} failed with CUresult {rc}")
