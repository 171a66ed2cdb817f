"""The benchmark's own error: a ``--model`` that cannot run, one exit status for it."""

from __future__ import annotations

from vmm_core.errors import VMMError

__all__ = ["BenchModelError", "EXIT_BAD_MODEL"]

#: exit code of ``vmm-core bench`` (and of each benchmark child) when --model or one of
#: its options is unusable: every configuration would fail alike, so the parent stops
EXIT_BAD_MODEL = 3


class BenchModelError(VMMError, ValueError):
    """``vmm-core bench --model``: the spec, the factory or what it returned is unusable."""

    exit_status = EXIT_BAD_MODEL
