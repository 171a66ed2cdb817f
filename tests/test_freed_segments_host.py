"""Whole-process memory closes each segment the framework frees: a segment it cannot close
now stays on the books (registered under its tag, tried again later), the allocation that
runs the round still gets its memory, and the other segments of the round are closed.

Each test routes a fresh interpreter (one routing per process)."""

from __future__ import annotations

import pytest
from proc_state import THREAD_STARTS_REFUSED, env_with_tests, run_python

ROUTED = """
    import threading, time
    import vmm_core
    from vmm_core.memory import whole_process, tagged

    routing = whole_process.route_process("wpc", backend="host", device=0)
    a = routing.entry.alloc(1 << 20, 0)
    b = routing.entry.alloc(1 << 20, 0)
    alloc_a, alloc_b = routing._segments[a], routing._segments[b]
    real_close = type(alloc_a).close
    failing = {"on": True}
"""

#: the close of the segment at ``a`` (``alloc_a``) refused while ``failing["on"]``
CLOSE_OF_A_REFUSED = """
    def close(self):
        if self is alloc_a and failing["on"]:
            raise RuntimeError("the driver refused")
        return real_close(self)
    type(alloc_a).close = close
"""


def test_a_freed_segment_whose_close_fails_stays_tagged_and_is_closed_later():
    out = run_python(ROUTED + CLOSE_OF_A_REFUSED + """
    routing.entry.free(a)
    routing.entry.free(b)
    c = routing.entry.alloc(1 << 20, 0)  # closes what was freed first
    print("allocated", c != 0, "error", routing.last_error)
    print("a open", not alloc_a.closed, alloc_a in tagged.allocators("wpc"),
          "b closed", alloc_b.closed, alloc_b not in tagged.allocators("wpc"))
    failing["on"] = False
    for _ in range(100):  # the closing thread tries again within its wait
        if alloc_a.closed:
            break
        time.sleep(0.05)
    print("a closed later", alloc_a.closed, alloc_a not in tagged.allocators("wpc"))
    print("frees", routing.entry.counters()["frees"])
    routing.stop()
    """, timeout=60, hung="closing the freed segments hung")
    assert out.returncode == 0, out.stderr
    assert "allocated True error None" in out.stdout, (out.stdout, out.stderr)
    assert "a open True True b closed True True" in out.stdout, (out.stdout, out.stderr)
    assert "a closed later True True" in out.stdout, (out.stdout, out.stderr)
    # kept for later in Python, not listed in the entry again: two frees, as the framework
    # made; and the failure is said once, not once per round
    assert "frees 2" in out.stdout, out.stdout
    assert out.stderr.count("could not be closed yet (RuntimeError") == 1, out.stderr


def test_an_interrupted_round_keeps_the_segments_it_did_not_close():
    out = run_python(ROUTED + """
    routing._stop.set()  # this test runs every round itself
    routing._closing.join(5)

    def close(self):
        if self is alloc_a and failing["on"]:
            raise KeyboardInterrupt
        return real_close(self)

    type(alloc_a).close = close
    routing.entry.free(a)
    routing.entry.free(b)  # after a: a is closed first
    try:
        routing.close_freed()
    except KeyboardInterrupt:
        print("interrupted")
    print("kept", sorted(routing._later) == sorted([a, b]), "b open", not alloc_b.closed)
    failing["on"] = False
    print("closed", routing.close_freed(), alloc_a.closed, alloc_b.closed,
          [x for x in (alloc_a, alloc_b) if x in tagged.allocators("wpc")])
    routing.stop()
    """, timeout=60, hung="closing the freed segments hung")
    assert out.returncode == 0, out.stderr
    assert "interrupted" in out.stdout, (out.stdout, out.stderr)
    assert "kept True b open True" in out.stdout, (out.stdout, out.stderr)
    assert "closed 2 True True []" in out.stdout, (out.stdout, out.stderr)


def test_an_interrupt_as_the_freed_list_is_taken_keeps_what_was_taken():
    """The freed addresses leave the C list before Python closes them: an interrupt as
    the list is taken (here raised as take() returns) leaves them on the books, and the
    next round closes them."""
    out = run_python(ROUTED + """
    import sys
    routing._stop.set()
    routing._closing.join(5)
    routing.entry.free(a)
    take = type(routing.entry).take.__code__

    def tracer(frame, event, arg):
        if frame.f_code is not take:
            return None

        def local(frame, event, arg):
            if event == "return":
                sys.settrace(None)
                raise KeyboardInterrupt
            return local
        return local

    sys.settrace(tracer)
    try:
        routing.close_freed()
    except KeyboardInterrupt:
        print("interrupted")
    sys.settrace(None)
    print("kept", a in routing._later, "closed", routing.close_freed(), alloc_a.closed)
    routing.stop()
    """, timeout=60, hung="closing the freed segments hung")
    assert out.returncode == 0, out.stderr
    assert "interrupted" in out.stdout, (out.stdout, out.stderr)
    assert "kept True closed 1 True" in out.stdout, (out.stdout, out.stderr)


def test_an_exception_escaping_the_callback_is_out_of_memory_not_an_address():
    """As the shim's: ctypes leaves the return value undefined when an exception escapes
    the callback, so the address travels through an out-parameter set to NULL first."""
    out = run_python(ROUTED + """
    import sys
    escaped = []
    sys.unraisablehook = escaped.append

    class Escaping(BaseException):  # not an interrupt: the callback hands those to C
        pass

    def raising(size, device, stream):
        address = 0x7000_0000_0000
        raise Escaping(address)

    routing.entry.install(raising)
    before = routing.entry.counters()["allocs"]
    print("addresses", [routing.entry.alloc(1 << 20, 0) for _ in range(3)],
          "escaped", len(escaped), "counted", routing.entry.counters()["allocs"] - before)
    routing.stop()
    """, timeout=60, hung="the raising callback hung")
    assert out.returncode == 0, out.stderr
    assert "addresses [0, 0, 0] escaped 3 counted 0" in out.stdout, (out.stdout, out.stderr)


def test_an_interrupt_after_the_segment_is_registered_undoes_it():
    """The framework got nothing (out of memory): a segment kept on the books would stay
    open and tagged, copied at every sleep, until the process ends."""
    out = run_python(ROUTED + """
    from vmm_core.memory import tag_state
    real = tag_state.register_soon
    def register_then_interrupt(tag, alloc):
        real(tag, alloc)
        raise KeyboardInterrupt
    tag_state.register_soon = register_then_interrupt
    before = set(tagged.allocators("wpc"))
    got = routing.entry.alloc(1 << 20, 0)
    tag_state.register_soon = real
    made = set(tagged.allocators("wpc")) - before
    print("got", got, "error", type(routing.last_error).__name__, "segments",
          len(routing._segments), "new tagged", len(made))
    routing.stop()
    """, timeout=60, hung="the interrupted allocation hung")
    assert out.returncode == 0, out.stderr
    assert "got 0 error KeyboardInterrupt segments 2 new tagged 0" in out.stdout, \
        (out.stdout, out.stderr)


def test_an_interrupt_once_the_segment_is_on_the_books_hands_it_out():
    """The segment is whole and registered: handing it out (the framework frees it
    later) beats an out-of-memory error and an orphan no one frees."""
    out = run_python(ROUTED + """
    import contextlib
    from vmm_core.memory import address_quarantine, whole_process as wp
    real = address_quarantine.inside_framework_allocator
    @contextlib.contextmanager
    def interrupted_on_the_way_out():
        with real():
            yield
        raise KeyboardInterrupt
    wp.address_quarantine.inside_framework_allocator = interrupted_on_the_way_out
    got = routing.entry.alloc(1 << 20, 0)
    wp.address_quarantine.inside_framework_allocator = real
    print("handed out", got != 0 and got in routing._segments, "error",
          type(routing.last_error).__name__)
    routing.entry.free(got)
    routing.close_freed()
    print("closed after its free", got not in routing._segments)
    routing.stop()
    """, timeout=60, hung="the interrupted allocation hung")
    assert out.returncode == 0, out.stderr
    assert "handed out True error KeyboardInterrupt" in out.stdout, (out.stdout, out.stderr)
    assert "closed after its free True" in out.stdout, (out.stdout, out.stderr)


def test_a_callback_replaced_while_another_thread_is_inside_it_stays_callable():
    """install() dropped the callback it replaced: a call in flight on another thread
    then ran in a freed closure (a segfault)."""
    out = run_python('''
    import threading, time
    from vmm_core.memory import whole_process
    from vmm_core.memory.shim import load_shim
    shim, entry = load_shim(), whole_process.entry()
    for lib, alloc in ((shim, lambda: shim.lib.vmm_shim_alloc(4096, 0, None)),
                       (entry, lambda: entry.alloc(4096, 0))):
        lib.install(lambda size, device, stream: (time.sleep(0), 0x7000_0000_0000)[1])
        stop = threading.Event()
        def caller():
            while not stop.is_set():
                alloc()
        t = threading.Thread(target=caller)
        t.start()
        for _ in range(100000):
            lib.install(lambda size, device, stream: (time.sleep(0), 0x7000_0000_0000)[1])
        stop.set()
        t.join()
        lib.disable()
    print("survived")
    ''', timeout=120, hung="replacing callbacks hung")
    assert out.returncode == 0 and "survived" in out.stdout, (out.returncode, out.stderr[-2000:])


def test_an_interrupt_inside_the_undo_still_closes_the_segment():
    out = run_python(ROUTED + """
    import threading
    from vmm_core.memory import tag_state
    real_register, real_unregister = tag_state.register_soon, tag_state.unregister_soon
    made = []
    def register(tag, alloc):
        made.append(alloc)
        real_register(tag, alloc)
        routing._lock.armed = True  # the next booking is interrupted
    class InterruptedOnce:  # the books' lock: interrupted as the segment is booked
        def __init__(self):
            self.lock, self.armed = threading.Lock(), False
        def __enter__(self):
            self.lock.acquire()
            if self.armed:
                self.armed = False
                self.lock.release()
                raise KeyboardInterrupt
        def __exit__(self, *exc):
            self.lock.release()
    def interrupted_unregister(tag, alloc):
        real_unregister(tag, alloc)
        raise KeyboardInterrupt
    real_lock = routing._lock
    tag_state.register_soon, tag_state.unregister_soon = register, interrupted_unregister
    routing._lock = InterruptedOnce()
    got = routing.entry.alloc(1 << 20, 0)
    tag_state.register_soon, tag_state.unregister_soon = real_register, real_unregister
    routing._lock = real_lock
    print("got", got, "closed", made[0].closed, "tagged", made[0] in tagged.allocators("wpc"))
    routing.stop()
    """, timeout=60, hung="the interrupted undo hung")
    assert out.returncode == 0, out.stderr
    assert "got 0 closed True tagged False" in out.stdout, (out.stdout, out.stderr)


REFUSED_STARTS = THREAD_STARTS_REFUSED + """
    import time
    import vmm_core
    from vmm_core.memory import whole_process, tagged
"""


def test_a_closing_thread_that_cannot_start_fails_neither_the_routing_nor_an_allocation():
    """route_process raised the start's error with the routing in place, stop() then
    always raised (a thread recorded that never started) and so did the exit's; and a
    segment kept for later, whose keeping starts the thread, made the framework's
    allocation that closed it out of memory."""
    out = run_python(REFUSED_STARTS + """
    thread_starts["vmm_core-freed-segments"] = "no thread"
    routing = whole_process.route_process("wpc", backend="host", device=0)
    print("routed, closing thread", routing._closing)
    a = routing.entry.alloc(1 << 20, 0)
    alloc_a = routing._segments[a]
    real_close, failing = type(alloc_a).close, {"on": True}
    """ + CLOSE_OF_A_REFUSED + """
    routing.entry.free(a)
    c = routing.entry.alloc(1 << 20, 0)  # keeps a for later: its thread cannot start
    print("allocated", c != 0, "error", routing.last_error)
    failing["on"] = False
    routing.entry.alloc(1 << 20, 0)
    print("a closed by the next allocation", alloc_a.closed, alloc_a not in
          tagged.allocators("wpc"))
    thread_starts.clear()
    routing.stop()
    print("stopped")
    """, timeout=60, hung="a routing whose closing thread never started")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "routed, closing thread None", "allocated True error None",
        "a closed by the next allocation True True", "stopped"], (out.stdout, out.stderr)
    assert out.stderr.count("could not start") == 1, out.stderr


@pytest.mark.parametrize("when", ["before", "after", "as it fails"])
def test_ctrl_c_as_the_closing_thread_starts_leaves_a_routing_that_stops(when):
    """Before the thread existed, a Ctrl-C left one recorded that never ran: stop() and
    the exit's raised 'cannot join thread before it is started', and the exit never
    disabled the entry points."""
    out = run_python(REFUSED_STARTS + f"""
    thread_starts["vmm_core-freed-segments"] = "ctrl-c {when}"
    try:
        whole_process.route_process("wpc", backend="host", device=0)
        print("not raised")
    except KeyboardInterrupt:
        print("raised")
    routing = whole_process.process_routing()
    closing = routing._closing
    print("closing thread", "alive" if closing is not None and closing.is_alive() else
          "none" if closing is None else "recorded, not running")
    routing.stop()
    print("stopped")
    """, timeout=60, hung="stopping a routing whose start was interrupted")
    assert out.returncode == 0, out.stderr[-3000:]
    started = "none" if when == "as it fails" else "alive"
    assert out.stdout.splitlines() == ["raised", f"closing thread {started}", "stopped"], \
        (out.stdout, out.stderr)


def test_ctrl_c_as_the_framework_allocates_hands_out_the_memory_and_comes_back_after():
    """A Ctrl-C inside the allocation callback became out of memory inside the
    framework's allocator (or, once the segment was had, was lost with it handed out).
    Now it waits while the segment is made, the framework gets it, and the interrupt is
    raised once the allocation call has returned."""
    out = run_python(ROUTED + """
    import os, signal
    real = type(routing).allocate
    def interrupted(self, nbytes, device):
        os.kill(os.getpid(), signal.SIGINT)  # arrives as the segment is made
        return real(self, nbytes, device)
    type(routing).allocate = interrupted
    before = routing.entry.counters()["allocs"]
    got = []
    try:
        got.append(routing.entry.alloc(1 << 20, 0))
        print("not raised")
    except KeyboardInterrupt:
        print("raised after the call")
    type(routing).allocate = real
    print("handed out", routing.entry.counters()["allocs"] - before, "segments",
          len(routing.segments()))
    routing.stop()
    """, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised after the call", "handed out 1 segments 3"], \
        (out.stdout, out.stderr[-3000:])


def test_ctrl_c_pending_as_the_framework_calls_the_allocator_hands_out_a_segment():
    """As for a region's allocation (test_shim.py): a SIGINT that arrived while the
    framework's own code ran was dropped at the callback's first bytecode, and the
    framework got out of memory.  Now the segment is made and the interrupt raised after
    the call."""
    from test_shim import CTRL_C_IN_C

    out = run_python(ROUTED + CTRL_C_IN_C + """
    import sys
    escaped = []
    sys.unraisablehook = escaped.append
    alloc_now = entry_point(routing.entry.lib, "vmm_segments_alloc",
                            [ctypes.c_size_t, ctypes.c_int, CtrlCNow])
    before = routing.entry.counters()["allocs"]
    try:
        alloc_now(1 << 20, 0, None)
        sum(range(10))
        print("not raised")
    except KeyboardInterrupt:
        print("raised after the call")
    print("handed out", routing.entry.counters()["allocs"] - before, "segments",
          len(routing.segments()), "dropped", len(escaped))
    routing.stop()
    """, timeout=60, env=env_with_tests())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["raised after the call",
                                       "handed out 1 segments 3 dropped 0"], \
        (out.stdout, out.stderr[-3000:])
