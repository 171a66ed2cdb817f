"""Which kernels of a captured graph were handed torch's generator state.

Only torch's own replay advances the philox offset of a generator a graph drew from, so
a pool must tell such graphs apart.  While a stream captures, torch hands every random
kernel an ``at::PhiloxCudaState`` that holds two device pointers, the generator state's
``seed_extragraph_`` and ``offset_extragraph_`` (``CUDAGeneratorImpl::philox_cuda_state``
in ``aten/src/ATen/cuda/CUDAGeneratorImpl.cpp``), by value (the elementwise random
kernels) or inside a parameter struct passed by value (flash and memory-efficient
attention's params; cuDNN attention's seed-unpacking kernel).  So a kernel node whose
parameter bytes hold those addresses drew from the device's default generator, whatever
its name or its operator.  The two addresses are looked for together, in that order, at
an 8-byte boundary and followed by the ``captured_`` flag, as the struct lays them out:
a parameter struct's unused fields are the host stack's leftovers (TensorIterator's
offset calculator has slots for 25 dimensions), which can hold one address alone.

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

#: sizeof(at::PhiloxCudaState) -> the offset of its ``captured_`` flag
PHILOX_STATE_BYTES = {24: 20, 32: 24}
#: parameters narrower than the state cannot hold it
_NARROWEST = min(PHILOX_STATE_BYTES)
_INVALID_VALUE = 1


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (cuda.h), what ``cuGraphKernelNodeGetParams_v2``
    fills."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class GeneratorState:
    """The default generator's two captured-state addresses on one device, and a reading
    of kernel parameters for them.  ``ready()`` probes once; any failure leaves it not
    ready (the pool then watches operators instead), with the reason in ``why_not``."""

    def __init__(self, lib, device: int, kernel_params) -> None:
        self.device = device
        self._kernel_params = kernel_params  # (node, params struct) -> CUresult
        self._func_info = getattr(lib, "cuFuncGetParamInfo", None)
        self._kernel_info = getattr(lib, "cuKernelGetParamInfo", None)
        for f in (self._func_info, self._kernel_info):
            if f is not None:
                f.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
                f.restype = ctypes.c_int
        self._lock = threading.Lock()
        self._probed = False
        self._needles: tuple[bytes, bytes] = (b"", b"")
        self._pair = b""  # both addresses as the struct holds them
        self._keep: tuple = ()  # the probe graph and its output, registered for good
        #: function (or CUkernel) handle -> ((index, offset, size), ...) of its parameters wide
        #: enough to hold the state; None where the driver cannot say
        self._sizes: dict[int, tuple | None] = {}
        self.why_not: str | None = None

    def ready(self) -> bool:
        with self._lock:
            if not self._probed:
                self._probed = True
                try:
                    self._probe()
                except Exception as error:  # noqa: BLE001 - the pool watches operators
                    self.why_not = f"{type(error).__name__}: {error}"
            return self.why_not is None

    def _probe(self) -> None:
        if self._func_info is None:
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
            for blob in self.parameters(params):
                flag = PHILOX_STATE_BYTES.get(len(blob))
                if flag is not None and blob[flag] == 1:
                    seed, offset = blob[0:8], blob[8:16]
                    if int.from_bytes(seed, "little") and int.from_bytes(offset, "little"):
                        self._needles, self._pair = (seed, offset), seed + offset
                        self._keep = (graph, out, stream)
                        return
        raise RuntimeError("the probe's random kernel holds no captured PhiloxCudaState")

    def _param_sizes(self, handle, info) -> tuple | None:
        sizes = []
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        index = 0
        while True:
            rc = info(handle, index, ctypes.byref(offset), ctypes.byref(size))
            if rc == _INVALID_VALUE:
                break
            if rc:
                return None
            if size.value >= _NARROWEST:
                sizes.append((index, offset.value, size.value))
            index += 1
        return tuple(sizes)

    def parameters(self, params):
        """The bytes of each parameter of a kernel node (its
        ``CUDA_KERNEL_NODE_PARAMS_v2``) wide enough to hold the state, from
        ``kernelParams`` or from the one buffer of ``extra``
        (``CU_LAUNCH_PARAM_BUFFER_POINTER`` (1), ``CU_LAUNCH_PARAM_BUFFER_SIZE`` (2),
        ``CU_LAUNCH_PARAM_END`` (0)); raises where they cannot be read."""
        handle = params.func or params.kern
        sizes = self._sizes.get(handle, False)
        if sizes is False:
            info = self._func_info if params.func else self._kernel_info
            sizes = self._param_sizes(handle, info) if info is not None and handle else None
            self._sizes[handle] = sizes
        if sizes is None:
            raise RuntimeError("the driver does not give its parameters' sizes")
        if not sizes:  # nothing wide enough (no parameters at all, among others)
            return []
        if params.kernel_params:
            values = ctypes.cast(params.kernel_params, ctypes.POINTER(ctypes.c_void_p))
            return [ctypes.string_at(values[index], size) for index, _, size in sizes]
        buffer, length = _extra_buffer(params.extra)
        if buffer is None or any(offset + size > length for _, offset, size in sizes):
            raise RuntimeError("neither kernelParams nor an extra buffer holds them")
        return [ctypes.string_at(buffer + offset, size) for _, offset, size in sizes]

    def handed(self, params) -> bool:
        """Whether a kernel node's parameters hold the generator's captured state."""
        pair = self._pair
        for blob in self.parameters(params):
            at = blob.find(pair)
            while at >= 0:
                if at % 8 == 0 and any(blob[at + flag:at + flag + 1] == b"\x01"
                                       for flag in PHILOX_STATE_BYTES.values()):
                    return True
                at = blob.find(pair, at + 1)
        return False


def _extra_buffer(extra) -> tuple[int | None, int]:
    """The parameter buffer and its size from a launch's ``extra`` array; (None, 0) where
    it has none."""
    if not extra:
        return None, 0
    items = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
    buffer, length = None, 0
    for i in range(0, 64, 2):  # key, value pairs up to CU_LAUNCH_PARAM_END
        key = items[i]
        if not key:
            break
        if key == 1:
            buffer = items[i + 1]
        elif key == 2 and items[i + 1]:
            length = ctypes.cast(items[i + 1], ctypes.POINTER(ctypes.c_size_t))[0]
    return buffer, length
