"""Offload: copy an allocator's physical memory to the host and back, at copy bandwidth.

The allocator decides *what* to copy (the handles of its current space, in order);
this package decides *how*, in one place (:func:`choose_strategy`):

``staged`` (default where the backend declares ``async_copies``)
    Pinning fresh host memory at every sleep runs at a few GiB/s, against ~50 GiB/s for
    the copy itself, and keeping pinned buffers holds host memory while awake.  So the
    device streams fixed-size chunks through a small ring of pinned staging slots,
    allocated once per process and device and shared by every tag and sleep, on the
    backend's copy queue (a CUDA stream), while a pool of host threads moves each
    finished chunk into pageable memory from ``mmap`` (huge-page advised, faulted in
    by the copying threads in parallel).  Wake runs the pipeline backwards.  The only
    host memory held while awake is then the ring, unless host copies are kept (the
    default, below).
``direct``
    The synchronous copy hooks straight into pageable memory, chunk by chunk (backends
    without a copy queue; the host backend, where staging is one memcpy too many).
``pinned``
    One backend pinned buffer per handle, allocated at each sleep unless kept: the path
    of backends that have pinned buffers but no copy queue.

Repeated sleeps (an RL loop sleeps the engine every step): by default wake keeps the
host copy of every tag (:func:`keeps_host_buffers`), and the copy is registered with the
backend once, in the background after the sleep that made it (``vmm_host_register``:
cudaHostRegister on CUDA).  Every later round copies straight between the device and
that pinned copy on the copy queue, at full copy bandwidth, without the ring or the
host threads.  Host memory held while awake is then the offloaded bytes (plus the ring,
and copies ``prepare(nbytes)`` made that no tag took, or that a smaller tag took whole);
``wake_up(keep_host_buffers=False)`` gives it back, and :func:`set_keep_host_buffers` or
``configure(keep_host_buffers=False)`` make later wakes do so.  :func:`prepare` makes
the pinned copies ahead of time (at model load), so that even the first sleep copies
straight.

:func:`configure` switches strategy and sizes (the benchmark measures each); every
failure leaves the caller's bytes where they were and every staging slot quiet.

The modules, each importing only those before it: ``settings`` (the configuration, the
per-tag policy, the choice of strategy), ``staging`` (the staging ring and copy threads
every copy shares), ``pinning`` (registering kept copies in the background),
``prepared`` (copies made ahead of the sleep that fills them), ``pipeline`` (the copies
themselves: save, restore).  Every name below is theirs, re-exported here.
"""

from .pinning import deferred_pinning, wait_for_pinning
from .pipeline import Transfer, restore, save
from .prepared import (
    PendingCopy,
    prepare,
    prepare_later,
    prepared_bytes,
    prepared_copy,
    release_prepared,
    wait_for_prepared,
)
from .settings import (
    STRATEGIES,
    OffloadConfig,
    choose_strategy,
    config,
    configure,
    configured,
    keeps_host_buffers,
    set_keep_host_buffers,
)
from .staging import prepare_staging, release, release_staging, staging_bytes

__all__ = ["OffloadConfig", "Transfer", "config", "configure", "configured",
           "choose_strategy", "prepare", "prepare_staging", "save", "restore", "release",
           "staging_bytes", "prepared_bytes", "release_prepared", "release_staging",
           "set_keep_host_buffers", "keeps_host_buffers", "wait_for_pinning",
           "deferred_pinning", "prepare_later", "PendingCopy", "wait_for_prepared",
           "STRATEGIES", "prepared_copy"]
