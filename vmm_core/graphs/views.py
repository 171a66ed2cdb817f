"""Non-owning views of graph outputs, for runners that keep pool memory free between
captures.

An engine that holds only views of what a graph wrote (vLLM's ``entry.output =
weak_ref_tensors(output)``) leaves the blocks free once the forward that captured them
ends, so the next capture in the same pool or :class:`~vmm_core.GraphPool` space reuses
them and no ``keep()`` is needed; replays write the same addresses, which the views read.
"""

from __future__ import annotations

__all__ = ["weak_ref_tensors"]


def weak_ref_tensors(obj):
    """Views of ``obj``'s memory that do not keep its blocks allocated (what vLLM's
    ``weak_ref_tensors`` returns): the pool may hand the blocks to a later capture, and
    the view reads whatever the graph that owns the address last wrote there.  Copy what
    a view reads out before a graph of another key replays.

    Tuples and lists keep their shape.  A view is made for contiguous CUDA tensors (through
    ``__cuda_array_interface__``) and for CPU tensors (through a buffer over the address),
    which the host tests use to pin the bookkeeping; other devices raise ValueError."""
    if isinstance(obj, (tuple, list)):
        return type(obj)(weak_ref_tensors(o) for o in obj)
    return _non_owning(obj)


def _non_owning(t):
    import torch

    if not t.is_contiguous():
        raise ValueError("non-owning views are made for contiguous tensors only")
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cuda":
        class _Memory:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                        "data": (t.data_ptr(), False), "version": 3}

        raw = torch.as_tensor(_Memory(), device=t.device)
    elif t.device.type == "cpu":
        import ctypes

        if nbytes == 0:
            return torch.empty(t.shape, dtype=t.dtype)
        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(t.data_ptr()),
                               dtype=torch.uint8)
    else:
        raise ValueError(f"non-owning views are made for cuda and cpu tensors, not "
                         f"{t.device.type}")
    return raw.view(t.dtype).view(t.shape)
