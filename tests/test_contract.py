"""The shipped contract suite, run against every platform of conftest.PLATFORMS."""

from vmm_core.testing.contract import *  # noqa: F401,F403
