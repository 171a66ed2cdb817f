"""Gather and scatter rows by index, the same call for every kind of mapped tensor.

Mapped kinds (``continuous``, ``chunked``, host location) read and write through this
process's mapping: one indexing kernel per part, no collective.

``kind="distributed"`` moves rows with the group's collectives, as WholeMemory does:

1. the group's call header (:meth:`Group.header
   <vmm_core.distributed.group.Group.header>`, the first collective of every vmm_core
   operation on a group) names the call (gather or scatter) and the tensor: ranks that
   made different calls (a gather against another tensor's gather, a scatter, a group
   sleep, a close or a new mapped tensor) all raise the same CallMismatchError at once
   instead of exchanging rows of the wrong tensor silently, or waiting on each other's
   mismatched collectives until the group's timeout.  Then each rank, having checked
   its own arguments and bucketed its indices by owner, sends every owner how many rows
   it wants (``all_to_all_single`` of one count per rank; a rank whose arguments are
   wrong sends -1 instead, so every rank learns of it in this same step and they all
   raise the same error, with nothing moved);
2. the indices travel to their owners (``all_to_all_single`` with uneven splits);
3. gather: each owner reads its rows into a buffer made for them; scatter: each owner
   refuses rows named twice (also across ranks) and makes room for the rows it will
   receive.  Then one ``all_reduce`` of a failure flag, so a rank that failed here (or
   could not make room: every buffer a rank fills is allocated before this point, the
   requester's in step 1) makes every rank raise the same :class:`DistributedError`
   before any row travels, instead of leaving the others waiting in the next exchange;
4. the rows travel (back to the requesters, or to their owners, who write them; a
   scatter ends with one more flag, so a failed write is raised on every rank too).

Rows travel as bytes, so any dtype works with both NCCL and gloo (gloo's
``all_to_all_single`` takes uneven splits on CPU tensors).  Exchanges run on the
device the group's backend uses (CPU for gloo, the tensor's device for NCCL).
"""

from __future__ import annotations

import contextlib
import math

from ..errors import DistributedError, SleepStateError, VMMError

__all__ = ["gather", "scatter"]

# ------------------------------------------------------------------ argument checks
def _indices(mt, indices, what: str):
    """``indices`` as int64 on ``mt.device``, or an error that says how to pass them."""
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
    rows = mt.shape[0]
    if indices.numel():
        low, high = torch.stack(torch.aminmax(indices)).tolist()  # one device sync
        if low < 0 or high >= rows:
            bad = indices[(indices < 0) | (indices >= rows)][:5].tolist()
            raise VMMError(f"mt.{what}: indices must be in [0, {rows}), got {bad} (first "
                           f"out-of-range ones); negative indices are not wrapped")
    return indices.long()


def _rows(mt, rows, count: int):
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


def _refuse_duplicates(indices, where: str, first: int = 0) -> None:
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


def _as_bytes(t):
    """A 2-D uint8 view ``[rows, row_bytes]`` of a row tensor (no copy if contiguous)."""
    import torch

    t = t.contiguous()
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


# ------------------------------------------------------------------ mapped kinds
def _parts(mt, indices):
    """(rank, positions in ``indices``, rows inside that rank's part) for every owner
    that ``indices`` name; one entry covering everything for a single mapped tensor."""
    import torch

    memory = mt.memory
    if memory.address is not None:  # continuous, or the host location: one tensor
        return [(None, None, indices)]
    per = memory.partition.rows_per_rank
    owner = torch.div(indices, per, rounding_mode="floor")
    out = []
    for rank in torch.unique(owner).tolist():
        where = torch.nonzero(owner == rank).flatten()
        out.append((rank, where, indices[where] - rank * per))
    return out


def _mapped_gather(mt, indices):
    import torch

    idx = _indices(mt, indices, "gather")
    parts = _parts(mt, idx)
    if parts and parts[0][0] is None:
        return mt.tensor.index_select(0, idx)
    out = torch.empty((idx.numel(),) + tuple(mt.shape[1:]), dtype=mt.dtype, device=mt.device)
    chunks = mt.chunks
    for rank, where, local in parts:
        out[where] = chunks[rank].index_select(0, local)
    return out


def _mapped_scatter(mt, indices, rows) -> None:
    idx = _indices(mt, indices, "scatter")
    rows = _rows(mt, rows, idx.numel())
    _refuse_duplicates(idx, "")
    parts = _parts(mt, idx)
    if parts and parts[0][0] is None:
        mt.tensor.index_copy_(0, idx, rows)
        return
    chunks = mt.chunks
    for rank, where, local in parts:
        chunks[rank].index_copy_(0, local, rows[where])


# ------------------------------------------------------------------ distributed kind
class _Exchange:
    """One gather or scatter call of a distributed tensor: the steps every rank takes
    together, and the first failure of this rank, which it keeps until the end."""

    def __init__(self, mt, what: str) -> None:
        import torch.distributed as dist

        self.mt, self.what, self.dist = mt, what, dist
        memory = mt.memory
        self.group = memory._group
        self.world = memory.world_size
        self.per = memory.partition.rows_per_rank
        self.row_bytes = memory.partition.row_bytes
        self.failure: BaseException | None = None
        self.on = self.group._tensor_device()  # where the collectives take tensors

    def step(self, name: str, fn, *args, **kwargs):
        """One collective; a broken group (a rank died) raises on this rank at once."""
        try:
            return fn(*args, group=self.group.group, **kwargs)
        except Exception as exc:
            raise DistributedError(
                f"rank {self.group.rank}: the process group failed during mt.{self.what} "
                f"({name}: {type(exc).__name__}: {exc}). Another rank probably died or "
                f"left the call; see its output") from exc

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    def hold(self, stack: contextlib.ExitStack) -> None:
        """Keep this rank's part awake until ``stack`` closes; a part that cannot be held
        is this rank's failure, reported with the counts, not raised alone."""
        try:
            stack.enter_context(_held(self.mt, self.what))
        except Exception as exc:
            self.fail(exc)

    def indices_to_owners(self, owners, local):
        """Steps 1 and 2: the counts, then every index to the rank that owns its row.
        Returns (send counts, receive counts, the indices of this rank's rows asked for)."""
        import torch

        send_counts, recv_counts = self.counts(owners)
        received = torch.empty(sum(recv_counts), dtype=torch.int64, device=self.on)
        self.step("sending indices to their owners", self.dist.all_to_all_single, received,
                  local.to(self.on), recv_counts, send_counts)
        return send_counts, recv_counts, received

    def counts(self, owners):
        """Step 1: the call header (every rank is in this call on this tensor), then how
        many rows each rank wants from each owner; -1 marks a rank that already failed,
        so the others stop here with it.  Returns (what this rank wants from each owner,
        what each rank wants from this one)."""
        import torch

        self.group.header(f"mt.{self.what}", self.mt.memory._call_id)
        if self.failure is None:
            wanted = torch.bincount(owners, minlength=self.world).to(self.on)
        else:
            wanted = torch.full((self.world,), -1, dtype=torch.int64, device=self.on)
        asked = torch.empty_like(wanted)
        self.step("exchanging row counts", self.dist.all_to_all_single, asked, wanted)
        send, recv = wanted.tolist(), asked.tolist()
        if self.failure is not None or min(recv) < 0:
            self.raise_agreed()
        return send, recv

    def raise_agreed(self):
        """Every rank knows some rank failed: agree on the messages and raise them."""
        self.group.agree(f"mt.{self.what} on a distributed tensor", None, self.failure,
                         self.mt.memory._call_id)
        raise DistributedError(f"mt.{self.what}: a rank reported a failure that the "
                               f"agreement did not see")  # agree() raised already

    def finish(self, name: str) -> None:
        """One flag per rank, reduced: did any rank fail since the counts?"""
        import torch

        flag = torch.tensor([0 if self.failure is None else 1], dtype=torch.int32,
                            device=self.on)
        self.step(name, self.dist.all_reduce, flag, op=self.dist.ReduceOp.MAX)
        if int(flag.item()):
            self.raise_agreed()


def _held(mt, what: str):
    """Keep this rank's part awake for the call (a tagged part may be put to sleep)."""
    allocators = mt.memory._local.allocators
    if not allocators:
        return contextlib.nullcontext()
    alloc = allocators[0]
    if alloc.asleep:
        raise SleepStateError(f"mt.{what}: this rank's part (tag {alloc.tag!r}) is asleep; "
                              f"wake it first with vmm_core.wake_up({alloc.tag!r}, group=...)")
    return alloc.hold_awake(f"mt.{what}: this rank's part")


def _owned(ex: _Exchange, mt, indices, rows=None):
    """Check the arguments and sort them by owner: (order, owners, rows inside each
    owner's part, rows to send or None); Nones if this rank's arguments are wrong."""
    import torch

    try:
        idx = _indices(mt, indices, ex.what)
        if rows is not None:
            rows = _rows(mt, rows, idx.numel())
        owners = torch.div(idx, ex.per, rounding_mode="floor")
        order = torch.argsort(owners, stable=True)
        owners = owners[order]
        local = idx[order] - owners * ex.per
        moved = None if rows is None else _as_bytes(rows[order])
        return order, owners, local, moved
    except Exception as exc:
        ex.fail(exc)
        empty = torch.empty(0, dtype=torch.int64, device=mt.device)
        return empty, empty, empty, None


def _distributed_gather(mt, indices):
    import torch

    ex = _Exchange(mt, "gather")
    with contextlib.ExitStack() as stack:
        ex.hold(stack)
        order, owners, local, _ = _owned(ex, mt, indices)
        got = out = None
        try:  # room for this rank's rows, before step 1 reports whether it failed
            if ex.failure is None:
                got = torch.empty(order.numel(), ex.row_bytes, dtype=torch.uint8,
                                  device=ex.on)
                out = torch.empty((order.numel(),) + tuple(mt.shape[1:]), dtype=mt.dtype,
                                  device=mt.device)
        except Exception as exc:
            ex.fail(exc)
        send_counts, recv_counts, wanted = ex.indices_to_owners(owners, local)
        reply = None
        try:
            reply = torch.empty(sum(recv_counts), ex.row_bytes, dtype=torch.uint8,
                                device=ex.on)
            part = _as_bytes(mt.local_part())
            if part.device == reply.device:
                torch.index_select(part, 0, wanted, out=reply)
            else:
                reply.copy_(part.index_select(0, wanted.to(part.device)))
        except Exception as exc:
            ex.fail(exc)
        ex.finish("agreeing that every owner read its rows")  # before any row travels
        ex.step("sending rows back", ex.dist.all_to_all_single, got, reply, send_counts,
                recv_counts)
    # rows came back sorted by owner: one index_select by the inverse order restores
    # the caller's order, straight into the buffer made before step 1
    assert got is not None and out is not None  # made, or step 1 raised on every rank
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    torch.index_select(got.to(mt.device), 0, back, out=_as_bytes(out))
    return out


def _distributed_scatter(mt, indices, rows) -> None:
    import torch

    ex = _Exchange(mt, "scatter")
    with contextlib.ExitStack() as stack:
        ex.hold(stack)
        order, owners, local, moved = _owned(ex, mt, indices, rows)
        send_counts, recv_counts, targets = ex.indices_to_owners(owners, local)
        incoming = None
        try:
            targets = targets.to(mt.device)
            _refuse_duplicates(targets, f" (rank {mt.memory.rank} owns them, and the ranks' "
                                        f"indices together name them)",
                               first=mt.memory.rank * ex.per)
            incoming = torch.empty(sum(recv_counts), ex.row_bytes, dtype=torch.uint8,
                                   device=ex.on)
            moved = moved.to(ex.on)
        except Exception as exc:
            ex.fail(exc)
        # before any row travels: no row named twice, every owner has room for its rows
        ex.finish("agreeing that no row is written twice")
        ex.step("sending rows to their owners", ex.dist.all_to_all_single, incoming,
                moved, recv_counts, send_counts)
        try:
            part = mt.local_part()
            if targets.numel():
                assert incoming is not None  # made, or the agreement raised
                _as_bytes(part).index_copy_(0, targets, incoming.to(mt.device))
        except Exception as exc:
            ex.fail(exc)
        ex.finish("agreeing that every owner wrote its rows")


# ------------------------------------------------------------------ entry points
def gather(mt, indices):
    mt.memory._check_open()
    if mt.memory.kind == "distributed":
        return _distributed_gather(mt, indices)
    return _mapped_gather(mt, indices)


def scatter(mt, indices, rows) -> None:
    mt.memory._check_open()
    if mt.memory.kind == "distributed":
        _distributed_scatter(mt, indices, rows)
    else:
        _mapped_scatter(mt, indices, rows)
