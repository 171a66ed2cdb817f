"""How a sleep copies offloaded tags to the host and back, and the settings a user tunes.

The public face of :mod:`vmm_core.memory.offload`, whose package docstring describes the
strategies (``staged``, ``direct``, ``pinned``) and the kept pinned copies.  Only what an
engine or an RL loop calls lives here: the configuration, the per-tag keep policy, the
copies made ahead of the first sleep (at model load), the staging ring's warm-up and
size, the host room an offload may still take before it is refused (:func:`host_room`),
and the record of each copy (:class:`Transfer`, on each allocator's
``last_transfer``).  The pipeline that moves the bytes stays inside the memory layer, so
it can change without breaking a caller.
"""

from __future__ import annotations

from .memory.host_memory import host_room
from .memory.offload import (
    STRATEGIES,
    OffloadConfig,
    Transfer,
    choose_strategy,
    config,
    configure,
    configured,
    deferred_pinning,
    keeps_host_buffers,
    prepare,
    prepare_staging,
    prepared_bytes,
    release_prepared,
    release_staging,
    set_keep_host_buffers,
    staging_bytes,
    wait_for_pinning,
    wait_for_prepared,
)

__all__ = ["STRATEGIES", "OffloadConfig", "Transfer", "choose_strategy", "config",
           "configure", "configured", "deferred_pinning", "host_room", "keeps_host_buffers",
           "prepare", "prepare_staging", "prepared_bytes", "release_prepared",
           "release_staging", "set_keep_host_buffers", "staging_bytes", "wait_for_pinning",
           "wait_for_prepared"]
