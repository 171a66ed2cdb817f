"""CPU stand-in for Cambricon's torch_mlu: only the public names vmm_backends.mlu uses.

torch_mlu is not on PyPI and needs Neuware, so the MLU adapter and graph ops are wired
against this package in tests.  Names and signatures mirror Cambricon/torch_mlu branch
r2.4_develop (commit 9e95f972d3bf); tests/test_mlu_wiring.py checks them against a table of
the real signatures.  Like the real package it has no MemPool.

The real package registers ``torch.mlu`` on import (torch._register_device_module), which
cannot be undone inside a test process; the stand-in leaves that to the test, which sets
``torch.mlu`` with monkeypatch.  Nothing here touches a device: work runs on the CPU.
"""

from . import mlu  # noqa: F401

__version__ = "0.0.0+cpu.standin"
