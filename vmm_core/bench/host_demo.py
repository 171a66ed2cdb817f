"""The allocator scenario that ``vmm-core bench`` runs where no graphs can be captured.

Each "shape" allocates a working set (as a decode step of that batch size would) from a
new virtual space.  Physical memory is read from the kernel (the memfd sizes), so the
max-vs-sum result is measured, not computed; aliasing is verified byte for byte.
"""

from __future__ import annotations

import ctypes
import os
import time

from ..graphs.shapes import VLLM_DECODE_SIZES
from ..memory.allocator import SharedVMMAllocator
from .measure import ordered

__all__ = ["working_set", "run_host_demo", "held_vs_separate"]

HIDDEN, FFN, DTYPE_BYTES = 4096, 14336, 2


def working_set(tokens: int) -> list[int]:
    """Buffer sizes a decode step of ``tokens`` would allocate (MLP-layer shaped)."""
    return [tokens * HIDDEN * DTYPE_BYTES, tokens * FFN * DTYPE_BYTES * 2,
            tokens * FFN * DTYPE_BYTES, tokens * HIDDEN * DTYPE_BYTES]


def _memfd_bytes(alloc: SharedVMMAllocator) -> int:
    return sum(os.fstat(p.handle.fd).st_size for p in alloc._physical)


def run_host_demo(sizes=None, order: str = "ascending", backend=None, seed: int = 0,
                  on_shape=None) -> dict:
    """Allocate every shape's working set from its own virtual space, in ``order``.

    ``on_shape()`` is called after each shape (a progress bar's update).
    """
    sizes = ordered(sizes or VLLM_DECODE_SIZES, order, seed)
    alloc = SharedVMMAllocator(backend if backend is not None else "host")
    try:
        separate = 0
        largest = 0
        first_base = None
        t0 = time.perf_counter()
        marks = []
        for i, tokens in enumerate(sizes):
            if i:
                alloc.switch_to_new_virtual_space()
            need = 0
            for nbytes in working_set(tokens):
                p = alloc.allocate(nbytes)
                need += alloc.live_allocations()[p]
                if first_base is None:
                    first_base = alloc.space_base()
            separate += need
            largest = max(largest, need)
            # touch the set: mark its first byte with the shape index
            start = alloc.space_base()
            ctypes.memset(start, i % 251 + 1, 64)
            marks.append((alloc.current_space, i % 251 + 1))
            if on_shape is not None:
                on_shape()
        seconds = time.perf_counter() - t0
        physical = _memfd_bytes(alloc)
        # Aliasing: every space's first bytes are the same physical bytes; the last
        # shape wrote last, so every space must read its mark.
        last_mark = marks[-1][1]
        aliased = all(ctypes.string_at(alloc.space_base(s), 64) == bytes([last_mark]) * 64
                      for s, _ in marks)
        switches = alloc.switch_seconds
        return {
            "backend": alloc.backend.name,
            "order": order,
            "shapes": len(sizes),
            "physical_bytes": physical,
            "largest_working_set_bytes": largest,
            "sum_of_working_sets_bytes": separate,
            "ratio_to_largest": physical / largest,
            "ratio_sum_to_largest": separate / largest,
            "handles": alloc.num_handles,
            "virtual_spaces": alloc.num_virtual_spaces,
            "switch_ms_median": 1e3 * sorted(switches)[len(switches) // 2] if switches else 0.0,
            "seconds": seconds,
            "aliasing_verified": aliased,
        }
    finally:
        alloc.close()


def held_vs_separate(rows: list[dict]) -> str:
    """The demo's last line: what vmm_core held against what separate allocations would."""
    def mib(n: int) -> str:
        return f"{n / 2**20:,.0f}" if n >= 100 * 2**20 else f"{n / 2**20:.1f}"

    held = max(r["physical_bytes"] for r in rows)
    separate = max(r["sum_of_working_sets_bytes"] for r in rows)
    shapes = rows[0]["shapes"]
    where = ""
    if len(rows) > 1:
        same = all(r["physical_bytes"] == held for r in rows)
        where = " in every order" if same else " at most, over the orders"
    return (f"vmm_core held {mib(held)} MiB for {shapes} shapes{where}; separate allocations "
            f"would hold {mib(separate)} MiB ({separate / held:.1f}x).")
