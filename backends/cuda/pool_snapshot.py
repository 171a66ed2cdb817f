"""The segments of one torch.cuda.MemPool, read from torch's memory snapshot (the pool
adapter's live and free blocks, the routing-order probe).

torch's snapshot (``torch._C._cuda_memorySnapshot``, reached through
``torch.cuda.memory_snapshot(mempool_id)`` and ``MemPool.snapshot()``) releases one
reference to each element of the pool-id tuple it is handed, a reference it never took
(PyTorch pull request 196366, open as of 2026-11; torch 2.11.0+cu130 does it).  An
element that is one of the interpreter's shared small ints (a pool id up to 256) hides
it; past that, every snapshot frees the id's int while the tuple still holds it, and the
process dies later somewhere unrelated (a GraphPool's 257th key was enough).  So the
snapshot is handed ints of its own, each with one reference to spare, which is released
afterwards only where the snapshot did not release it.
"""

from __future__ import annotations

import ctypes
import inspect
import sys

__all__ = ["pool_segments"]


class _IdPart(int):
    """A pool-id element that is an object of its own, never a shared small int: what a
    call takes from it is counted exactly, and nothing else holds it."""


_inc_ref = ctypes.pythonapi.Py_IncRef
_inc_ref.argtypes = [ctypes.py_object]
_inc_ref.restype = None
_dec_ref = ctypes.pythonapi.Py_DecRef
_dec_ref.argtypes = [ctypes.py_object]
_dec_ref.restype = None


def pool_segments(pool, device: int) -> list[dict]:
    import torch

    own = tuple(pool.id)
    parts = tuple(_IdPart(v) for v in own)
    for part in parts:
        _inc_ref(part)  # one to spare, for the reference the snapshot may release
    held = _references(parts)
    traced_flag = _takes_include_traces(torch.cuda.memory_snapshot)
    try:
        if traced_flag:
            segments = torch.cuda.memory_snapshot(parts, include_traces=False)
        else:
            segments = torch.cuda.memory_snapshot(parts)
    finally:
        if max(h - n for h, n in zip(held, _references(parts))) > 0:
            if traced_flag:  # the flag rode in the same tuple (a no-op where immortal)
                _inc_ref(False)
        else:  # a snapshot that released nothing: the spare one goes
            for part in parts:
                _dec_ref(part)
    return [s for s in segments
            if tuple(s.get("segment_pool_id", ())) == own and s.get("device", device) == device]


def _references(parts: tuple) -> list[int]:
    """The reference count of each part, read the same way before and after a call."""
    counts = []
    for i in range(len(parts)):
        counts.append(sys.getrefcount(parts[i]))
    return counts


_signatures: dict = {}


def _takes_include_traces(fn) -> bool:
    """Whether this torch's ``memory_snapshot`` takes ``include_traces`` (torch >= 2.11:
    without traces a snapshot is much cheaper)."""
    known = _signatures.get(fn)
    if known is None:
        try:
            known = "include_traces" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            known = False
        _signatures[fn] = known
    return known
