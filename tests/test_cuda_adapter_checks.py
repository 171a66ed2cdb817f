"""The CUDA adapter's refusals, which need no GPU: they read versions and settings."""

from __future__ import annotations

import pytest

from vmm_backends.cuda import allocator_adapter
from vmm_core.errors import BackendUnavailableError


def test_expandable_segments_are_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(BackendUnavailableError, match="expandable_segments:True bypasses"):
        allocator_adapter.check_torch()


def test_torch_older_than_2_8_is_refused_not_silently_shared(monkeypatch):
    monkeypatch.setattr(allocator_adapter, "installed_version", lambda dist: "2.7.1+cu126")
    with pytest.raises(BackendUnavailableError, match=r"torch>=2\.8, or capture "
                                                   r"into torch's own pools"):
        allocator_adapter.check_torch()


def test_current_torch_passes(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    allocator_adapter.check_torch()  # torch 2.13 here, 2.11 on the GPU machine
