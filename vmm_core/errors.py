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
