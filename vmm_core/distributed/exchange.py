"""Gather and scatter rows by index, the same call for every kind of mapped tensor.

Mapped kinds (``continuous``, ``chunked``, host location) read and write through this
process's mapping (:mod:`.mapped_rows`): one indexing kernel per part, no collective.

``kind="distributed"`` moves rows with the group's collectives, as WholeMemory does:

1. the group's call header (:meth:`Group.header
   <vmm_core.distributed.group.Group.header>`, the first collective of every vmm_core
   operation on a group) names the call (gather or scatter) and the tensor: ranks that
   made different calls (a gather against another tensor's gather, a scatter, a group
   sleep, a close or a new mapped tensor) all raise the same CallMismatchError at once
   instead of exchanging rows of the wrong tensor silently, or waiting on each other's
   mismatched collectives until the group's timeout.  It carries every rank's number of
   indices, from which every rank picks the same number of pieces (below);
2. the counts: one ``all_to_all_single`` of two numbers per pair of ranks, how many rows
   a rank wants from each owner and whether its arguments are wrong (indices out of
   range are counted on the device, bucketed apart, so that takes no sync of its own).
   One host read of the counts is the call's only wait for the device before the rows
   move; a rank whose arguments are wrong makes every rank raise the same error here,
   with nothing moved;
3. the indices travel to their owners (``all_to_all_single``, uneven splits), and each
   rank makes room for what it will receive; then one ``all_reduce`` of a failure flag
   (a scatter also folds its rows-named-twice check into it), so a rank that could not
   make room makes every rank raise the same :class:`DistributedError` before any row
   travels, instead of leaving the others waiting in the next exchange;
4. the rows travel in pieces, one ``all_to_all_single`` each, issued without waiting:
   while the group moves piece ``c`` the device reads the owner's rows of piece
   ``c + 1`` (gather) or writes the rows of piece ``c - 1`` into place.  Rows a rank
   owns itself never enter a collective: one kernel reads or writes them meanwhile.

Rows travel as machine words (:func:`~.indices.as_words`), so any dtype works with both
NCCL and gloo (gloo's ``all_to_all_single`` takes uneven splits on CPU tensors).
Exchanges run on the device the group's backend uses (CPU for gloo, the tensor's device
for NCCL).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from ..errors import DistributedError, SleepStateError
from . import mapped_rows
from .indices import (
    as_words,
    index_tensor,
    range_failure,
    refuse_duplicates,
    row_tensor,
    word_dtype,
)

__all__ = ["gather", "scatter", "PIECE_BYTES", "MAX_PIECES"]

#: rows move in pieces of about this many bytes a rank (at most MAX_PIECES), so that the
#: device reads or writes one piece while the group moves another
PIECE_BYTES = 32 << 20
MAX_PIECES = 8


# ------------------------------------------------------------------ distributed kind
def _pieces(n: int, count: int) -> list[tuple[int, int]]:
    """``count`` consecutive ranges splitting ``n`` rows as evenly as they go; the
    sender and the receiver of a segment compute the same from its length."""
    return [(n * c // count, n * (c + 1) // count) for c in range(count)]


class _Exchange:
    """One gather or scatter call of a distributed tensor: the steps every rank takes
    together, and the first failure of this rank, which it keeps until the end."""

    def __init__(self, mt, what: str) -> None:
        import torch.distributed as dist

        self.mt, self.what, self.dist = mt, what, dist
        memory = mt.memory
        self.group = memory._group
        self.world = memory.world_size
        self.me = memory.rank
        self.per = memory.partition.rows_per_rank
        self.row_bytes = memory.partition.row_bytes
        self.words = word_dtype(self.row_bytes)
        self.failure: BaseException | None = None
        self.on = self.group._tensor_device()  # where the collectives take tensors
        self.pieces = 1

    # -------------------------------------------------------------- collective steps
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

    def counts(self, plan):
        """Steps 1 and 2: the header (with every rank's number of indices, which fixes
        the number of pieces), then what each rank wants from each owner and whether it
        failed.  Returns (rows this rank wants from each owner, rows each rank wants
        from this one)."""
        import torch

        table = self.group.header(f"mt.{self.what}", self.mt.memory._call_id, plan.asked)
        remote = sum(row[0] for row in table) * self.row_bytes * (self.world - 1) / \
            max(1, self.world ** 2)
        self.pieces = max(1, min(MAX_PIECES, math.ceil(remote / PIECE_BYTES)))
        if self.failure is None:
            assert plan.counts is not None
            wanted = torch.stack([plan.counts[:self.world],
                                  (plan.counts[self.world] > 0).long().expand(self.world)],
                                 dim=1).to(self.on)
        else:
            wanted = torch.tensor([[0, 1]] * self.world, dtype=torch.int64, device=self.on)
        asked = torch.empty_like(wanted)
        self.step("exchanging row counts", self.dist.all_to_all_single, asked, wanted)
        mine = wanted[:, 0] if plan.counts is None else plan.counts[:self.world].to(self.on)
        numbers = torch.cat([asked.flatten(), mine]).tolist()  # the one wait for the counts
        recv = numbers[0:2 * self.world:2]
        failed = [r for r in range(self.world) if numbers[2 * r + 1]]
        send = numbers[2 * self.world:]
        if self.failure is None and self.me in failed:  # indices out of range, found here
            self.fail(range_failure(self.mt, plan.indices, self.what))
        if failed:
            self.raise_agreed()
        return send, recv

    def raise_agreed(self):
        """Every rank knows some rank failed: agree on the messages and raise them."""
        self.group.agree(f"mt.{self.what} on a distributed tensor", None, self.failure,
                         self.mt.memory._call_id)
        raise DistributedError(f"mt.{self.what}: a rank reported a failure that the "
                               f"agreement did not see")  # agree() raised already

    def finish(self, name: str, flag=None, explain=None) -> None:
        """One flag per rank, reduced: did any rank fail since the counts?  ``flag``: a
        device tensor of one int32 this rank computed (a check on the device), folded
        in without a wait of its own; where it is set, ``explain()`` raises the error
        this rank reports."""
        import torch

        mine = torch.tensor([0 if self.failure is None else 1], dtype=torch.int32,
                            device=self.on)
        if flag is not None:
            mine = torch.maximum(mine, flag.to(self.on))
        self.step(name, self.dist.all_reduce, mine, op=self.dist.ReduceOp.MAX)
        if int(mine.item()):
            if self.failure is None and flag is not None and explain is not None \
                    and int(flag.item()):
                try:
                    explain()
                except Exception as exc:
                    self.fail(exc)
            self.raise_agreed()

    def rows(self, n: int):
        import torch

        return torch.empty((n, self.row_bytes // self.words.itemsize), dtype=self.words,
                           device=self.on)

    def move(self, out, inp, out_splits, in_splits):
        """One piece of rows to every rank, without waiting for it (the wait is the
        returned work's ``wait()``)."""
        return self.step("moving rows", self.dist.all_to_all_single, out, inp, out_splits,
                         in_splits, async_op=True)


class _Plan:
    """This rank's side of the call: its indices checked (cheaply) and sorted by owner on
    the device, indices out of range counted in an extra bucket (no device sync)."""

    def __init__(self, ex: _Exchange, indices, rows=None) -> None:
        import torch

        self.indices, self.asked = indices, 0
        # torch tensors once made; None where this rank's arguments were refused
        self.counts: Any = None
        self.order: Any = None
        self.local: Any = None
        self.rows: Any = None
        try:
            idx = index_tensor(ex.mt, indices, ex.what)
            self.indices = idx
            if rows is not None:
                self.rows = as_words(row_tensor(ex.mt, rows, idx.numel()), ex.row_bytes)
            idx = idx.long()
            bad = (idx < 0) | (idx >= ex.mt.shape[0])
            owners = torch.where(bad, ex.world, torch.div(idx, ex.per, rounding_mode="floor"))
            # sorted, the owners give the counts too (bincount would wait for the device)
            ranked, self.order = torch.sort(owners, stable=True)
            edges = torch.searchsorted(ranked, torch.arange(ex.world + 2, device=idx.device))
            self.counts = edges[1:] - edges[:-1]
            self.local = idx[self.order] - ranked * ex.per
            self.asked = idx.numel()
        except Exception as exc:
            ex.fail(exc)


def _segments(counts: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's run in a buffer that holds ``counts`` in order."""
    out, start = [], 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def _slices(t, ranges):
    """The rows of ``t`` in ``ranges`` (``[start, end)``), in order: a view for one."""
    import torch

    ranges = [(s, e) for s, e in ranges if e > s]
    if len(ranges) == 1:
        return t[ranges[0][0]:ranges[0][1]]
    return torch.cat([t[s:e] for s, e in ranges]) if ranges else t[:0]


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


def _to(t, device):
    return t if t.device == device else t.to(device)


def _pick(rows, which, out) -> None:
    """``out[:] = rows[which]``: one kernel writing straight into ``out`` (a piece of a
    send buffer) where both are on one device."""
    import torch

    if out.device == rows.device:
        torch.index_select(rows, 0, _to(which, rows.device), out=out)
    else:
        out.copy_(rows.index_select(0, _to(which, rows.device)))


class _Routes:
    """Where each row of one call is, on both sides, piece by piece.

    ``order``: this rank's indices sorted by owner (``plan.order``), cut into one run per
    owner by ``send``; ``theirs``: the indices other ranks sent this rank (owner-local),
    one run per requester by ``recv``.  Rows of this rank's own part take no part in the
    collectives: their splits are 0 and :attr:`own` is their run of ``order``."""

    def __init__(self, ex: _Exchange, send: list[int], recv: list[int]) -> None:
        me, pieces = ex.me, ex.pieces
        self.pieces = pieces
        self.mine = _segments(send)  # of plan.order / plan.local, by owner
        self.own = self.mine[me]
        self.out_splits = [0 if r == me else n for r, n in enumerate(send)]
        self.in_splits = [0 if r == me else n for r, n in enumerate(recv)]
        self.theirs = _segments(self.in_splits)  # of the received indices, by requester
        self.my_cut = [_pieces(n, pieces) for n in self.out_splits]
        self.their_cut = [_pieces(n, pieces) for n in self.in_splits]

    def to_owners(self, ex: _Exchange, local):
        """Step 3's exchange: every index a remote owner holds, to it."""
        import torch

        s, e = self.own
        remote = torch.cat([local[:s], local[e:]]) if e > s else local
        received = torch.empty(sum(self.in_splits), dtype=torch.int64, device=ex.on)
        ex.step("sending indices to their owners", ex.dist.all_to_all_single, received,
                _to(remote, ex.on), self.in_splits, self.out_splits)
        return received

    def mine_in(self, c: int) -> tuple[list, list[int]]:
        """Piece ``c`` of this rank's requests: runs of ``order``, and rows per owner."""
        runs = [(s + lo, s + hi) for (s, _), (lo, hi) in
                zip(self.mine, (cut[c] for cut in self.my_cut))]
        return runs, [e - s for s, e in runs]

    def theirs_in(self, c: int) -> tuple[list, list[int]]:
        """Piece ``c`` of the other ranks' requests: runs of the received indices, and
        rows per requester."""
        runs = [(s + lo, s + hi) for (s, _), (lo, hi) in
                zip(self.theirs, (cut[c] for cut in self.their_cut))]
        return runs, [e - s for s, e in runs]


def _distributed_gather(mt, indices):
    import torch

    ex = _Exchange(mt, "gather")
    with contextlib.ExitStack() as stack:
        ex.hold(stack)
        plan = _Plan(ex, indices)
        send, recv = ex.counts(plan)
        routes = _Routes(ex, send, recv)
        out = got = reply = part = None
        try:  # room for every row this rank receives, before any row travels
            out = torch.empty((plan.asked,) + tuple(mt.shape[1:]), dtype=mt.dtype,
                              device=mt.device)
            got = ex.rows(sum(routes.out_splits))
            reply = ex.rows(sum(routes.in_splits))
            part = as_words(mt.local_part(), ex.row_bytes)
        except Exception as exc:
            ex.fail(exc)
        wanted = routes.to_owners(ex, plan.local)
        ex.finish("agreeing that every owner can read its rows")  # before any row travels
        assert out is not None and got is not None and reply is not None and part is not None
        out_words = as_words(out, ex.row_bytes)
        wanted = _to(wanted, part.device)

        def own() -> None:  # rows of this rank's own part: read and placed meanwhile
            s, e = routes.own
            if e > s:
                rows = part.index_select(0, _to(plan.local[s:e], part.device))
                out_words.index_copy_(0, plan.order[s:e], _to(rows, out.device))

        _in_pieces(ex, routes, reply, got, owners_send=True,
                   fill=lambda runs, piece: _pick(part, _slices(wanted, runs), piece),
                   own=own,
                   place=lambda runs, piece: out_words.index_copy_(
                       0, _slices(plan.order, runs), _to(piece, out.device)))
    return out


def _in_pieces(ex: _Exchange, routes: _Routes, outgoing, incoming, owners_send: bool,
               fill, own, place) -> None:
    """Step 4: the rows in pieces.  Piece ``c`` is filled (``fill(runs, piece of
    outgoing)``) and its exchange issued without waiting, so filling piece ``c + 1``
    overlaps moving piece ``c``; then ``own()`` (this rank's own rows, no collective),
    then each piece, once here, goes into place (``place(runs, piece of incoming)``).
    ``owners_send``: the owners send what the others asked for (gather), else the
    requesters send their rows to the owners (scatter)."""
    sent = routes.theirs_in if owners_send else routes.mine_in
    received = routes.mine_in if owners_send else routes.theirs_in
    works, at_out, at_in = [], 0, 0
    for c in range(routes.pieces):
        runs, out_splits = sent(c)
        n = sum(out_splits)
        if n:
            fill(runs, outgoing[at_out:at_out + n])
        back_runs, in_splits = received(c)
        m = sum(in_splits)
        works.append((ex.move(incoming[at_in:at_in + m], outgoing[at_out:at_out + n],
                              in_splits, out_splits), at_in, m, back_runs))
        at_out, at_in = at_out + n, at_in + m
    own()
    for work, at, m, back_runs in works:
        work.wait()
        if m:
            place(back_runs, incoming[at:at + m])


def _noting(ex: _Exchange, fn):
    """``fn`` whose failure is this rank's, reported by the next flag, not raised."""
    def call(*args) -> None:
        try:
            fn(*args)
        except Exception as exc:
            ex.fail(exc)
    return call


def _written_twice(targets):
    """A device flag (int32, one element): does ``targets`` name a row twice?  Read by
    the flag's reduction, never here."""
    import torch

    if targets.numel() < 2:
        return None
    ranked = torch.sort(targets).values
    return (ranked[1:] == ranked[:-1]).any().to(torch.int32).reshape(1)


def _distributed_scatter(mt, indices, rows) -> None:
    import torch

    ex = _Exchange(mt, "scatter")
    with contextlib.ExitStack() as stack:
        ex.hold(stack)
        plan = _Plan(ex, indices, rows)
        send, recv = ex.counts(plan)
        routes = _Routes(ex, send, recv)
        incoming = moved = part = None
        try:  # room for every row this rank receives, before any row travels
            part = as_words(mt.local_part(), ex.row_bytes)
            incoming = ex.rows(sum(routes.in_splits))
            moved = ex.rows(sum(routes.out_splits))
        except Exception as exc:
            ex.fail(exc)
        targets = routes.to_owners(ex, plan.local)
        s, e = routes.own
        every = torch.cat([_to(targets, plan.local.device), plan.local[s:e]])

        def explain() -> None:  # the flag said this rank's rows are named twice
            refuse_duplicates(every, f" (rank {ex.me} owns them, and the ranks' indices "
                                     f"together name them)", first=ex.me * ex.per)

        # before any row travels: no row named twice, every owner has room for its rows
        ex.finish("agreeing that no row is written twice", _written_twice(every), explain)
        assert incoming is not None and moved is not None and part is not None
        targets = _to(targets, part.device)

        def own() -> None:  # rows of this rank's own part: written meanwhile
            if e > s:
                part.index_copy_(0, _to(plan.local[s:e], part.device),
                                 _to(plan.rows.index_select(0, plan.order[s:e]), part.device))

        def place(runs, piece) -> None:
            part.index_copy_(0, _slices(targets, runs), _to(piece, part.device))

        _in_pieces(ex, routes, moved, incoming, owners_send=False,
                   fill=lambda runs, piece: _pick(plan.rows, _slices(plan.order, runs), piece),
                   own=_noting(ex, own), place=_noting(ex, place))
        ex.finish("agreeing that every owner wrote its rows")


# ------------------------------------------------------------------ entry points
def gather(mt, indices):
    mt.memory._check_open()
    if mt.memory.kind == "distributed":
        return _distributed_gather(mt, indices)
    return mapped_rows.gather(mt, indices)


def scatter(mt, indices, rows) -> None:
    mt.memory._check_open()
    if mt.memory.kind == "distributed":
        _distributed_scatter(mt, indices, rows)
    else:
        mapped_rows.scatter(mt, indices, rows)
