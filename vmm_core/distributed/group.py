"""The few collective steps vmm_core needs from the caller's ``torch.distributed`` group.

Only one collective is used: an all-gather of pickled objects, done with two tensor
``all_gather`` calls on the device the group's backend runs on (the CPU for gloo, our
device for NCCL), so it works with both and needs no numpy.

Each step is an *agreement*: every rank contributes its outcome (a value, or the error
it hit), and every rank then sees the same list, so all ranks take the same decision and
raise the same message.  A rank that died makes the collective itself fail (gloo: the
peer's connection closes; otherwise the group's timeout, set by the caller in
``init_process_group(timeout=...)``); that surfaces as :class:`DistributedError`.
Under NCCL a collective only times out in NCCL's watchdog thread, which by default
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) tears the waiting processes down instead of
raising; with ``TORCH_NCCL_BLOCKING_WAIT=1`` the wait raises, and that becomes the
:class:`DistributedError`.  Failures that a rank *survives* never depend on this: every
rank takes every step, and the failure travels as data.

Every vmm_core operation on a group starts with the same collective, the *call header*
(:meth:`Group.header`): one all-gather of three int64 per rank naming the call (a digest
of its name), the object it is about (a mapped tensor's id, 0 for none) and the length of
what follows.  Whatever two ranks call, their first collectives therefore pair up, every
rank compares the rows, and ranks in different calls (a gather against a group sleep, a
close or a new mapped tensor; closes of two different tensors) all raise the same
CallMismatchError at once, with the group still usable, instead of waiting the group's
timeout in mismatched collectives.  For an agreement the header replaces the all-gather
of the payload's length, so it costs nothing; a distributed gather or scatter pays one
small all-gather for it.
"""

from __future__ import annotations

import hashlib
import pickle

from .. import registry
from ..errors import CallMismatchError, DistributedError

__all__ = ["Group", "RankFailure", "forget_frames"]


def _digest(call: str) -> int:
    """A call's name as an int64 every process computes alike (``hash()`` is salted)."""
    return int.from_bytes(hashlib.blake2b(call.encode(), digest_size=7).digest(), "little")


def forget_frames(exc: BaseException | None) -> None:
    """Drop the tracebacks of ``exc`` and of every exception chained to it.

    A step keeps its local failure in a variable until every rank has agreed (``failure
    = exc``); the failure's traceback holds that very frame, and the frame holds the
    group: a reference cycle that keeps the process group alive past
    ``destroy_process_group``, and a rank can then abort at exit, inside gloo.
    Once a failure is shared its message is all that is needed: the error every rank
    raises names it."""
    pending, seen = [exc], set()
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        exc.__traceback__ = None
        pending += [exc.__cause__, exc.__context__]


class RankFailure:
    """What a rank reports instead of a value when its local part of a step failed.

    Only the type's name and the message travel, and stay: the exception's frames are
    let go (:func:`forget_frames`)."""

    def __init__(self, exc: BaseException) -> None:
        self.type_name = type(exc).__name__
        self.message = str(exc)
        forget_frames(exc)

    def __repr__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name


class Group:
    """One process group seen by vmm_core: rank, size, agreements."""

    def __init__(self, group=None, backend=None, device: int | None = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "torch.distributed is not initialized: call "
                "torch.distributed.init_process_group(...) on every rank first (torchrun "
                "sets the environment it needs)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise DistributedError("this process is not a member of the given group")
        self._backend = backend
        self._device = device

    def _tensor_device(self):
        """Where the group's collectives take tensors: the CPU if its backend runs there
        (gloo), else a device of the framework (NCCL): our device when it is one the
        framework has, otherwise the current one, as torch's object collectives do.

        Never the error of a bad ``device`` argument: NCCL collectives are only waited
        for by the ranks that enter them, so a rank that raised here would leave the
        others waiting until the group's timeout (and NCCL's watchdog then tears them
        down) instead of joining the agreement that reports its bad argument."""
        import torch

        name = str(self._dist.get_backend(self.group)).lower()
        runs_on = self._dist.Backend.backend_capability.get(name, ["cpu"])
        if "cpu" in runs_on:
            return torch.device("cpu")
        if self._backend is None:  # not tied to a backend: the detected one, current device
            from ..memory.tagged import current_device

            self._backend = registry.resolve(None)
            self._device = current_device(self._backend)
        ops = self._backend.graph_ops(0)  # the device type (as memory.tagged.current_device)
        if ops is None or ops.device_type not in runs_on:
            raise DistributedError(
                f"the group's backend {name!r} runs on {runs_on}, but vmm_core's device is "
                f"{'the host' if ops is None else ops.device_type}: use a group whose "
                f"backend runs on that device (or gloo)")
        module = getattr(torch, ops.device_type, None)  # torch.cuda, torch.npu, torch.mlu
        index = self._device
        if module is not None and (isinstance(index, bool) or not isinstance(index, int) or
                                   not 0 <= index < module.device_count()):
            index = module.current_device()
        return torch.device(ops.device_type, index)

    def header(self, call: str, about: int = 0, length: int = 0) -> list:
        """The first collective of every vmm_core operation on the group: every rank's
        row ``[length, call, about]`` in rank order, once every rank is known to be in
        the same ``call`` about the same object (``about``: an id the ranks agreed on, 0
        for none).  ``length``: what the caller sends next (an agreement's payload).

        The row has the same size whatever the call, so the first collectives of any
        two calls pair up: ranks in different calls all raise the same
        CallMismatchError, and the group stays in step."""
        row = [length, _digest(call), about]
        table = self._collective(call, lambda device: self._all_gather_rows(row, device))
        if all(r[1:3] == table[0][1:3] for r in table):
            return table
        # every rank took this header, so all are in step: one more exchange names the
        # calls, and every rank raises the same message
        names = self._collective(call, lambda device: self._all_gather_bytes(
            pickle.dumps((call, about)), device))
        listed = "; ".join(f"rank {r}: '{c}'" + (f" of object #{a:x}" if a else "")
                           for r, (c, a) in enumerate(map(pickle.loads, names)))
        raise CallMismatchError(
            f"the ranks did not make the same call ({listed}); nothing was exchanged, and "
            f"the group is still usable. Every rank must make the same collective vmm_core "
            f"calls (mapped_tensor, close, gather/scatter of a distributed tensor, "
            f"sleep/wake_up with group=) on the same objects, in the same order")

    def gather(self, obj, step: str, about: int = 0) -> list:
        """Every rank's ``obj`` (anything picklable), in rank order.

        Like ``all_gather_object``, but built on tensor ``all_gather`` directly, so it
        needs no numpy and takes its tensors on the device the group's backend uses.
        Starts with the call header (``step``, ``about``): ranks in different steps raise
        the same error instead of exchanging each other's data."""
        data = pickle.dumps(obj)
        lengths = [row[0] for row in self.header(step, about, len(data))]
        shared = self._collective(step, lambda device: self._all_gather_bytes(
            data, device, lengths))
        return [pickle.loads(b) for b in shared]

    def _collective(self, step: str, fn):
        """``fn(device)``; a failed collective (a rank died or left) is DistributedError."""
        try:
            return fn(self._tensor_device())
        except DistributedError:  # the device of a group that cannot take ours
            raise
        except Exception as exc:
            raise DistributedError(
                f"rank {self.rank}: the process group failed during '{step}' "
                f"({type(exc).__name__}: {exc}). Another rank probably died or left the "
                f"collective; see its output") from exc

    def _all_gather_rows(self, row: list, device) -> list:
        import torch

        mine = torch.tensor(row, dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        self._dist.all_gather(rows, mine, group=self.group)
        return [r.tolist() for r in rows]

    def _all_gather_bytes(self, data: bytes, device, lengths=None) -> list:
        """Every rank's ``data``; ``lengths`` (every rank's, when the header brought them)
        saves the all-gather of the sizes."""
        import ctypes

        import torch

        if lengths is None:
            lengths = [r[0] for r in self._all_gather_rows([len(data)], device)]
        buf = torch.zeros(max(lengths), dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        buf = buf.to(device)
        outs = [torch.empty_like(buf) for _ in range(self.size)]
        self._dist.all_gather(outs, buf, group=self.group)
        host = [o.cpu() for o in outs]
        return [ctypes.string_at(h.data_ptr(), n) for h, n in zip(host, lengths)]

    def agree(self, step: str, value=None, failure: BaseException | None = None,
              about: int = 0) -> list:
        """Share ``value`` (or the failure) and raise on every rank if any rank failed.

        The raised :class:`DistributedError` has the same message on every rank.  The
        failure's frames are let go (:class:`RankFailure`): the caller may keep it in a
        local without holding the group in a reference cycle.
        """
        outcomes = self.gather(RankFailure(failure) if failure is not None else value, step,
                               about)
        failed = {r: o for r, o in enumerate(outcomes) if isinstance(o, RankFailure)}
        if failed:
            detail = "; ".join(f"rank {r}: {o!r}" for r, o in failed.items())
            raise DistributedError(f"{step} failed on rank(s) {sorted(failed)} of "
                                   f"{self.size}: {detail}")
        return outcomes
