"""The object every kind of mapped tensor is built on: rows shared by the ranks.

:class:`MappedMemory` holds this rank's share (:class:`~.process_share.ProcessShare`),
the partition and where every part is in this process; ``close()`` is collective, and a
finalizer frees this process's share of an object dropped without it.  Torch views
made over the memory carry a token on their storage, so a view that outlives ``close()``
keeps its mappings until it is dropped.
"""

from __future__ import annotations

import threading
import weakref

from ..errors import CallMismatchError, DistributedError, MappingError, VMMError
from ..memory import reaper
from .group import Group
from .partition import Partition
from .process_share import ProcessShare

__all__ = ["MappedMemory", "ViewToken", "release_after"]


class MappedMemory:
    """Rows shared by the ranks of a group; every rank addresses every row directly.

    Addresses are device addresses of this process (host addresses on the host
    backend).  :meth:`close` is collective; if the object is dropped without it, a
    finalizer frees this process's mappings and handles.
    """

    def __init__(self, group: Group, local: ProcessShare, partition: Partition, kind: str,
                 location: str, bases: dict[int, int], base: int | None) -> None:
        self._group = group
        self._local = local
        self.partition = partition
        self.kind = kind
        self.location = location
        self.rank = group.rank
        self.world_size = group.size
        self.backend = local.backend
        self.device = local.device
        self._bases = bases          # owner rank -> address of its part in this process
        self.address = base          # the whole array (continuous, host); None if chunked
        self._closed = False
        #: the same on every rank (rank 0's random number): every collective call on
        #: this memory (close, a distributed gather or scatter) names it in the group's
        #: call header, so ranks that call on different tensors refuse together
        self._call_id = 0
        #: one token per torch view made over this memory; a token lives as long as any
        #: tensor sharing that view's storage (see MappedTensor._view)
        self._views: weakref.WeakSet = weakref.WeakSet()
        # dropped without close(): free this process's part on the reaper thread, never
        # inside the garbage collector, which may run while a backend lock is held
        reaper.start()
        self._finalizer = weakref.finalize(self, reaper.close_later, local.release)

    @property
    def nbytes(self) -> int:
        return self.partition.nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    def part_address(self, rank: int) -> int | None:
        """Where rank ``rank``'s rows are in this process (None if it owns none, or,
        for ``kind="distributed"``, if it is another rank: its rows are not mapped here)."""
        self._check_open()
        return self._bases.get(rank)

    def part_bytes(self, rank: int) -> int:
        return self.partition.part_bytes(rank)

    def row_range(self, rank: int | None = None) -> tuple[int, int]:
        return self.partition.row_range(self.rank if rank is None else rank)

    def close(self) -> None:
        """Collective: waits for every rank, frees this process's share, and returns once
        every rank has freed its own.  Idempotent.

        The second wait is what makes the device memory free on return: a rank's part is
        only released by the driver when every rank that imported it has let it go (seen
        on two H200s: 512 MiB still held right after the owner's own release).

        A torch view of this memory that is still alive here (``tensor``, ``chunks``,
        ``local_part()`` or anything sliced from them) keeps this rank's mappings until
        the last such view is dropped, so reading it never touches unmapped memory (which
        crashes the process); it is then not shared with the other ranks any more."""
        if self._closed:
            return
        # a block holding this rank's part awake on this thread (hold_awake of its tag, a
        # gather) goes on using it: every rank refuses together, nothing closed anywhere
        held = next(filter(None, (a.held_here() for a in self._local.allocators)), None)
        refusal = None if held is None else \
            f"rank {self.rank}: close() inside {held}, which holds its part awake"
        failure, refused = None, []
        try:
            self.backend.synchronize(self.device)  # our kernels may still read the rows
            refused = [r for r in self._group.gather(refusal, "closing mapped memory",
                                                     self._call_id) if r]
        except CallMismatchError:
            raise  # the ranks are in different calls: none closes, the group is in step
        except VMMError as exc:
            failure = exc
            refused = [refusal] if refusal else []
        if refused:
            raise DistributedError(f"mapped memory was not closed (on any rank that could "
                                   f"be asked): {'; '.join(refused)}. Leave that with "
                                   f"block first, then close() on every rank"
                                   + (f" (the ranks could not be asked: {failure})"
                                      if failure is not None else ""))
        self._closed = True
        views = list(self._views)
        if views:
            problems: list[str] = []
            self._local.untag()
            release_after(views, self._local.release)
        else:
            problems = self._local.release()
        self._finalizer.detach()
        if failure is None:
            try:
                self._group.gather(None, "releasing mapped memory", self._call_id)
            except VMMError as exc:
                failure = exc
        if failure is not None:
            # from None: the message says it all, and the failure's traceback would hold
            # this frame (and the group) in a reference cycle
            raise DistributedError(f"mapped memory was freed on rank {self.rank}, but the "
                                   f"other ranks could not be waited for: {failure}") \
                from None
        if problems:
            raise MappingError(f"closing mapped memory on rank {self.rank}: "
                               f"{'; '.join(problems)}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise VMMError("this mapped memory is closed; create a new one with "
                           "vmm_core.distributed.mapped_tensor(...)")

    def __repr__(self) -> str:
        return (f"<MappedMemory {self.kind} {self.location} rank {self.rank}/"
                f"{self.world_size} {self.nbytes} B{' closed' if self._closed else ''}>")


class ViewToken:
    """Rides on a view's storage: keeps the memory alive while the view lives (so the
    finalizer cannot free it under the view) and lets ``close`` see that views remain."""

    __slots__ = ("memory", "__weakref__")

    def __init__(self, memory: MappedMemory) -> None:
        self.memory = memory


def release_after(tokens: list, release) -> None:
    """Run ``release`` on the reaper thread once every token is gone."""
    remaining = [len(tokens)]
    lock = threading.Lock()

    def gone() -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            reaper.close_later(release)

    reaper.start()
    for token in tokens:
        weakref.finalize(token, gone)

