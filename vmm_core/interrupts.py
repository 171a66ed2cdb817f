"""Ctrl-C held back across the steps that must not stop halfway.

Python raises KeyboardInterrupt at whatever bytecode the main thread runs when SIGINT
arrives.  A few steps of vmm_core leave memory inconsistent when cut there: the unmap
and release of a sleep (an allocator that says awake with nothing mapped), a wake from
its first map until its listeners are told (a mapping no book holds, pools that believe
their memory asleep), and a group sleep or wake, whose ranks must all reach the
agreement and the undo, or the group is left half asleep.  While a :class:`Held` is
armed, every SIGINT is noted (the first one said on stderr) and KeyboardInterrupt is
raised as the step ends, whether it ended well or failed (the failure is then its
context).  There is no way out halfway: a step cut halfway is the defect this prevents.
A group step waiting for a rank that never comes ends at the group's timeout.

Only on the main thread (the one Python delivers SIGINT to), and only while Python's own
handler is installed: a program with a handler of its own keeps it, and a step inside
another one changes nothing.  The handler writes its one line with ``os.write``, not
through logging: it runs between two bytecodes of whatever the main thread was doing,
a logging handler's lock included.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import wait

__all__ = ["Held", "held", "pythons_own_ctrl_c", "settle", "run_all"]


class Held:
    """Ctrl-C held from :meth:`arm` (or entering, with ``armed=True``) until the block
    ends; a class, not a generator, so that the interrupt it raises holds no frame that
    holds it (a reference cycle that would keep the step's objects until a collection)."""

    __slots__ = ("what", "_came", "_armed", "_tell")

    def __init__(self, what: str, armed: bool = False, note=None) -> None:
        """``note``: a one-item buffer (a list, a ctypes pointer) set to 1 when a Ctrl-C
        comes while this holds, and left so once the interrupt is raised: what a caller
        reads to hand the interrupt on when the step ended in another exception, or
        outside the frame that made this."""
        self.what = what
        self._came = False
        self._armed = armed
        self._tell = note

    def __enter__(self) -> Held:
        if self._armed:
            self._armed = False
            try:
                self.arm()
            except BaseException as exc:  # another signal's handler raised as it armed:
                self._end(exc)  # the block never runs, nor its __exit__: none held after
                raise
        return self

    def arm(self) -> None:
        """Hold Ctrl-C from now (nothing where this is not the main thread, Python's
        handler is not the one installed, or an outer step holds it already)."""
        if self._armed or not pythons_own_ctrl_c():
            return
        self._armed = True  # first: a SIGINT as the handler goes in finds it armed
        signal.signal(signal.SIGINT, self._note)

    def _note(self, signum, frame) -> None:
        if not self._armed:  # installed again by code that saved it: nothing held now,
            if signal.getsignal(signal.SIGINT) == self._note:  # and Python's handler back
                signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        if not self._came:
            self._came = True
            if self._tell is not None:
                self._tell[0] = 1
            try:
                os.write(2, f"vmm_core: Ctrl-C held until {self.what} is done\n".encode())
            except OSError:
                pass

    def _disarm(self) -> None:
        """Python's handler back first, then disarmed: a SIGINT in between is held.
        ``signal.signal`` runs pending handlers before it installs, and installs nothing
        when one raises (a SIGTERM handler's SystemExit): the hold would stay for the
        rest of the process, so it tries again and raises the first such error after.
        Past ``_DISARM_TRIES`` (handlers raising at every try) it is disarmed as it is:
        the next Ctrl-C then puts Python's handler back itself (:meth:`_note`)."""
        error = None
        for _ in range(_DISARM_TRIES):
            if not self._armed:
                break
            try:
                if signal.getsignal(signal.SIGINT) == self._note:  # not one a step put in
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                self._armed = False
            except BaseException as exc:  # noqa: BLE001 - raised once Python's is back
                error = error or exc
        self._armed = False
        if error is not None:
            raise error

    def _end(self, exc) -> None:
        """Disarm; a Ctrl-C noted is raised where the step ended well or in an Exception
        (``exc``, or one another signal's handler raised as it disarmed: its context)."""
        try:
            self._disarm()
        except BaseException as error:
            if self._came and isinstance(error, Exception):
                self._came = False
                raise KeyboardInterrupt  # the error its context
            raise
        if self._came and (exc is None or isinstance(exc, Exception)):
            self._came = False
            raise KeyboardInterrupt

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._end(exc)
        return False


#: how often a step tries to put Python's SIGINT handler back while other signals'
#: handlers raise inside ``signal.signal`` (each try runs the handlers pending then)
_DISARM_TRIES = 100


def pythons_own_ctrl_c() -> bool:
    """Whether a Ctrl-C here would be Python's own KeyboardInterrupt: on the main thread,
    under Python's default handler (not a program's, not an outer step's hold)."""
    return threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler


def held(what: str, note=None) -> Held:
    """A step that holds Ctrl-C from its start to its end (see the module docstring);
    ``note`` as :class:`Held` takes it."""
    return Held(what, armed=True, note=note)


def settle(futures, what: str) -> None:
    """Wait until every future has finished, Ctrl-C held: work handed to threads reads or
    writes memory its caller frees once it returns or raises, so it must not run on.
    The futures' own errors are not raised (the caller's are what it sees)."""
    futures = [f for f in futures if f is not None]
    if futures:
        with held(what):
            wait(futures)


def run_all(pool, fn, calls, what: str) -> list:
    """``fn(*args)`` for each ``args`` of ``calls`` on ``pool``'s threads; their results
    in order once all have finished (the first error raised then, as a loop would).

    Every future is on the books before a Ctrl-C is raised (held while they are handed
    over), and after any failure, an interrupt included, every one handed out has
    finished before this raises: the work touches memory the caller frees next."""
    futures: list = []
    try:
        with held(what):
            for args in calls:
                futures.append(pool.submit(fn, *args))
        wait(futures)
        return [f.result() for f in futures]
    except BaseException:
        settle(futures, what)
        raise
