"""The vmm_api contract suite: every backend must pass it.

It needs one fixture, ``vmm_backend`` (a :class:`vmm_core.Backend`), and optionally
``vmm_device`` (default 0).  Device bytes are read and written only through the
backend's copy hooks, so the same tests run on host memory, an emulated driver or a GPU.
Import everything from this module into a test module (``test_*.py``: pytest collects
nothing from a ``conftest.py``) to run it; :mod:`vmm_core.testing` shows the file.

One module per concern, every test named ``test_contract_*``: :mod:`.primitives` (the
hooks one by one and the vocabulary they share), :mod:`.allocator` (SharedVMMAllocator
on the backend), :mod:`.sleep` (sleep, wake, offload), :mod:`.sharing` (handles across
processes, optional) and :mod:`.roles` (copy queue, allocator adapter, graph ops and
executables, each where the backend fills it).
"""

from __future__ import annotations

from . import allocator, primitives, roles, sharing, sleep
from .allocator import *  # noqa: F401,F403
from .fixtures import alloc, granularity, vmm_device
from .primitives import *  # noqa: F401,F403
from .roles import *  # noqa: F401,F403
from .sharing import *  # noqa: F401,F403
from .sleep import *  # noqa: F401,F403

__all__ = [*primitives.__all__, *allocator.__all__, *sleep.__all__, *sharing.__all__,
           *roles.__all__, "vmm_device", "granularity", "alloc"]
