"""The one pass over a captured graph's kernel nodes (``kernel_scan.c``, built beside
this module by ``pip install``): each node's function and whether its parameters hold
torch's captured generator state.

A pool reads every graph it owns at the end of its capture.  Read node by node through
ctypes, that cost about 10 us a node, 0.35 ms a graph of the Llama-3-8B piecewise shape
and a third of the capture's time (H200, torch 2.11); the C pass makes it one call a
graph.  The driver's entry points are handed to it as addresses, so it needs no CUDA
header, and the tests hand it callbacks over parameter bytes in host memory instead.
"""

from __future__ import annotations

import ctypes
import importlib.util

__all__ = ["KernelScan", "PLAIN", "HANDED", "NO_SIZES", "NO_BYTES", "NOT_READ",
           "load_library"]

#: what the pass says of a node (kernel_scan.c's enum)
PLAIN, HANDED, NO_SIZES, NO_BYTES, NOT_READ = range(5)
#: why a kernel's parameters could not be read, by verdict
UNREAD = {NO_SIZES: "the driver does not give its parameters' sizes",
          NO_BYTES: "neither kernelParams nor an extra buffer holds them"}
ABI_VERSION = 1
_MODULE = f"{__package__}._kernel_scan"
_library = None


def load_library():
    """The built pass (loaded once); RuntimeError naming the remedy where it is missing
    or of another version."""
    global _library
    if _library is None:
        spec = importlib.util.find_spec(_MODULE)
        if spec is None or not spec.origin:
            raise RuntimeError(f"the C library {_MODULE} is not built; install vmm_core "
                               f"with pip (pip install -e . in a checkout) to build it")
        lib = ctypes.CDLL(spec.origin)
        lib.vmm_kernel_scan_abi_version.restype = ctypes.c_int
        version = lib.vmm_kernel_scan_abi_version()
        if version != ABI_VERSION:
            raise RuntimeError(f"{spec.origin} is version {version}, this vmm_core expects "
                               f"{ABI_VERSION}; rebuild it (pip install -e . again)")
        lib.vmm_kernel_scan.restype = ctypes.c_int
        lib.vmm_kernel_scan.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_size_t, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_int)]
        _library = lib
    return _library


def _address(function) -> int | None:
    return None if function is None else ctypes.cast(function, ctypes.c_void_p).value


class KernelScan:
    """The pass with the driver's ``cuGraphKernelNodeGetParams_v2``,
    ``cuFuncGetParamInfo`` and ``cuKernelGetParamInfo`` (ctypes functions, or callbacks
    of the same signatures; a missing ParamInfo leaves such kernels' parameters unread)."""

    def __init__(self, get_params, func_info, kernel_info) -> None:
        self._lib = load_library()
        self._keep = (get_params, func_info, kernel_info)  # callbacks must outlive calls
        self._get_params = _address(get_params)
        self._func_info = _address(func_info)
        self._kernel_info = _address(kernel_info)

    def scan(self, nodes, count: int, pair: bytes | None):
        """``(verdicts, funcs, kerns, codes)`` of the first ``count`` nodes of the ctypes
        array ``nodes``; ``pair``: the state's two addresses (16 bytes), None to read
        no parameters (every kernel then ``PLAIN``)."""
        if pair is not None and len(pair) != 16:
            raise ValueError(f"the state's pair is 16 bytes, got {len(pair)}")
        if count < 0 or (count and (nodes is None or count > len(nodes))):
            raise ValueError(f"scan of {count} nodes from an array of "
                             f"{0 if nodes is None else len(nodes)}: the C pass would read "
                             f"past it")
        verdicts, codes = (ctypes.c_int * count)(), (ctypes.c_int * count)()
        funcs, kerns = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)()
        rc = self._lib.vmm_kernel_scan(self._get_params, self._func_info, self._kernel_info,
                                       nodes, count, pair, verdicts, funcs, kerns, codes)
        if rc:
            raise RuntimeError("vmm_kernel_scan refused its arguments (no "
                               "cuGraphKernelNodeGetParams_v2, or no arrays)")
        return verdicts, funcs, kerns, codes
