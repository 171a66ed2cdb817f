"""Memory that every rank of a node maps: WholeMemory's mapped types on the vmm_api.

One logical array of ``rows`` rows (``row_bytes`` each) is split between the ranks of a
``torch.distributed`` group as NVIDIA WholeGraph's WholeMemory does it: rank ``r`` owns
one contiguous run of rows, every run is a multiple of a caller-chosen number of rows
(rows are never split) and its bytes are a multiple of the backend's granularity, so
the runs can be mapped side by side.  Then:

* ``location="device"``, ``kind="continuous"``: each rank creates the physical memory
  of its own run (an exportable handle), the handles are exchanged, and every rank
  reserves one virtual range for the whole array and maps every run into it, so the
  array is one flat range on every rank;
* ``kind="chunked"``: every run is mapped into its own range (one view per rank);
* ``location="host"``: one host allocation (a memfd) shared by all ranks, mapped by
  each and made accessible to its device (``vmm_host_register``);
* ``kind="distributed"``: nothing is mapped across processes.  Each rank allocates only
  its own run (device memory through a :class:`SharedVMMAllocator`, so it can be tagged
  and put to sleep; or host memory registered with its device), and other ranks' rows
  are reached by :meth:`MappedTensor.gather` / :meth:`MappedTensor.scatter`, which move
  them with the group's collectives (:mod:`.exchange`).  No handle is exchanged, so the
  ranks may be on different nodes: the type that scales past one machine.

Handles travel as the backend declares (``BackendCapabilities.shareable_handles``):
file descriptors over Unix sockets (:mod:`.fd_passing`), vendor integers through the
group's object collectives.  Mapped memory is single-node: ranks on different hosts
are refused (the distributed kind is not).  Every step is agreed by all ranks
(:mod:`.group`), so a failure on one rank makes every rank release what it made and
raise the same error.
"""

from __future__ import annotations

import math
import mmap
import operator
import os
import secrets
import socket
import threading
import weakref
from dataclasses import dataclass, field

from ..backend import Backend
from ..errors import (
    CallMismatchError,
    DistributedError,
    MappingError,
    OutOfMemoryError,
    VMMError,
)
from ..memory import reaper
from ..memory.host_memory import host_refusal, host_room
from ..sizes import byte_count
from .fd_passing import FdMailbox, send_fds
from .group import Group

__all__ = [
    "KINDS",
    "LOCATIONS",
    "Partition",
    "partition_rows",
    "MappedMemory",
    "MappedTensor",
    "mapped_memory",
    "mapped_tensor",
]

KINDS = ("continuous", "chunked", "distributed")
LOCATIONS = ("device", "host")
DEFAULT_TIMEOUT = 60.0


# ------------------------------------------------------------------ partition rule
@dataclass(frozen=True)
class Partition:
    """Which rows each rank owns: rank ``r`` owns ``[r * rows_per_rank, ...)``."""

    rows: int
    row_bytes: int
    world: int
    rows_per_rank: int

    def row_range(self, rank: int) -> tuple[int, int]:
        start = min(rank * self.rows_per_rank, self.rows)
        return start, min(start + self.rows_per_rank, self.rows)

    def part_bytes(self, rank: int) -> int:
        start, end = self.row_range(rank)
        return (end - start) * self.row_bytes

    @property
    def slot_bytes(self) -> int:
        """Distance between the starts of two consecutive parts."""
        return self.rows_per_rank * self.row_bytes

    @property
    def owners(self) -> list[int]:
        """Ranks that own at least one row."""
        return [r for r in range(self.world) if self.part_bytes(r)]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def partition_rows(rows: int, row_bytes: int, world: int, granularity: int = 1,
                   alignment: int = 1) -> Partition:
    """Split ``rows`` between ``world`` ranks (WholeMemory's rule).

    Every rank but the last owners gets the same number of rows: the smallest multiple
    of ``granularity`` rows, whose bytes are also a multiple of ``alignment`` (the
    backend's granularity, so parts can be mapped side by side), that lets ``world``
    ranks hold all rows.  With large alignments small arrays live on fewer ranks.
    """
    for name, value in (("rows", rows), ("row_bytes", row_bytes), ("world", world),
                        ("granularity", granularity), ("alignment", alignment)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise VMMError(f"partition: {name} must be a positive int, got {value!r}")
    rows_for_alignment = alignment // math.gcd(alignment, row_bytes)
    unit = math.lcm(granularity, rows_for_alignment)
    per = -(-rows // world)
    per = -(-per // unit) * unit
    return Partition(rows, row_bytes, world, per)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


# ------------------------------------------------------------------ what one process holds
@dataclass(eq=False)
class _Local:
    """Everything one rank created for one mapped object.  ``release`` frees it all
    without talking to other ranks (the finalizer calls it), and is idempotent."""

    backend: Backend
    device: int
    maps: list = field(default_factory=list)      # (address, size) device mappings
    ranges: list = field(default_factory=list)    # (address, size) reservations
    handles: list = field(default_factory=list)   # own and imported handles
    fds: list = field(default_factory=list)       # descriptors not yet closed
    host_maps: list = field(default_factory=list)  # mmap.mmap objects
    registered: list = field(default_factory=list)  # host addresses given to host_register
    allocators: list = field(default_factory=list)  # the distributed kind's own part
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> list[str]:
        """Free everything; returns what could not be freed (never raises)."""
        problems: list[str] = []
        with self.lock:
            be, dev = self.backend, self.device

            def attempt(what, fn, *args):
                try:
                    fn(*args)
                except Exception as exc:  # keep freeing the rest
                    problems.append(f"{what}: {exc}")

            if self.maps or self.registered:
                attempt("synchronize", be.synchronize, dev)
            for address in self.registered:
                attempt("host_unregister", be.host_unregister, dev, address)
            for address, size in self.maps:
                attempt("unmap", be.unmap, dev, address, size)
            for address, size in self.ranges:
                attempt("release_range", be.release_range, dev, address, size)
            for handle in self.handles:
                attempt("release_handle", be.release_handle, dev, handle)
            for mm in self.host_maps:
                attempt("munmap", mm.close)
            for fd in self.fds:
                attempt("close", os.close, fd)
            for alloc in self.allocators:
                if alloc.tag:
                    attempt("untag", _tagged().unregister, alloc.tag, alloc)
                attempt("close allocator", alloc.close)
            self.allocators = []
            self.maps, self.ranges, self.handles = [], [], []
            self.host_maps, self.registered, self.fds = [], [], []
        return problems

    def untag(self) -> None:
        """Take the distributed kind's part out of its tag now, even if views delay its
        release: a later ``vmm_core.sleep`` must not unmap memory under a stale view."""
        for alloc in self.allocators:
            if alloc.tag:
                _tagged().unregister(alloc.tag, alloc)

    def close_fd(self, fd: int) -> None:
        os.close(fd)
        self.fds.remove(fd)


# ------------------------------------------------------------------ node identity
def _node_identity() -> dict:
    """What must be equal for two processes to share memory: host and boot, plus the
    network namespace (abstract Unix sockets do not cross it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "unknown"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return {"host": socket.gethostname(), "boot": boot, "netns": netns}


def _check_same_node(infos: list[dict]) -> None:
    hosts: dict[tuple, list[int]] = {}
    for rank, info in enumerate(infos):
        node = info["node"]
        hosts.setdefault((node["host"], node["boot"]), []).append(rank)
    if len(hosts) > 1:
        where = "; ".join(f"ranks {ranks} on host {h!r}" for (h, _), ranks in hosts.items())
        raise DistributedError(
            f"mapped memory is single-node, but this group spans {len(hosts)} hosts "
            f"({where}). Create it over a group of the ranks of one node, e.g. "
            f"torch.distributed.new_group(<ranks on this node>), and move data between "
            f"nodes with collectives")
    spaces: dict[int, list[int]] = {}
    for rank, info in enumerate(infos):
        spaces.setdefault(info["node"]["netns"], []).append(rank)
    if len(spaces) > 1:
        raise DistributedError(
            f"the ranks run on one host but in {len(spaces)} network namespaces "
            f"(containers: {sorted(spaces.values())}); file descriptors cannot be passed "
            f"between them over abstract Unix sockets. Run the ranks in one container, or "
            f"with the host network namespace")


# ------------------------------------------------------------------ the mapped object
class MappedMemory:
    """Rows shared by the ranks of a group; every rank addresses every row directly.

    Addresses are device addresses of this process (host addresses on the host
    backend).  :meth:`close` is collective; if the object is dropped without it, a
    finalizer frees this process's mappings and handles.
    """

    def __init__(self, group: Group, local: _Local, partition: Partition, kind: str,
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
        the last such view is dropped: reading it then never touches unmapped memory (it
        used to crash the process), but it is no longer shared with the other ranks."""
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
            _release_after(views, self._local.release)
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


class _ViewToken:
    """Rides on a view's storage: keeps the memory alive while the view lives (so the
    finalizer cannot free it under the view) and lets ``close`` see that views remain."""

    __slots__ = ("memory", "__weakref__")

    def __init__(self, memory: MappedMemory) -> None:
        self.memory = memory


def _release_after(tokens: list, release) -> None:
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


class MappedTensor:
    """A torch tensor whose rows are spread over the ranks' memory (WholeMemory).

    ``tensor`` is the whole tensor (``kind="continuous"`` or host location), ``chunks``
    the list of every rank's part, ``local_part()`` this rank's part.  Writes through
    any of them are seen by every rank (after the usual synchronization).  Tensors stay
    valid until :meth:`close`; they keep the memory alive if the object is dropped.
    ``kind="distributed"`` has only ``local_part()``: other ranks' rows are not mapped
    here, and :meth:`gather` / :meth:`scatter` reach them (they work for every kind).
    """

    def __init__(self, memory: MappedMemory, shape: tuple, dtype) -> None:
        self.memory = memory
        self.shape = shape
        self.dtype = dtype
        self._tensor = None
        self._chunks: list | None = None

    def _view(self, address: int, nbytes: int):
        rows = nbytes // self.memory.partition.row_bytes
        raw = self.memory.backend.torch_tensor(self.memory.device, address, nbytes)
        # torch keeps a storage's Python object (and so this token) alive while any view
        # of it lives: the mapping cannot be freed under a tensor by the finalizer
        token = _ViewToken(self.memory)
        raw.untyped_storage()._vmm_core_owner = token
        self.memory._views.add(token)
        return raw.view(self.dtype).view((rows,) + tuple(self.shape[1:]))

    def _not_mapped(self, what: str):
        return VMMError(f"kind='distributed' maps no other rank's rows into this process, "
                        f"so it has no {what}: read rows with mt.gather(indices), write them "
                        f"with mt.scatter(indices, rows), or use mt.local_part() for this "
                        f"rank's own rows (or create it with kind='continuous' on one node)")

    @property
    def kind(self) -> str:
        return self.memory.kind

    @property
    def device(self):
        """The torch device every view and every gather result lives on."""
        ops = self.memory.backend.graph_ops(self.memory.device)
        if ops is None:
            import torch

            return torch.device("cpu")
        return ops.torch_device

    @property
    def tensor(self):
        self.memory._check_open()
        if self.memory.kind == "distributed":
            raise self._not_mapped("single tensor (mt.tensor)")
        if self._tensor is None:
            if self.memory.address is None:
                raise VMMError("kind='chunked' maps every rank's part into its own range: "
                               "there is no single tensor; use .chunks or local_part(), or "
                               "create the tensor with kind='continuous'")
            self._tensor = self._view(self.memory.address, self.memory.nbytes)
        return self._tensor

    @property
    def chunks(self) -> list:
        self.memory._check_open()
        if self.memory.kind == "distributed":
            raise self._not_mapped("other ranks' parts (mt.chunks)")
        if self._chunks is None:
            mem, part = self.memory, self.memory.partition
            if mem.address is not None:
                whole = self.tensor
                self._chunks = [whole[slice(*part.row_range(r))] for r in range(part.world)]
            else:
                views = {r: self._view(mem._bases[r], part.part_bytes(r)) for r in part.owners}
                empty = next(iter(views.values()))[:0]
                self._chunks = [views.get(r, empty) for r in range(part.world)]
        return self._chunks

    def local_part(self):
        """This rank's rows (possibly empty)."""
        if self.memory.kind != "distributed":
            return self.chunks[self.memory.rank]
        self.memory._check_open()
        if self._chunks is None:
            import torch

            mem = self.memory
            mine = mem.part_address(mem.rank)
            if mine is None:
                view = torch.empty((0,) + tuple(self.shape[1:]), dtype=self.dtype,
                                   device=self.device)
            else:
                view = self._view(mine, mem.part_bytes(mem.rank))
            self._chunks = [view]
        return self._chunks[0]

    def gather(self, indices):
        """Rows ``indices`` (a 1-D int64/int32 tensor on :attr:`device`), as a new tensor
        of shape ``(len(indices),) + shape[1:]``.

        Mapped kinds read through this process's mapping (no collective: one rank may
        call alone).  ``kind="distributed"`` is collective over the tensor's group:
        every rank must call (with its own indices, empty included), and a rank that
        fails makes every rank raise the same DistributedError."""
        from . import exchange

        return exchange.gather(self, indices)

    def scatter(self, indices, rows) -> None:
        """Write ``rows`` (shape ``(len(indices),) + shape[1:]``, this tensor's dtype and
        device) to rows ``indices``.  A row named twice is refused (nothing written).

        Collective for ``kind="distributed"``, where a row named by two ranks is refused
        too; for mapped kinds a local write that other ranks see after they synchronize
        with this one (two ranks writing one row at once race, as any shared memory)."""
        from . import exchange

        exchange.scatter(self, indices, rows)

    def close(self) -> None:
        self._tensor = self._chunks = None
        self.memory.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<MappedTensor {tuple(self.shape)} {self.dtype} {self.memory!r}>"


# ------------------------------------------------------------------ public constructors
def mapped_tensor(shape, dtype, group=None, kind: str = "continuous", location: str = "device",
                  *, granularity: int = 1, backend=None, device: int | None = None,
                  timeout: float = DEFAULT_TIMEOUT, tag: str | None = None) -> MappedTensor:
    """Collective: a tensor of ``shape`` whose rows live on all ranks of ``group``.

    :param group: a ``torch.distributed`` group (None: the default group); gloo and NCCL
        groups both work.  The mapped kinds need ranks of one node.
    :param kind: ``"continuous"`` (one tensor on every rank), ``"chunked"`` (one tensor
        per rank's part, ``.chunks``) or ``"distributed"`` (each rank holds only its
        part; rows are reached by :meth:`MappedTensor.gather` / ``scatter``; any nodes).
    :param location: ``"device"`` (each rank's part in its device memory) or ``"host"``
        (host memory its device accesses: one allocation shared by the ranks for the
        mapped kinds, one per rank for ``"distributed"``).
    :param granularity: every part is a multiple of this many rows (first-dimension
        entries); rows are never split.
    :param backend: a vmm_core backend or name (default: detected); ``device`` its
        device (default: the framework's current device).
    :param timeout: seconds to wait for other ranks' file descriptors.
    :param tag: ``kind="distributed"``, ``location="device"`` only: put this rank's part
        under this tag, so ``vmm_core.sleep(tag)`` (or ``group=``) releases it.

    Every rank must call it with the same arguments; they are compared before anything
    is allocated.  Raises DistributedError (on every rank, with the same message) if
    any rank fails or was given different arguments.
    """
    failure: BaseException | None = None
    rows = row_bytes = 0
    tensor_spec = None
    be = None
    try:
        import torch

        if not isinstance(shape, (tuple, list, int)) or isinstance(shape, bool):
            raise VMMError(f"mapped_tensor: shape must be a tuple of ints, got {shape!r}")
        dims = shape if isinstance(shape, (tuple, list)) else (shape,)
        if any(isinstance(s, bool) or not hasattr(s, "__index__") for s in dims):
            raise VMMError(f"mapped_tensor: shape must be a tuple of ints, got {shape!r}")
        shape = tuple(operator.index(s) for s in dims)
        if not shape or any(s <= 0 for s in shape):
            raise VMMError(f"mapped_tensor: shape must have at least one dimension and no "
                           f"empty one, got {shape}")
        if not isinstance(dtype, torch.dtype):
            raise VMMError(f"mapped_tensor: dtype must be a torch.dtype, got {dtype!r}")
        tensor_spec = (shape, str(dtype))
        be = _resolve_backend(backend)
        be.require_torch_tensors()
        rows = shape[0]
        row_bytes = math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()
    except Exception as exc:
        failure = exc
    memory = _create("mapped_tensor", rows, row_bytes, group, kind, location, granularity,
                     be if be is not None else backend, device, timeout, tag, tensor_spec,
                     failure)
    return MappedTensor(memory, shape, dtype)


def mapped_memory(rows: int, row_bytes: int, group=None, kind: str = "continuous",
                  location: str = "device", *, granularity: int = 1, backend=None,
                  device: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                  tag: str | None = None) -> MappedMemory:
    """Collective: ``rows`` rows of ``row_bytes`` spread over the ranks, as raw addresses.

    What :func:`mapped_tensor` builds on; usable on backends without torch tensors.
    Same parameters and errors.
    """
    return _create("mapped_memory", rows, row_bytes, group, kind, location, granularity,
                   backend, device, timeout, tag, None, None)


def _create(what: str, rows, row_bytes, group, kind, location, granularity, backend, device,
            timeout, tag, tensor_spec, failure) -> MappedMemory:
    """Check the arguments locally, agree on them with every rank (so a bad argument on
    one rank refuses on all at once instead of leaving the others waiting in the next
    collective), then build the memory."""
    be = None
    try:
        if failure is not None:
            raise failure
        for name, value in (("rows", rows), ("row_bytes", row_bytes),
                            ("granularity", granularity)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise VMMError(f"{what}: {name} must be a positive int, got {value!r}")
        byte_count(f"{what}: rows * row_bytes", rows * row_bytes, error=VMMError,
                   remedy="ask for fewer rows")
        if kind not in KINDS:
            raise VMMError(f"{what}: kind must be one of {KINDS}, got {kind!r}")
        if location not in LOCATIONS:
            raise VMMError(f"{what}: location must be one of {LOCATIONS}, got {location!r}")
        if tag is not None and (kind != "distributed" or location != "device"):
            raise VMMError(f"{what}: tag= puts a rank's own device memory to sleep, which "
                           f"only kind='distributed', location='device' has (mapped parts "
                           f"are shared by every rank); leave tag=None")
        if tag is not None and (not isinstance(tag, str) or not tag):
            raise VMMError(f"{what}: tag must be a non-empty string, got {tag!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 < timeout < math.inf:  # nan and inf bound no wait (sockets refuse them)
            raise VMMError(f"{what}: timeout must be a positive number of seconds, got "
                           f"{timeout!r}")
        be = _resolve_backend(backend)
        if device is None:
            from ..memory.tagged import current_device

            device = current_device(be)
        elif not isinstance(device, int) or isinstance(device, bool) or device < 0:
            raise VMMError(f"{what}: device must be an int >= 0 or None, got {device!r}")
    except Exception as exc:
        failure = exc
    try:
        group_ = Group(group, be, device if be is not None else None)
    except DistributedError:
        if failure is not None:
            raise failure from None  # no group to agree with: the local error is the one
        raise
    # rank 0's random id names the memory in every later call on it (random, not a
    # counter: ranks may create other tensors over other groups in between)
    args = {"spec": (rows, row_bytes, kind, location, granularity), "tensor": tensor_spec,
            "backend": None if be is None else be.name, "tag": tag,
            "id": secrets.randbits(48) or 1}
    infos = group_.agree(f"{what}: checking the arguments", args, failure)
    _check_same_args(what, infos)
    assert be is not None and device is not None  # no rank failed
    spec = (rows, row_bytes, kind, location, granularity)
    local = _Local(be, device)
    try:
        if kind == "distributed":
            memory = _map_distributed(group_, local, spec, tag)
        elif location == "device":
            memory = _map_device(group_, local, spec, timeout)
        else:
            memory = _map_host(group_, local, spec, timeout)
    except BaseException:
        local.release()
        raise
    memory._call_id = infos[0]["id"]
    return memory


def _check_same_args(what: str, infos: list[dict]) -> None:
    """Refuse, identically on every rank, ranks that were given different arguments."""
    for key, label in (("tensor", "shapes or dtypes"), ("backend", "backends"),
                       ("spec", "arguments (rows, row bytes, kind, location, granularity)"),
                       ("tag", "tags")):
        seen = [info[key] for info in infos]
        if any(v != seen[0] for v in seen):
            listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
            raise DistributedError(f"{what}: the ranks called it with different {label} "
                                   f"({listed}); nothing was allocated. Pass the same "
                                   f"arguments on every rank")


def _tagged():
    from ..memory import tagged

    return tagged


def _resolve_backend(backend) -> Backend:
    import vmm_core

    if isinstance(backend, Backend):
        return backend
    return vmm_core.get_backend(backend)


# ------------------------------------------------------------------ setup steps
def _introduce(group: Group, local: _Local, spec: tuple):
    """Step 1: every rank says who and where it is and what it can do.

    Opens this rank's mailbox when descriptors will travel (host location, or device
    handles that are file descriptors)."""
    be, dev = local.backend, local.device
    mailbox, failure, info = None, None, {}
    try:
        caps = be.capabilities(dev)
        info = {"node": _node_identity(), "backend": be.name, "device": dev, "spec": spec,
                "granularity": caps.granularity, "sharing": caps.shareable_handles,
                "peer_access": caps.peer_access,
                "mixed_handle_reservations": caps.mixed_handle_reservations}
        on_device = spec[3] == "device"
        if not on_device:  # what the node can hold: every rank decides alike from it
            info["host_room"] = host_room()
        if on_device and caps.shareable_handles == "integer":
            info["process_id"] = be.process_id(dev)
        if not on_device or caps.shareable_handles == "fd":
            mailbox = FdMailbox()
            info["mailbox"] = (mailbox.address, mailbox.secret)
    except Exception as exc:
        failure = exc
    try:
        infos = group.agree("mapped memory: introducing the ranks", info, failure)
        _check_consistent(infos)
    except BaseException:
        if mailbox is not None:
            mailbox.close()
        raise
    return infos, mailbox


def _check_consistent(infos: list[dict]) -> None:
    """Refuse, identically on every rank, groups that cannot share memory."""
    names = {info["backend"] for info in infos}
    if len(names) > 1:
        raise DistributedError(f"the ranks use different backends: "
                               f"{[info['backend'] for info in infos]}")
    specs = [info["spec"] for info in infos]
    if len(set(specs)) > 1:
        raise DistributedError(
            "the ranks called it with different arguments (rows, row bytes, kind, "
            "location, granularity): " + "; ".join(f"rank {r}: {s}" for r, s in
                                                   enumerate(specs)))
    _check_same_node(infos)


def _map_device(group: Group, local: _Local, spec: tuple, timeout: float) -> MappedMemory:
    rows, row_bytes, kind, location, granularity = spec
    be, dev, me = local.backend, local.device, group.rank
    infos, mailbox = _introduce(group, local, spec)
    try:
        if kind == "continuous" and group.size > 1 and \
                not all(info["mixed_handle_reservations"] for info in infos):
            # decided from the agreed capabilities, so every rank refuses alike, and a
            # rank whose capabilities() failed has already told every other rank why
            raise DistributedError(
                f"backend {be.name!r} cannot map other ranks' memory beside its own in one "
                f"reserved range (capability mixed_handle_reservations is False), so "
                f"kind='continuous' cannot be built on it: use kind='chunked' (one tensor "
                f"per rank's part, .chunks) or location='host'")
        sharing = infos[0]["sharing"]
        uses_fds = sharing == "fd"
        if sharing is None:
            be.require_sharing(dev, "mapped memory on the device")
        devices = sorted({info["device"] for info in infos})
        if len(devices) > 1 and not infos[0]["peer_access"]:
            raise DistributedError(
                f"backend {be.name!r} cannot map memory of another device "
                f"(capability peer_access is False) and the ranks use devices {devices}: "
                f"run the ranks on one device, or use location='host'")
        align = math.lcm(*(info["granularity"] for info in infos))
        part = partition_rows(rows, row_bytes, group.size, granularity, align)
        phys = {r: _round_up(part.part_bytes(r), align) for r in part.owners}

        # step 2: create and export this rank's part
        shareable: int | None = None
        failure = None
        try:
            if me in phys:
                handle = be.create_shareable_handle(dev, phys[me])
                local.handles.append(handle)
                importers = [info.get("process_id") for r, info in enumerate(infos)
                             if r != me]
                shareable = be.export_handle(dev, handle, importers)
                if uses_fds:
                    local.fds.append(shareable)
        except Exception as exc:
            failure = exc
        values = group.agree("mapped memory: creating each rank's part",
                             None if uses_fds else shareable, failure)

        # step 3: file descriptors go straight from each owner to every other rank
        if uses_fds:
            received, failure = {}, None
            try:
                if me in phys:
                    assert shareable is not None  # exported in step 2
                    for r, info in enumerate(infos):
                        if r != me:
                            address, secret = info["mailbox"]
                            send_fds(address, secret, me, [shareable], timeout)
                    local.close_fd(shareable)
                received = mailbox.receive({r: 1 for r in phys if r != me}, timeout)
                for fds in received.values():
                    local.fds.extend(fds)
            except Exception as exc:
                failure = exc
            group.agree("mapped memory: passing file descriptors", None, failure)
            values = [received[r][0] if r in received else None for r in range(group.size)]
    finally:
        if mailbox is not None:
            mailbox.close()

    # step 4: import the other parts and map every part
    bases, base, failure = {}, None, None
    try:
        handles = {}
        for r in part.owners:
            if r == me:
                handles[r] = local.handles[0]
                continue
            handles[r] = be.import_handle(dev, values[r], phys[r])
            local.handles.append(handles[r])
            if uses_fds:
                local.close_fd(values[r])
        if kind == "continuous":
            span = _round_up(part.slot_bytes * (part.owners[-1] + 1), align)
            base = be.reserve(dev, span, align)
            local.ranges.append((base, span))
            for r in part.owners:
                bases[r] = base + r * part.slot_bytes
        else:
            for r in part.owners:
                bases[r] = be.reserve(dev, phys[r], align)
                local.ranges.append((bases[r], phys[r]))
        for r in part.owners:
            _map_part(local, bases[r], phys[r], handles[r], own=(r == me))
    except Exception as exc:
        failure = exc
    group.agree("mapped memory: mapping every part", None, failure)
    return MappedMemory(group, local, part, kind, location, bases, base)


def _map_part(local: _Local, address: int, size: int, handle, own: bool) -> None:
    be, dev = local.backend, local.device
    be.map(dev, address, size, handle, 0)
    local.maps.append((address, size))
    if not own:
        be.set_access_for(dev, address, size, [dev])  # memory of another device/process
    elif be.capabilities(dev).needs_set_access:
        be.set_access(dev, address, size)


def _map_host(group: Group, local: _Local, spec: tuple, timeout: float) -> MappedMemory:
    rows, row_bytes, kind, location, granularity = spec
    be, dev, me = local.backend, local.device, group.rank
    infos, mailbox = _introduce(group, local, spec)
    root = 0
    part = partition_rows(rows, row_bytes, group.size, granularity, 1)
    size = _round_up(part.nbytes, mmap.PAGESIZE)
    try:
        # posix_fallocate below takes every page at once: one larger than the machine
        # took every free page, and the OOM killer then ended the ranks
        _refuse_host_overflow([size], [info["host_room"] for info in infos])
        failure = None
        try:
            if me == root:
                fd = os.memfd_create("vmm_core-mapped", os.MFD_CLOEXEC)
                local.fds.append(fd)
                try:
                    os.posix_fallocate(fd, 0, size)  # fail now, not with SIGBUS on first touch
                except OSError as exc:
                    raise OutOfMemoryError(f"shared host memory of {size} bytes could not "
                                           f"be allocated ({exc}); ask for less") from exc
        except Exception as exc:
            failure = exc
        group.agree("mapped memory: creating the host allocation", None, failure)
        failure = None
        try:
            if me == root:
                for r, info in enumerate(infos):
                    if r != root:
                        address, secret = info["mailbox"]
                        send_fds(address, secret, me, [local.fds[0]], timeout)
            else:
                local.fds.extend(mailbox.receive({root: 1}, timeout)[root])
        except Exception as exc:
            failure = exc
        group.agree("mapped memory: passing the host allocation", None, failure)
    finally:
        mailbox.close()

    failure, device_base = None, None
    try:
        fd = local.fds[0]
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        local.host_maps.append(mm)
        local.close_fd(fd)
        host_base = _address_of(mm)
        device_base = be.host_register(dev, host_base, size)
        local.registered.append(host_base)
    except Exception as exc:
        failure = exc
    group.agree("mapped memory: mapping the host allocation", None, failure)
    bases = {r: device_base + part.row_range(r)[0] * row_bytes for r in part.owners}
    base = device_base if kind == "continuous" else None
    return MappedMemory(group, local, part, kind, location, bases, base)


def _map_distributed(group: Group, local: _Local, spec: tuple, tag) -> MappedMemory:
    """Each rank allocates its own part only; nothing is exchanged but the granularity
    (the same :func:`partition_rows` rule as the mapped kinds, so a row has the same
    owner whatever the kind) and the outcome."""
    from ..memory.allocator import SharedVMMAllocator

    rows, row_bytes, kind, location, granularity = spec
    be, dev, me = local.backend, local.device, group.rank
    failure, grain = None, 1
    try:
        if location == "device":
            grain = be.capabilities(dev).granularity
    except Exception as exc:
        failure = exc
    node = (_node_identity(), host_room() if location == "host" else None)
    infos = group.agree("distributed tensor: introducing the ranks", (grain, node), failure)
    grains = [grain for grain, _ in infos]
    part = partition_rows(rows, row_bytes, group.size, granularity, math.lcm(*grains))
    if location == "host":  # the parts of the ranks on one node share its memory
        nodes: dict = {}
        for r, (_, (identity, room)) in enumerate(infos):
            sizes, rooms = nodes.setdefault((identity["host"], identity["boot"]), ([], []))
            sizes.append(_round_up(part.part_bytes(r), mmap.PAGESIZE))
            rooms.append(room)
        for sizes, rooms in nodes.values():
            _refuse_host_overflow(sizes, rooms)
    bases, failure = {}, None
    try:
        size = part.part_bytes(me)
        if location == "device" and (size or tag is not None):
            # a rank that owns no rows still holds an (empty) allocator under the tag, so
            # vmm_core.sleep(tag, group=...) finds the tag on every rank
            alloc = SharedVMMAllocator(be, dev, reserve_bytes=_round_up(max(size, 1),
                                                                        grains[me]), tag=tag)
            local.allocators.append(alloc)
            if size:
                bases[me] = alloc.allocate(size)
            if tag is not None:
                _tagged().register(tag, alloc)
        elif size:
            mm = mmap.mmap(-1, _round_up(size, mmap.PAGESIZE))
            local.host_maps.append(mm)
            host_base = _address_of(mm)
            bases[me] = be.host_register(dev, host_base, len(mm))
            local.registered.append(host_base)
    except Exception as exc:
        failure = exc
    group.agree("distributed tensor: allocating each rank's part", None, failure)
    return MappedMemory(group, local, part, kind, location, bases, None)


def _refuse_host_overflow(sizes: list[int], rooms: list) -> None:
    """Raise OutOfMemoryError, the same on every rank, if host allocations of ``sizes``
    on one node exceed the room its ranks reported (:func:`host_room`, None where the
    kernel does not say): decided from agreed values, so every rank refuses alike and
    the group stays in step."""
    known = [room for room in rooms if room is not None]
    if not known:
        return
    room, available, margin = min(known)
    if sum(sizes) > room:
        raise OutOfMemoryError(host_refusal(
            "mapped memory with location='host'", sum(sizes), room, available, margin,
            "ask for fewer rows, or use kind='distributed' over more nodes"))


def _address_of(mm: mmap.mmap) -> int:
    """The address of an mmap, without keeping a buffer export that blocks its close()."""
    import ctypes

    probe = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(probe)
    del probe
    return address
