"""Where torch's generator state is, for telling the kernels of a captured graph that were
handed it.

Only torch's own replay advances the philox offset of a generator a graph drew from, so
a pool must tell such graphs apart.  While a stream captures, torch hands every random
kernel an ``at::PhiloxCudaState`` that holds two device pointers, the generator state's
``seed_extragraph_`` and ``offset_extragraph_`` (``CUDAGeneratorImpl::philox_cuda_state``
in ``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``), by value (the elementwise random
kernels) or inside a parameter struct passed by value (flash and memory-efficient
attention's params; cuDNN attention's seed-unpacking kernel).  So a kernel node whose
parameter bytes hold those addresses drew from the device's default generator, whatever
its name or its operator.  ``kernel_scan.c`` looks for the two addresses together (one
pass over a graph's nodes), in that order, at an 8-byte boundary and followed by the
``captured_`` flag, as the struct lays them out: a parameter struct's unused fields are
the host stack's leftovers (TensorIterator's offset calculator has slots for 25
dimensions), which can hold one address alone.

Both tensors are made when the first graph registers with the generator state and freed
when the last one leaves (``CUDAGeneratorState::register_graph`` / ``unregister_graph``),
so their addresses hold only while some graph stays registered.  A probe graph, captured
once per backend object (a pool's graph ops) with one ``uniform_`` and kept (never
instantiated) as long as that object, keeps them: its one kernel's ``PhiloxCudaState``
gives the two addresses (``ATen/cuda/detail/PhiloxCudaStateRaw.cuh``: the ``seed_`` and
``offset_`` payloads, 8 bytes each, then ``offset_intragraph_``, then the ``captured_``
flag; read on torch 2.11.0+cu130, the parameter is 32 bytes with the flag at byte 24,
and a 24-byte layout with the flag at byte 20 is accepted too).

Driver calls, as ``cuda.h`` declares them (CUDA 12.4+): ``CUresult
cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t *paramOffset, size_t
*paramSize)`` and ``CUresult cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex,
size_t *paramOffset, size_t *paramSize)``, which return ``CUDA_ERROR_INVALID_VALUE`` (1)
past the last parameter.

Not seen: a generator other than the device's default one (a graph that registers one
with ``register_generator_state`` is counted as drawing by the kept graph instead), a
kernel reading the state through a pointer to device memory, and graphs captured after
``graphsafe_set_state`` replaced the default generator's state.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["GeneratorState", "KernelNodeParams", "PHILOX_STATE_BYTES"]

#: sizeof(at::PhiloxCudaState) -> the offset of its ``captured_`` flag (kernel_scan.c
#: looks for the flag at both)
PHILOX_STATE_BYTES = {24: 20, 32: 24}


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (cuda.h), what ``cuGraphKernelNodeGetParams_v2``
    fills."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class GeneratorState:
    """The default generator's two captured-state addresses on one device, found by a
    probe capture (``kernel_scan`` looks for them in every graph a pool reads).
    ``ready()`` probes once; any failure leaves it not ready (the pool then watches
    operators instead), with the reason in ``why_not``."""

    def __init__(self, lib, device: int, kernel_params) -> None:
        self.device = device
        self._kernel_params = kernel_params  # (node, params struct) -> CUresult
        self.func_info = getattr(lib, "cuFuncGetParamInfo", None)
        self.kernel_info = getattr(lib, "cuKernelGetParamInfo", None)
        for f in (self.func_info, self.kernel_info):
            if f is not None:
                f.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
                f.restype = ctypes.c_int
        self._lock = threading.Lock()
        self._probed = False
        #: both addresses as the struct holds them (16 bytes), once probed
        self.pair: bytes | None = None
        self._keep: tuple = ()  # the probe graph and its output, registered for good
        self.why_not: str | None = None

    def ready(self) -> bool:
        if not self._probed:
            from vmm_core.plugin import backend_capture

            # the tagged-memory lock before this one, in the order a capture space takes
            # both (a space's capture reads kernels, which asks this)
            with backend_capture("the probe of the generator's captured state"), self._lock:
                if not self._probed:
                    try:
                        self._probe()
                    except Exception as error:  # noqa: BLE001 - the pool watches operators
                        self.why_not = f"{type(error).__name__}: {error}"
                    self._probed = True
        return self.why_not is None

    def _probe(self) -> None:
        if self.func_info is None:
            raise RuntimeError("this driver has no cuFuncGetParamInfo (CUDA 12.4+)")
        import torch

        with torch.cuda.device(self.device):
            if torch.cuda.is_current_stream_capturing():
                # a pool made inside a capture: the probe would join that capture
                raise RuntimeError("the pool was made while this thread captures")
            out = torch.empty(1, device="cuda")  # before the capture: it allocates nothing
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.stream(stream):
                # thread-local: another thread's capture in global mode is left alone
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out.uniform_()
                finally:
                    graph.capture_end()
        raw = graph.raw_cuda_graph()
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_size_t(0)
        lib.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_size_t)]
        if lib.cuGraphGetNodes(raw, None, ctypes.byref(count)):
            raise RuntimeError("cuGraphGetNodes failed on the probe graph")
        nodes = (ctypes.c_void_p * count.value)()
        lib.cuGraphGetNodes(raw, nodes, ctypes.byref(count))
        params = KernelNodeParams()
        for node in nodes[:count.value]:
            ctypes.memset(ctypes.byref(params), 0, ctypes.sizeof(params))
            if self._kernel_params(node, ctypes.byref(params)):
                continue
            pair = self.pair_in(params)
            if pair is not None:
                self.pair, self._keep = pair, (graph, out, stream)
                return
        raise RuntimeError("the probe's random kernel holds no captured PhiloxCudaState")

    def pair_in(self, params) -> bytes | None:
        """The two addresses of a ``PhiloxCudaState`` passed by value, captured, with
        both set, among a kernel node's ``kernelParams`` (the probe's ``uniform_``
        passes it so); None where there is none, or where the node passes its parameters
        in ``extra`` (the probe then fails and the pool watches operators)."""
        handle = params.func or params.kern
        info = self.func_info if params.func else self.kernel_info
        if not handle or info is None or not params.kernel_params:
            return None
        values = ctypes.cast(params.kernel_params, ctypes.POINTER(ctypes.c_void_p))
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        index = 0
        while info(handle, index, ctypes.byref(offset), ctypes.byref(size)) == 0:
            flag = PHILOX_STATE_BYTES.get(size.value)
            if flag is not None:
                blob = ctypes.string_at(values[index], size.value)
                if blob[flag] == 1 and int.from_bytes(blob[0:8], "little") and \
                        int.from_bytes(blob[8:16], "little"):
                    return blob[0:16]
            index += 1
        return None
