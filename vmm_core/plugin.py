"""What a backend author uses: the hook markers, the declarations a backend makes, and
the entry-point group it is registered under.

A vendor backend is one object whose methods carry :data:`hookimpl` and the hook names of
:mod:`vmm_core.hookspecs` (:data:`REQUIRED_HOOKS` at least), declares what its primitives
can do with :class:`BackendCapabilities`, answers detection with a :class:`Probe`, and is
registered in its distribution under :data:`ENTRY_POINT_GROUP`.  Core reaches it only
through :class:`Backend`.  :mod:`vmm_core.testing` runs the contract suite on it.
"""

from __future__ import annotations

from .backend import Backend
from .capabilities import BackendCapabilities, Probe
from .hookspecs import REQUIRED_HOOKS, hookimpl, hookspec
from .registry import ENTRY_POINT_GROUP

__all__ = ["Backend", "BackendCapabilities", "Probe", "hookimpl", "hookspec", "REQUIRED_HOOKS",
           "ENTRY_POINT_GROUP"]
