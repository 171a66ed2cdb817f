"""The contract suite's import child (``same_process_import=False``) when the child fails.

The host backend, seen under a name no fresh process knows and declaring that import
only works in another process, makes the child fail at once: the parent must report the
child's own error, leave no process behind and hold no descriptor while the failure is
kept (pytest keeps it for its report).
"""

from __future__ import annotations

import dataclasses
import os

import pytest

import vmm_core
from vmm_core.testing.contract import sharing as contract


class _RenamedHost:
    def __init__(self, name: str) -> None:
        self._be, self.name = vmm_core.get_backend("host"), name

    def capabilities(self, dev):
        return dataclasses.replace(self._be.capabilities(dev), same_process_import=False)

    def __getattr__(self, attr):
        return getattr(self._be, attr)


def _children() -> set[int]:
    pid = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def test_a_child_that_fails_before_its_pid_reports_its_own_error():
    be = _RenamedHost("no-such-backend-in-a-fresh-process")
    g = be.capabilities(0).granularity
    fds, children = set(os.listdir("/proc/self/fd")), _children()
    with pytest.raises(AssertionError) as failure:
        contract._alias_through_child(be, 0, g)
    # the failure is kept here, as pytest keeps it: nothing may hang on to a descriptor
    assert set(os.listdir("/proc/self/fd")) <= fds
    assert _children() <= children
    message = str(failure.value)
    assert "import child" in message and "no-such-backend-in-a-fresh-process" in message
