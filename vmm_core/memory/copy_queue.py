"""The copy-queue role: ordered host<->device copies that core can wait for.

A backend returns one from its optional ``vmm_copy_queue`` hook.  Offload uses it to
keep a copy engine busy while host threads move the bytes of earlier chunks
(:mod:`vmm_core.memory.offload`); the synchronous copy hooks cannot overlap anything.
"""

from __future__ import annotations

import abc

__all__ = ["CopyQueue"]


class CopyQueue(abc.ABC):
    """Copies queued in order on one device (a CUDA stream), and markers to wait on.

    Host memory given to a queued copy must stay valid and untouched until a marker
    recorded after that copy has been waited on; it comes from the backend's
    ``vmm_host_buffer(pinned=True)`` when the backend has one, which is what lets the
    copy run without the calling thread.  One thread at a time uses a queue.
    """

    @abc.abstractmethod
    def to_host(self, address: int, host_address: int, size: int) -> None:
        """Queue a copy of ``size`` bytes from device ``address`` to ``host_address``."""

    @abc.abstractmethod
    def from_host(self, host_address: int, address: int, size: int) -> None:
        """Queue a copy of ``size`` bytes from ``host_address`` to device ``address``."""

    @abc.abstractmethod
    def record(self):
        """An opaque marker covering every copy queued so far."""

    @abc.abstractmethod
    def wait(self, marker) -> None:
        """Block until the copies before ``marker`` finished; raise if one failed.

        Must not hold the GIL while blocked (host threads copy meanwhile).  Each marker
        is waited on at most once; markers never waited on are retired by
        :meth:`synchronize`.
        """

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for every queued copy and retire every marker; raise if one failed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for queued copies (ignoring their errors) and free the queue.  Idempotent."""
