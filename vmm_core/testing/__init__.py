"""Test support shipped with vmm_core so vendors can check their own backends.

Usage in a third-party backend's test suite (``conftest.py``)::

    import pytest, vmm_core
    from vmm_core.testing.contract import *  # noqa: the contract tests

    @pytest.fixture
    def vmm_backend():
        return vmm_core.get_backend("myvendor")
"""

from .tools import FaultInjector, HookCounter, read_bytes, write_bytes

__all__ = ["FaultInjector", "HookCounter", "read_bytes", "write_bytes"]
