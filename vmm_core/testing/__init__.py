"""Test support shipped with vmm_core so vendors can check their own backends.

:mod:`vmm_core.testing.imports` lists the imports of vmm_core a backend's source makes
beyond its contract (``vmm_core.plugin`` and ``vmm_core.errors``), as the built-in
backends are checked.

Run the contract suite from a test module of your backend's test suite
(``test_vmm_contract.py``): pytest collects tests only from ``test_*.py`` files, so the
star import goes there, never into ``conftest.py`` (which may hold the fixture)::

    import pytest

    import vmm_core
    from vmm_core.testing.contract import *  # noqa: F401,F403 (the contract tests)


    @pytest.fixture
    def vmm_backend():
        return vmm_core.get_backend("myvendor")
"""

from .tools import FaultInjector, HookCounter, read_bytes, write_bytes

__all__ = ["FaultInjector", "HookCounter", "read_bytes", "write_bytes"]
