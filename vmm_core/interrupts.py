"""Ctrl-C held back across the steps that must not stop halfway.

Python raises KeyboardInterrupt at whatever bytecode the main thread runs when SIGINT
arrives.  A few steps of vmm_core leave memory inconsistent when cut there: the unmap
and release of a sleep (an allocator that says awake with nothing mapped), the end of a
wake (memory mapped, its graph pools never told), and a group sleep or wake, whose ranks
must all reach the agreement and the undo, or the group is left half asleep.  Inside
:func:`held` the first SIGINT is noted and said, the step goes on, and KeyboardInterrupt
is raised as the step ends, whether it ended well or not.  A second SIGINT raises at
once: the way out of a step that waits for something that never comes (a rank that
died, before the group's timeout), leaving that step halfway.

Only on the main thread (the one Python delivers SIGINT to), and only while Python's own
handler is installed: a program with a handler of its own keeps it, and an inner
:func:`held` inside an outer one changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

__all__ = ["held"]

log = logging.getLogger("vmm_core")


@contextlib.contextmanager
def held(what: str):
    """Hold Ctrl-C back until the block ends (see the module docstring); ``what`` names
    the step in the one line said when a Ctrl-C is held."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    came: list[bool] = []

    def hold(signum, frame) -> None:
        if came:  # a second Ctrl-C: now, halfway
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        came.append(True)
        log.warning("vmm_core: Ctrl-C held until %s is done; press it again to interrupt "
                    "now, leaving it halfway", what)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    except BaseException as exc:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if came and not isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt  # noqa: B904 - the step's own error is its context
        raise
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if came:
        raise KeyboardInterrupt
