"""One exception hierarchy for every backend.

Every backend raises these (and only these) so that callers can write one ``except``
clause per failure kind, whatever the vendor.  Each message names the call that failed
and says what to do about it.
"""

from __future__ import annotations

__all__ = [
    "VMMError",
    "BackendError",
    "BackendNotFoundError",
    "AmbiguousBackendError",
    "BackendUnavailableError",
    "AllocationError",
    "OutOfMemoryError",
    "ReservationExceededError",
    "MappingError",
    "CaptureError",
    "CaptureEscapeError",
    "SleepStateError",
    "DistributedError",
    "CallMismatchError",
    "MissingExtraError",
    "VMMPluginWarning",
    "VMMFallbackWarning",
]


class VMMError(RuntimeError):
    """Base class of every error vmm_core raises."""


class BackendError(VMMError):
    """A backend primitive failed; the message names the backend and the call."""


class BackendNotFoundError(BackendError, LookupError):
    """No backend of that name is registered (misspelled, or its package is not installed)."""


class AmbiguousBackendError(BackendError):
    """Several accelerator backends are usable and none is preferred."""


class BackendUnavailableError(BackendError):
    """The backend is registered but cannot run on this machine (library or device missing)."""


class AllocationError(VMMError):
    """An allocation request could not be satisfied."""


class OutOfMemoryError(AllocationError, MemoryError):
    """The device (or host) has no physical memory left for the request."""


class ReservationExceededError(AllocationError):
    """The bump pointer would run past the reserved virtual range."""


class MappingError(VMMError):
    """Reserving, mapping, unmapping or releasing failed or was called with bad arguments."""


class CaptureError(VMMError):
    """Graph capture or replay was refused or failed."""


class CaptureEscapeError(CaptureError):
    """Memory allocated during a capture outlived it; later graphs would alias it."""


class SleepStateError(VMMError):
    """An operation needs memory that is asleep (or awake) and it is not."""


class MissingExtraError(VMMError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


# -------------------------------------------------------------------------
# Memory shared between processes (vmm_core.distributed)
# -------------------------------------------------------------------------


class DistributedError(VMMError):
    """A step shared by the ranks of a process group failed or was refused on some rank
    (ranks on different hosts, a rank that died or raised, arguments that differ between
    ranks); the message names the ranks and what to do."""


class CallMismatchError(DistributedError):
    """The ranks of a group made different collective vmm_core calls, or the same call
    on different objects (a gather on one rank, a group sleep or a close on another):
    every rank raises it at once, nothing was exchanged, and the group is still usable."""


class VMMPluginWarning(UserWarning):
    """A third-party backend plugin could not be loaded and was skipped."""


class VMMFallbackWarning(UserWarning):
    """A requested strategy is not possible here and a weaker one is used instead."""



def outside_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller of this function
    point at the first frame outside vmm_core (and outside ``contextlib``, whose
    ``__exit__`` sits between a ``with`` line and a generator context manager).

    A fixed stacklevel points into vmm_core's own files whenever a warning's path is
    reached through a layer above it (the torch_memory_saver API over ``region()``)."""
    import contextlib
    import os
    import sys
    import types

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    helper = os.path.abspath(contextlib.__file__)
    frame: types.FrameType | None = sys._getframe(1)  # the function that warns
    level = 1
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(package) and name != helper:
            return level
        frame, level = frame.f_back, level + 1
    return 1
