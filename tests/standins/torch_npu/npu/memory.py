"""Stand-in for ``torch_npu/npu/memory.py``: a tiny caching allocator over host memory.

Segments of a pool built on an ``NPUPluggableAllocator`` come from that allocator's C
alloc function (the vmm_core shim in the tests), sized like the real caching allocator
asks (<= 1 MiB -> 2 MiB, < 10 MiB -> 20 MiB, else rounded to 2 MiB); blocks are split
inside segments and their states are reported by ``memory_snapshot`` in torch's format.
Released pools give their segments back through the allocator's free function, as
torch_npu releases from 2.13.0 do.

``VMM_CORE_STANDIN_TORCH_NPU=2.12`` (read at import) mimics torch_npu 2.1-2.12: ``MemPool``
has only ``__init__``, ``id`` and ``allocator``, and ``memory_snapshot()`` takes no
``mempool_id`` (segments still carry ``segment_pool_id``, as torch's snapshot does), and
``empty_cache()`` raises where 2.12 would ``aclrtFree`` a released custom-allocator pool's
segments.
"""

import contextlib
import ctypes
import itertools
import os
import threading
import weakref

from . import graphs as _graphs
from .utils import current_device

_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                            ctypes.c_void_p)
_MiB = 1 << 20

_lock = threading.RLock()
_tls = threading.local()
_pool_ids = itertools.count(1)
_segments: dict = {}  # pool id -> list of segment dicts
_owners: dict = {}  # pool id -> weakref to MemPool
_allocators: dict = {}  # pool id -> _NPUAllocator
_host_buffers: dict = {}  # address -> ctypes buffer, for pools without a custom allocator
_MIMIC_2_12 = os.environ.get("VMM_CORE_STANDIN_TORCH_NPU") == "2.12"
#: how often empty_cache / host_empty_cache ran (graph capture entry calls both)
calls = {"empty_cache": 0, "host_empty_cache": 0}


class _NPUAllocator:
    """Stands in for ``torch_npu._C._npu_NPUAllocator`` (what ``allocator()`` returns)."""

    def __init__(self, alloc_fn, free_fn):
        self.alloc_fn = alloc_fn
        self.free_fn = free_fn


class NPUPluggableAllocator:
    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        lib = ctypes.CDLL(path_to_so_file)
        alloc = ctypes.cast(getattr(lib, alloc_fn_name), ctypes.c_void_p).value
        free = ctypes.cast(getattr(lib, free_fn_name), ctypes.c_void_p).value
        if alloc is None or free is None:
            raise RuntimeError("alloc_fn or free_fn is None")
        self._lib = lib
        self._allocator = _NPUAllocator(_ALLOC_FN(alloc), _FREE_FN(free))

    def allocator(self):
        return self._allocator


class MemPool:
    def __init__(self, allocator=None, use_on_oom=False, no_split=False):
        if allocator is not None and not isinstance(allocator, _NPUAllocator):
            raise TypeError("MemPool takes torch_npu._C._npu_NPUAllocator: pass "
                            "NPUPluggableAllocator(...).allocator(), not the wrapper")
        self._id = (0, next(_pool_ids))
        with _lock:
            _segments[self._id] = []
            _owners[self._id] = weakref.ref(self)
            _allocators[self._id] = allocator

    @property
    def id(self):
        return self._id

    def use_count(self):
        return 1

    def snapshot(self):
        return memory_snapshot(self.id)


@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    if not isinstance(pool, MemPool):
        raise TypeError(f"use_mem_pool takes a MemPool, got {type(pool).__name__}")
    stack = _tls.__dict__.setdefault("pools", [])
    stack.append(pool.id)
    try:
        yield
    finally:
        stack.pop()


def _active_pool_id():
    stack = getattr(_tls, "pools", [])
    if stack:
        return stack[-1]
    return _graphs.capturing_pool()


def _segment_size(size):
    if size <= _MiB:
        return 2 * _MiB
    if size < 10 * _MiB:
        return 20 * _MiB
    return (size + 2 * _MiB - 1) // (2 * _MiB) * (2 * _MiB)


def caching_allocator_alloc(size, device=None, stream=None):
    size = max(512, (int(size) + 511) // 512 * 512)
    dev = current_device() if device is None else int(device)
    with _lock:
        pid = _active_pool_id() or ("default", dev)
        segments = _segments.setdefault(pid, [])
        for seg in segments:
            blocks = seg["blocks"]
            for i, block in enumerate(blocks):
                if block["state"] == "inactive" and block["size"] >= size:
                    rest = block["size"] - size
                    block.update(size=size, state="active_allocated")
                    if rest:
                        blocks.insert(i + 1, {"address": block["address"] + size, "size": rest,
                                              "state": "inactive"})
                    return block["address"]
        total = _segment_size(size)
        allocator = _allocators.get(pid)
        if allocator is not None:
            address = allocator.alloc_fn(total, dev, None)
            if not address:
                raise RuntimeError(f"NPU out of memory: the pluggable allocator returned NULL "
                                   f"for {total} bytes")
        else:
            buf = ctypes.create_string_buffer(total)
            address = ctypes.addressof(buf)
            _host_buffers[address] = buf
        blocks = [{"address": address, "size": size, "state": "active_allocated"}]
        if total > size:
            blocks.append({"address": address + size, "size": total - size, "state": "inactive"})
        segments.append({"device": dev, "address": address, "total_size": total,
                         "segment_pool_id": pid, "blocks": blocks})
        return address


def caching_allocator_delete(mem_ptr):
    with _lock:
        for segments in _segments.values():
            for seg in segments:
                for block in seg["blocks"]:
                    if block["address"] == mem_ptr and block["state"] == "active_allocated":
                        block["state"] = "inactive"
                        return
    raise RuntimeError(f"caching_allocator_delete: {mem_ptr:#x} is not an allocated block")


def memory_snapshot(mempool_id=None):
    with _lock:
        ids = list(_segments) if mempool_id is None else [tuple(mempool_id)]
        return [dict(seg, blocks=[dict(b) for b in seg["blocks"]])
                for pid in ids for seg in _segments.get(pid, [])]


if _MIMIC_2_12:
    del MemPool.snapshot
    _snapshot_of = memory_snapshot

    def memory_snapshot():  # type: ignore[no-redef]  # 2.12: no mempool_id
        return _snapshot_of(None)


def host_empty_cache():
    """Stands in for the pinned-host cache flush; nothing is cached on the CPU."""
    calls["host_empty_cache"] += 1


def empty_cache():
    """Give fully free segments of dropped pools back to their allocator."""
    calls["empty_cache"] += 1
    with _lock:
        for pid, owner in list(_owners.items()):
            if owner() is not None:
                continue
            segments = _segments.get(pid, [])
            if any(b["state"] != "inactive" for s in segments for b in s["blocks"]):
                continue
            if _MIMIC_2_12 and _allocators.get(pid) is not None and segments:
                # 2.12's release_block calls aclrtFree on every segment, even those a
                # custom allocator handed out (see backends/ascend/allocator_adapter.py):
                # on an NPU that silently frees vmm_core's memory; here it is loud
                raise RuntimeError(f"torch_npu 2.12 stand-in: empty_cache() would aclrtFree "
                                   f"{len(segments)} segment(s) of released MemPool {pid} "
                                   f"that its custom allocator handed out")
            allocator = _allocators.pop(pid, None)
            for seg in segments:
                if allocator is not None:
                    allocator.free_fn(seg["address"], seg["total_size"], seg["device"], None)
            del _segments[pid], _owners[pid]
