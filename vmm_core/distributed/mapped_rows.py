"""gather and scatter of the mapped kinds: every rank's rows are mapped here.

One indexing kernel per part (one for ``continuous`` and the host location, one per
owner for ``chunked``), no collective.  A continuous gather waits for no kernel: its
indices are checked on the device (:class:`~.indices.RangeCheck`) while it runs on
clamped ones, and an index out of range still raises before the rows are returned.  A
scatter, and a chunked gather (which chooses its parts from the values), read two
numbers first: nothing may be written before the check.
"""

from __future__ import annotations

from .indices import RangeCheck, index_tensor, range_failure, refuse_duplicates, row_tensor

__all__ = ["gather", "scatter"]


def gather(mt, indices):
    import torch

    idx = index_tensor(mt, indices, "gather")
    check = RangeCheck(mt, idx, "gather")
    memory = mt.memory
    try:
        if memory.address is not None:  # continuous, or the host location: one tensor
            out = mt.tensor.index_select(0, check.safe)
            check.result()
            return out
        _check_now(mt, idx, "gather")  # the parts are chosen from the values: wait once
        out = torch.empty((idx.numel(),) + tuple(mt.shape[1:]), dtype=mt.dtype,
                          device=mt.device)
        chunks = mt.chunks
        for rank, where, local in _parts(mt, idx):
            out[where] = chunks[rank].index_select(0, local)
        return out
    except IndexError:  # on the CPU torch checks the indices as it reads them
        raise range_failure(mt, idx, "gather") from None


def _check_now(mt, idx, what: str) -> None:
    """Every index in range, or VMMError; reads two numbers (one wait for the device)."""
    import torch

    if idx.numel():
        low, high = torch.aminmax(idx)
        if low.item() < 0 or high.item() >= mt.shape[0]:
            raise range_failure(mt, idx, what)


def scatter(mt, indices, rows) -> None:
    idx = index_tensor(mt, indices, "scatter")
    rows = row_tensor(mt, rows, idx.numel())
    _check_now(mt, idx, "scatter")  # nothing may be written before this
    refuse_duplicates(idx, "")
    if mt.memory.address is not None:
        mt.tensor.index_copy_(0, idx, rows)
        return
    chunks = mt.chunks
    for rank, where, local in _parts(mt, idx):
        chunks[rank].index_copy_(0, local, rows[where])


def _parts(mt, indices):
    """(rank, positions in ``indices``, rows inside that rank's part) for every owner
    that ``indices`` name (chunked kind): one sort, one read of the counts."""
    import torch

    world = mt.memory.world_size
    per = mt.memory.partition.rows_per_rank
    owner = torch.div(indices, per, rounding_mode="floor")
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=world).tolist()
    out, start = [], 0
    for rank, n in enumerate(counts):
        if n:
            where = order[start:start + n]
            out.append((rank, where, indices[where] - rank * per))
        start += n
    return out
