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
import operator
import secrets

from .. import registry
from ..errors import DistributedError, VMMError
from ..memory.tag_state import check_tag
from ..sizes import byte_count
from .distributed_kind import map_distributed
from .group import Group
from .handle_exchange import map_device, map_host
from .mapped_memory import MappedMemory, ViewToken
from .partition import Partition, partition_rows
from .process_share import ProcessShare

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
        self._device = None

    def _view(self, address: int, nbytes: int):
        rows = nbytes // self.memory.partition.row_bytes
        raw = self.memory.backend.torch_tensor(self.memory.device, address, nbytes)
        # torch keeps a storage's Python object (and so this token) alive while any view
        # of it lives: the mapping cannot be freed under a tensor by the finalizer
        token = ViewToken(self.memory)
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
        """The torch device every view and every gather result lives on (asked of the
        backend once: every gather and scatter checks its arguments against it)."""
        if self._device is None:
            ops = self.memory.backend.graph_ops(self.memory.device)
            if ops is None:
                import torch

                self._device = torch.device("cpu")
            else:
                self._device = ops.torch_device
        return self._device

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
        be = registry.resolve(backend)
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
        if tag is not None:
            check_tag(tag, f"{what}: tag", VMMError)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 < timeout < math.inf:  # nan and inf bound no wait (sockets refuse them)
            raise VMMError(f"{what}: timeout must be a positive number of seconds, got "
                           f"{timeout!r}")
        be = registry.resolve(backend)
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
    local = ProcessShare(be, device)
    try:
        if kind == "distributed":
            memory = map_distributed(group_, local, spec, tag)
        elif location == "device":
            memory = map_device(group_, local, spec, timeout)
        else:
            memory = map_host(group_, local, spec, timeout)
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


