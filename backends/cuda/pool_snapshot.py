"""Segments from torch's memory snapshot, read without letting it free what it was handed
(the pool adapter's live and free blocks, the routing-order probe, the benchmark's
readings).

torch's snapshot (``torch._C._cuda_memorySnapshot``, reached through
``torch.cuda.memory_snapshot`` and ``MemPool.snapshot()``) releases one reference to each
element of the tuple it is handed, a reference it never took (PyTorch pull request
196366, open as of 2026-11; on torch 2.11.0+cu130 an element's count went 3 -> 2 across
one call).  The elements are the pool id's two ints and, from torch 2.11, the
``include_traces`` flag.  Shared small ints (a pool id up to 256, and 0, whose count is
huge on 3.11 and fixed on 3.12+) hide it; past them, every snapshot frees the id's int
while a tuple still holds it, and the process dies later at an unrelated line (torch's
process-wide pool counter passing 256 was enough: every GraphPool key is a pool, and
torch's own graph pools count too).  On Python 3.10 and 3.11 ``True`` and ``False`` are
not immortal either, so each snapshot also drains the flag.

So the snapshot is handed ints of its own, one pair per pool id for the life of the
process (held from the start by a cushion of references), and before every call each
element it may release gets two references to spare (the two ints, ``True`` and
``False``).  Nothing is measured or given back: another thread or a wrapper holding a
reference meanwhile cannot fool it, a torch that takes nothing only raises counts that
are never read, and one that releases one or two references per element a read is
covered; a wrapper calling torch's snapshot more often than twice a read would use up
the cushion.
"""

from __future__ import annotations

import ctypes

__all__ = ["pool_segments", "memory_snapshot"]

#: references given to every element before each call: torch 2.11 takes one; more
#: cover a wrapper that calls it twice, and cost nothing
SPARE = 2


class _IdPart(int):
    """A pool-id element that is an object of its own, never a shared small int."""


_inc_ref = ctypes.pythonapi.Py_IncRef
_inc_ref.argtypes = [ctypes.py_object]
_inc_ref.restype = None

_parts: dict[tuple[int, int], tuple[_IdPart, _IdPart]] = {}
#: references each new pair is held by from the start (half a KiB a pool id)
CUSHION = 32
_cushions: list = []
#: this torch's memory_snapshot takes no include_traces (torch < 2.11)
_without_flag = False


def _own_parts(pool_id) -> tuple[_IdPart, _IdPart]:
    """The process's pair of ints standing for ``pool_id`` (made once, never dropped)."""
    key = (int(pool_id[0]), int(pool_id[1]))
    parts = _parts.get(key)
    if parts is None:  # setdefault is one step under the GIL: no lock to inherit by fork
        made = (_IdPart(key[0]), _IdPart(key[1]))
        parts = _parts.setdefault(key, made)
        if parts is made:  # a cushion, for a wrapper calling torch's many times in one read
            _cushions.append(list(made) * CUSHION)
    return parts


def memory_snapshot(pool_id=(0, 0)) -> list[dict]:
    """``torch.cuda.memory_snapshot(pool_id, include_traces=False)`` (``(0, 0)``: every
    pool), without the references torch releases freeing anything; the flag is left out
    on a torch that does not take it."""
    import torch

    global _without_flag
    parts = _own_parts(pool_id)
    for _ in range(SPARE):
        for obj in (*parts, True, False):  # True: a torch or wrapper that adds its default
            _inc_ref(obj)
    if not _without_flag:
        try:
            return torch.cuda.memory_snapshot(parts, include_traces=False)
        except TypeError as exc:  # refused while binding arguments: nothing was handed
            if "include_traces" not in str(exc):
                raise
            _without_flag = True
    return torch.cuda.memory_snapshot(parts)


def pool_segments(pool, device: int) -> list[dict]:
    """The segments of one torch.cuda.MemPool on ``device``."""
    own = tuple(pool.id)
    return [s for s in memory_snapshot(own)
            if tuple(s.get("segment_pool_id", ())) == own and s.get("device", device) == device]
