"""Skip-or-fail policy shared by every test that needs particular hardware.

CI has no accelerator, so those tests skip there; on the GPU machine
``VMM_CORE_REQUIRE=cuda`` turns every such skip into a failure, so a GPU run can never
pass by skipping.  Several platforms may be required: ``VMM_CORE_REQUIRE=cuda,ascend``.
A refinement names what a test needs beyond the platform and implies it:
``cuda-2gpu`` (tests that need two GPUs) also requires ``cuda``.
"""

from __future__ import annotations

import os

import pytest

ENV_REQUIRE = "VMM_CORE_REQUIRE"

__all__ = ["ENV_REQUIRE", "required_platforms", "skip_or_fail", "require_backend"]


def required_platforms() -> set[str]:
    raw = os.environ.get(ENV_REQUIRE, "")
    return {p.strip() for p in raw.split(",") if p.strip()}


def skip_or_fail(platform: str, reason: str):
    """Skip (CI) or fail (``VMM_CORE_REQUIRE`` names the platform) with ``reason``."""
    required = required_platforms()
    if platform in required or any(r.startswith(platform + "-") for r in required):
        pytest.fail(f"{ENV_REQUIRE} requires {platform!r} but it is unusable: {reason}",
                    pytrace=False)
    pytest.skip(f"{platform} unavailable: {reason}")


def require_backend(name: str):
    """The registered, usable backend ``name``; otherwise skip (or fail when required)."""
    import vmm_core

    backend = vmm_core.default_registry().backends().get(name)
    if backend is None:
        skip_or_fail(name, f"the {name} backend plugin did not load")
    if not backend.available:
        skip_or_fail(name, backend.probe().reason)
    return backend
