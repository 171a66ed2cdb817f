"""The arguments of ``mt.gather`` / ``mt.scatter``, checked at the price of a kernel.

What the caller passes is checked on the host where that is free (type, dtype, shape,
device) and on the device where it is not: whether every index is in range needs the
indices' values, and reading them on the host waits for every kernel queued before
(a device sync per call cost a mapped gather of 256 B rows a fifth of its time).  So
:class:`RangeCheck` reduces the indices on the device and copies the two numbers to
page-locked host memory behind an event, the gather runs on clamped indices (an index
out of range would stop the device at a kernel assertion instead of raising), and only
then does the host wait, for the event: the reduction, not the gather.  An index out of
range still raises :class:`~vmm_core.errors.VMMError` before the result is returned.

Rows travel between ranks as machine words (:func:`as_words`): an index kernel or a
collective moves 8-byte elements several times faster than single bytes.
"""

from __future__ import annotations

import math

from ..errors import VMMError

__all__ = ["index_tensor", "row_tensor", "RangeCheck", "range_failure", "refuse_duplicates",
           "word_dtype", "as_words"]


def index_tensor(mt, indices, what: str):
    """``indices`` as given (int64 or int32, 1-D, on ``mt.device``), or VMMError saying
    how to pass them.  Reads no value."""
    import torch

    if not isinstance(indices, torch.Tensor):
        raise VMMError(f"mt.{what}: indices must be a 1-D torch tensor of int64 or int32 on "
                       f"{mt.device}, got {type(indices).__name__}; build it with "
                       f"torch.as_tensor(indices, dtype=torch.int64, device={str(mt.device)!r})")
    if indices.dtype == torch.bool:  # .long() would turn a mask into rows 0 and 1
        raise VMMError(f"mt.{what}: indices must be int64 or int32 row numbers, got a "
                       f"boolean mask; turn it into the rows it selects with "
                       f"torch.nonzero(mask).flatten()")
    if indices.dtype not in (torch.int64, torch.int32):
        raise VMMError(f"mt.{what}: indices must be int64 or int32, got {indices.dtype}; "
                       f"convert them with indices.long()")
    if indices.dim() != 1:
        raise VMMError(f"mt.{what}: indices must be 1-D, got shape {tuple(indices.shape)}; "
                       f"flatten them with indices.reshape(-1)")
    if indices.device != mt.device:
        raise VMMError(f"mt.{what}: indices are on {indices.device} but the rows live on "
                       f"{mt.device}; move them with indices.to({str(mt.device)!r})")
    return indices


def range_failure(mt, indices, what: str) -> VMMError:
    """The error for indices of which some are out of range (reads them: failure path)."""
    rows = mt.shape[0]
    bad = indices[(indices < 0) | (indices >= rows)][:5].tolist()
    return VMMError(f"mt.{what}: indices must be in [0, {rows}), got {bad} (first "
                    f"out-of-range ones); negative indices are not wrapped")


class RangeCheck:
    """Whether ``indices`` are all in ``[0, rows)``, found without waiting for the device.

    :attr:`safe` is ``indices`` to use meanwhile, clamped into range on a device; on the
    CPU the indices themselves, which torch's own indexing checks as it reads them
    (:attr:`pending` False, :meth:`result` passes: the caller turns torch's IndexError
    into :func:`range_failure`).  :meth:`result` raises if any was out of range,
    waiting only for the reduction."""

    def __init__(self, mt, indices, what: str) -> None:
        import torch

        self.mt, self.indices, self.what = mt, indices, what
        self.safe, self._event, self._host = indices, None, None
        self._verdict: bool | None = True
        module = getattr(torch, indices.device.type, None)
        if indices.numel() == 0 or indices.device.type == "cpu" or \
                not hasattr(module, "Event"):
            if indices.device.type != "cpu" and indices.numel():  # no events: wait
                low, high = torch.aminmax(indices)
                self._verdict = low.item() >= 0 and high.item() < mt.shape[0]
            return
        rows = mt.shape[0]
        bounds = torch.empty(2, dtype=indices.dtype, device=indices.device)
        torch.aminmax(indices, out=(bounds[0], bounds[1]))
        try:
            host = torch.empty(2, dtype=indices.dtype, pin_memory=True)
        except RuntimeError:  # no page-locked memory for this device: wait instead
            low, high = bounds.tolist()
            self._verdict = low >= 0 and high < rows
            return
        host.copy_(bounds, non_blocking=True)
        assert module is not None  # checked above: a device module with events
        self._event = module.Event()
        self._event.record()
        self._host = host
        self._verdict = None
        self.safe = indices.clamp(0, rows - 1)

    @property
    def pending(self) -> bool:
        """Whether the verdict still waits for the device."""
        return self._verdict is None

    def ok(self) -> bool:
        if self._verdict is None:
            assert self._event is not None and self._host is not None
            self._event.synchronize()
            low, high = self._host.tolist()
            self._verdict = low >= 0 and high < self.mt.shape[0]
        return self._verdict

    def result(self) -> None:
        if not self.ok():
            raise range_failure(self.mt, self.indices, self.what)


def row_tensor(mt, rows, count: int):
    """``rows`` for a scatter of ``count`` indices, detached, or VMMError saying why not."""
    import torch

    want = (count,) + tuple(mt.shape[1:])
    if not isinstance(rows, torch.Tensor):
        raise VMMError(f"mt.scatter: rows must be a torch tensor of shape {want}, got "
                       f"{type(rows).__name__}")
    if rows.dtype != mt.dtype:
        raise VMMError(f"mt.scatter: rows are {rows.dtype} but the tensor holds {mt.dtype}; "
                       f"convert them with rows.to({mt.dtype})")
    if tuple(rows.shape) != want:
        raise VMMError(f"mt.scatter: rows must have shape {want} (one row per index), got "
                       f"{tuple(rows.shape)}")
    if rows.device != mt.device:
        raise VMMError(f"mt.scatter: rows are on {rows.device} but the tensor lives on "
                       f"{mt.device}; move them with rows.to({str(mt.device)!r})")
    # values only: rows that require grad would otherwise chain every scatter into the
    # autograd history of the mapped views (kept alive with them), and gather would
    # return grad-tracking rows for the mapped kinds but not for the distributed one
    return rows.detach()


def refuse_duplicates(indices, where: str, first: int = 0) -> None:
    """``first``: the global index of ``indices``' row 0 (an owner checks the offsets
    into its own part, but the user named global rows)."""
    import torch

    if indices.numel() < 2:
        return
    values, counts = torch.unique(indices, return_counts=True)
    if bool((counts > 1).any()):
        twice = [first + v for v in values[counts > 1][:5].tolist()]
        raise VMMError(f"mt.scatter: rows {twice} are named more than once{where}; nothing "
                       f"was written. Name each row once (combine the duplicate rows "
                       f"yourself, e.g. with torch.unique(indices, return_inverse=True))")


def word_dtype(row_bytes: int):
    """The widest integer type a row of ``row_bytes`` is a whole number of: what rows
    travel as.  From the row size alone, so every rank of a group picks the same."""
    import torch

    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return dtype
    return torch.uint8


def as_words(t, row_bytes: int):
    """A 2-D ``[rows, row_bytes / word]`` view of a row tensor in :func:`word_dtype`
    (a copy only when ``t`` is not contiguous or not aligned to a word)."""
    import torch

    t = t.contiguous()
    flat = t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)
    dtype = word_dtype(row_bytes)
    if dtype == torch.uint8:
        return flat
    try:
        return flat.view(dtype)
    except RuntimeError:  # an offset that is not a whole word: copy once
        return flat.clone().view(dtype)
