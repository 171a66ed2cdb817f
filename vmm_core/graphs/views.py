"""Non-owning views of graph outputs, for runners that keep pool memory free between
captures.

An engine that holds only views of what a graph wrote (vLLM's ``entry.output =
weak_ref_tensors(output)``) leaves the blocks free once the forward that captured them
ends, so the next capture in the same pool or :class:`~vmm_core.GraphPool` space reuses
them and no ``keep()`` is needed; replays write the same addresses, which the views read.

How a framework makes a tensor over memory it does not own differs per device, so the
view itself is a graph-ops role method (:meth:`GraphOps.non_owning_view`); this module
finds the graph ops of a tensor's device through the backend registry and keeps the
dtype, shape and structure policy in one place.  :func:`dlpack_bytes` is the DLPack
route, for frameworks whose public way in is ``from_dlpack``.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

from ..errors import BackendError, CaptureError

__all__ = ["weak_ref_tensors", "graph_ops_of", "dlpack_bytes"]


def weak_ref_tensors(obj):
    """Views of ``obj``'s memory that do not keep its blocks allocated (what vLLM's
    ``weak_ref_tensors`` returns): the pool may hand the blocks to a later capture, and
    the view reads whatever the graph that owns the address last wrote there.  Copy what
    a view reads out before a graph of another key replays.

    Tuples and lists keep their shape and None stays None (outputs may hold it).  A view
    is made for contiguous tensors on a device whose backend's graph ops can make one
    (the host's CPU tensors and CUDA's; see each backend); anything else raises an error
    of :mod:`vmm_core.errors` naming what it got."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(weak_ref_tensors(o) for o in obj)
    if obj is None:
        return None
    return _non_owning(obj)


def _non_owning(t):
    import torch

    if not isinstance(t, torch.Tensor):
        raise CaptureError(f"weak_ref_tensors takes tensors, None, or (nested) tuples and "
                           f"lists of them; got {type(t).__name__}")
    if not t.is_contiguous():
        raise CaptureError("non-owning views are made for contiguous tensors only: take "
                           "the view of the contiguous tensor the graph wrote, then index it")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:  # nothing to alias: an empty tensor of the same kind
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    raw = graph_ops_of(t.device).non_owning_view(t.data_ptr(), nbytes)
    return raw.view(t.dtype).view(t.shape)


_ops_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ops_lock = threading.Lock()


def graph_ops_of(device):
    """The graph ops of the usable backend whose tensors live on the torch ``device``
    (its type and index), best backend first; BackendError naming the device where no
    backend captures its graphs."""
    from ..registry import default_registry

    registry = default_registry()
    key = (device.type, device.index or 0)
    with _ops_lock:
        cached = _ops_cache.setdefault(registry, {})
        ops = cached.get(key)
    if ops is not None:
        return ops
    for name in registry.available():
        ops = registry.get(name).graph_ops(key[1])
        if ops is not None and ops.device_type == key[0]:
            with _ops_lock:
                cached[key] = ops
            return ops
    raise BackendError(f"no usable vmm_core backend captures graphs of {device.type} "
                       f"tensors (usable here: {', '.join(registry.available()) or 'none'}), "
                       f"so no non-owning view of one can be made; keep the tensor itself")


# ----------------------------------------------------------------------------------
# DLPack (dlpack.h, the unversioned DLManagedTensor every framework's from_dlpack takes)
# ----------------------------------------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_K_DL_UINT = 1  # DLDataTypeCode kDLUInt
_CAPSULE_NAME = b"dltensor"  # lives as long as the module: the capsule keeps its pointer
#: every DLManagedTensor handed out: the importer reads its ``deleter`` (NULL: the memory
#: is not the view's) when the view's storage dies, so it must outlive every view; a few
#: dozen bytes per view, made once per captured output
_handed_out: list = []
_handed_lock = threading.Lock()


def dlpack_bytes(address: int, nbytes: int, device_type: int, device_id: int):
    """A DLPack capsule of ``nbytes`` bytes (uint8, one dimension) at ``address`` on the
    DLPack device ``(device_type, device_id)`` (dlpack.h's ``DLDeviceType``: 1 CPU, 2
    CUDA, 12 kDLExtDev, ...) whose deleter is NULL: the tensor a framework's
    ``from_dlpack`` makes of it does not own the memory."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor(
        _DLTensor(address, _DLDevice(device_type, device_id), 1, _DLDataType(_K_DL_UINT, 8, 1),
                  shape, None, 0), None, None)
    with _handed_lock:
        _handed_out.append((managed, shape))
    return _capsule_new(ctypes.addressof(managed), _CAPSULE_NAME, None)


# a prototype of its own: setting restype on ctypes.pythonapi.PyCapsule_New would change
# it for every other user in the process
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
