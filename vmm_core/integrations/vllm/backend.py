"""The ``vmm`` sleep-mode backend: :class:`~.allocator.VmmSleepMode` on vLLM's own base
class, registered in vLLM's ``SleepModeBackendFactory``.

The class is built on first use, since its base is vLLM's: the rest of the plugin
imports without vLLM (a benchmark drives :class:`~.allocator.VmmSleepMode` directly).
"""

from __future__ import annotations

import logging

from ...errors import VMMError
from .allocator import BACKEND_NAME, VmmSleepMode

__all__ = ["backend_class", "register_backend"]

logger = logging.getLogger("vmm_core")

#: where vLLM's factory finds the class (the package's module ``__getattr__`` builds it)
MODULE = "vmm_core.integrations.vllm"
CLASS_NAME = "VmmSleepModeBackend"

_backend_class = None


def backend_class():
    """``VmmSleepModeBackend``: vLLM's ``SleepModeBackend`` on vmm_core."""
    global _backend_class
    if _backend_class is None:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

        class VmmSleepModeBackend(VmmSleepMode, SleepModeBackend):
            """vLLM's ``SleepModeBackend`` on vmm_core (``--sleep-mode-backend vmm``)."""

            def __init__(self) -> None:
                SleepModeBackend.__init__(self)
                VmmSleepMode.__init__(self)

        VmmSleepModeBackend.__module__ = MODULE
        VmmSleepModeBackend.__qualname__ = CLASS_NAME
        _backend_class = VmmSleepModeBackend
    return _backend_class


def register_backend() -> bool:
    """Register ``vmm`` in vLLM's factory (a second call changes nothing).  False where
    this vLLM has no sleep-mode backends to register with: then no run can select one,
    and the plugin has nothing to do."""
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    except ImportError as exc:
        logger.warning("vmm_core's vLLM plugin: this vLLM has no pluggable sleep-mode "
                       "backends (%s); --sleep-mode-backend %s is not available",
                       exc, BACKEND_NAME)
        return False
    try:
        SleepModeBackendFactory.register_backend(BACKEND_NAME, MODULE, CLASS_NAME)
    except ValueError:
        registered = SleepModeBackendFactory.get_backend_class(BACKEND_NAME)
        if registered is not backend_class():
            raise VMMError(f"vLLM's sleep-mode backend {BACKEND_NAME!r} is registered by "
                           f"{registered.__module__}.{registered.__qualname__}, not vmm_core; "
                           f"uninstall one of them") from None
    return True
