"""A group's communicators: set up before the first sleep, and (opt-in) asleep with it.

Set up ahead of time.  ``torch.distributed`` creates a group's device communicator at the
group's first collective, and for a group used by nothing before vmm_core that first
collective is the agreement of the first ``vmm_core.sleep(group=...)``: the
communicator's setup (connections between the ranks, its buffers) would land inside the
first sleep, on the slowest rank's time.  :func:`prepare_group` runs, once, the same
collectives a group sleep runs, at a moment of the caller's choosing (model load), so
that no sleep sets anything up.  (``init_process_group(device_id=...)`` makes torch set
up the default group's communicator at once, too.)

Asleep with the group.  A communicator holds device memory of its own (its channels'
buffers, about 1 GiB a rank seen at four ranks); torch >= 2.12 lets a process group's
backend give it back (``suspend()``) and take it again (``resume()``) where the library
under it can (NCCL >= 2.29.7; ``memory_stats()`` raises where it cannot).  With
``communicators=True`` (or a list of groups) a group sleep does that once every tag is
asleep on every rank, and the next group wake resumes them before anything else.  While
they are suspended the groups cannot run collectives: nothing may use them, vmm_core's
own calls included, until that wake.  Suspending and resuming are collective inside the
library (every member calls), so every member of every listed group must be in the
group sleep, and the wake must be made over the same group.
"""

from __future__ import annotations

import threading
import time

from ..errors import DistributedError, VMMError
from .group import Group

__all__ = ["prepare_group", "check_suspendable", "suspend", "resume_all", "suspended"]

_lock = threading.Lock()
#: (process group, torch device, its backend object) suspended by a group sleep, in order
_suspended: list[tuple] = []


def prepare_group(group=None) -> float:
    """Collective: set up ``group``'s communicator now, outside any sleep; returns the
    seconds it took.

    Runs the collectives a group sleep's agreement runs (an all-gather of the call
    header and one of the payload, on the device the group's backend uses), so the
    communicator, its streams and its buffers exist before the first
    ``vmm_core.sleep(group=...)``.  Every rank calls it, once per group, after
    ``init_process_group`` (or ``new_group``) and before the first group sleep; calling
    it again costs one small agreement."""
    g = Group(group)
    t0 = time.perf_counter()
    g.gather(None, "vmm_core.distributed.prepare_group")
    return time.perf_counter() - t0


def _process_groups(g: Group, which) -> list:
    """The process groups ``communicators=`` names: True is the group's own."""
    if which is True:
        return [g.group if g.group is not None else g._dist.group.WORLD]
    if isinstance(which, (list, tuple)) and which and all(
            isinstance(x, g._dist.ProcessGroup) for x in which):
        return list(which)
    raise VMMError(f"vmm_core.sleep: communicators must be False, True (the group's own "
                   f"communicator) or a list of torch.distributed process groups, got "
                   f"{which!r}")


def check_suspendable(g: Group, which) -> list[tuple]:
    """The (process group, device, backend) to suspend for ``communicators=which``, or
    VMMError saying why this rank cannot: torch without ``suspend()`` on its backends,
    or a backend whose library cannot release its memory (its ``memory_stats()``
    raises, as gloo's and a library too old do).  Asks nothing of the other ranks."""
    if which is False or which is None:
        return []
    groups = _process_groups(g, which)
    with _lock:
        if _suspended:
            raise VMMError("vmm_core.sleep: the communicators an earlier group sleep "
                           "suspended are still suspended; wake_up(group=...) first")
    device = g._tensor_device()
    out = []
    for pg in groups:
        name = str(g._dist.get_backend(pg))
        try:
            backend = pg._get_backend(device)  # torch has no public accessor for it
        except Exception as exc:
            raise VMMError(f"vmm_core.sleep: communicators=: the group has no backend for "
                           f"{device} ({type(exc).__name__}: {exc})") from None
        if not all(hasattr(backend, n) for n in ("suspend", "resume", "memory_stats")):
            import torch

            raise VMMError(f"vmm_core.sleep: communicators=: torch {torch.__version__} "
                           f"cannot release a communicator's memory (its process-group "
                           f"backends have no suspend(); torch 2.12 added it); leave "
                           f"communicators=False")
        try:
            backend.memory_stats()
        except Exception as exc:
            raise VMMError(f"vmm_core.sleep: communicators=: the group's {name!r} backend "
                           f"cannot release its communicator's memory ({exc}); leave "
                           f"communicators=False") from None
        out.append((pg, device, backend))
    return out


def suspend(chosen: list[tuple]) -> None:
    """Release the communicators' device memory (every rank calls, after the sleep)."""
    for pg, device, backend in chosen:
        try:
            backend.suspend()
        except Exception as exc:
            raise DistributedError(
                f"every rank's tags are asleep, but this rank could not suspend a "
                f"communicator ({type(exc).__name__}: {exc}); the ones before it are "
                f"suspended and the next wake_up(group=...) resumes them") from None
        with _lock:
            _suspended.append((pg, device, backend))


def suspended() -> int:
    """How many communicators a group sleep of this process left suspended."""
    with _lock:
        return len(_suspended)


def resume_all() -> None:
    """Bring back every communicator a group sleep suspended (every rank calls, first
    thing in the group wake: its agreement needs them)."""
    while True:
        with _lock:
            if not _suspended:
                return
            pg, device, backend = _suspended[0]
        try:
            backend.resume()
        except Exception as exc:
            raise DistributedError(
                f"could not resume a communicator that the group sleep suspended "
                f"({type(exc).__name__}: {exc}); nothing was woken") from None
        with _lock:
            _suspended.pop(0)
