"""Ctrl-C across the steps that must not stop halfway (vmm_core.interrupts), with real
SIGINTs, each in a fresh interpreter (Python delivers SIGINT to the main thread, under
its own handler).  The host backend's unmap or a sleep listener sends the signal, so it
lands exactly inside the step."""

from __future__ import annotations

import pytest
from proc_state import run_python

HELD = """
    import os, signal, threading
    from vmm_core import interrupts
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    def ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)
"""


def test_every_ctrl_c_waits_for_the_step_and_one_is_raised_as_it_ends():
    """No way out halfway: a step cut there is what holding prevents (a second Ctrl-C
    that got out cut a sleep between its release and its books: bytes lost)."""
    out = run_python(HELD + """
    done = []
    try:
        with interrupts.held("the test step"):
            ctrl_c()
            done.append(1)
            ctrl_c()
            done.append(2)
        print("not raised")
    except KeyboardInterrupt:
        print("raised after", done, signal.getsignal(signal.SIGINT) is
              signal.default_int_handler)
    """)
    assert "raised after [1, 2] True" in out.stdout, (out.stdout, out.stderr)
    assert out.stderr.count("vmm_core: Ctrl-C held until the test step is done") == 1, \
        out.stderr


def test_exit_and_a_handler_saved_and_put_back_inside_the_step_are_kept():
    out = run_python(HELD + """
    import sys
    try:
        with interrupts.held("the test step"):
            ctrl_c()
            sys.exit(3)
    except SystemExit as exc:
        print("exit kept", exc.code)
    saved = []
    with interrupts.held("the test step"):
        saved.append(signal.getsignal(signal.SIGINT))
    signal.signal(signal.SIGINT, saved[0])  # a program putting back what it saw
    try:
        ctrl_c()
        print("swallowed")
    except KeyboardInterrupt:
        print("a later Ctrl-C still interrupts")
    # and Python's handler is back, so the next step holds Ctrl-C again
    with interrupts.held("the next step") as later:
        print("next step armed", signal.getsignal(signal.SIGINT) == later._note)
    """)
    assert "exit kept 3" in out.stdout, (out.stdout, out.stderr)
    assert "a later Ctrl-C still interrupts" in out.stdout, (out.stdout, out.stderr)
    assert "next step armed True" in out.stdout, (out.stdout, out.stderr)


def test_a_listener_that_exits_leaves_no_reference_cycle_behind():
    out = run_python(SLEEPING + """
    import gc, sys
    alloc.backend = injector._real
    listener = lambda event, **kw: sys.exit(4)  # noqa: E731 - held weakly
    alloc.add_sleep_listener(listener)
    gc.collect()
    gc.disable()
    try:
        vmm_core.sleep("w", offload="w")
    except SystemExit as exc:
        print("exit", exc.code)
    print("collected", gc.collect())
    """)
    assert "exit 4" in out.stdout and "collected 0" in out.stdout, (out.stdout, out.stderr)


def test_a_step_that_fails_after_a_held_ctrl_c_raises_the_interrupt_with_its_error():
    out = run_python(HELD + """
    try:
        with interrupts.held("the test step"):
            ctrl_c()
            raise ValueError("the step failed")
    except KeyboardInterrupt as exc:
        print("interrupt, context", repr(exc.__context__))
    """)
    assert "interrupt, context ValueError('the step failed')" in out.stdout, \
        (out.stdout, out.stderr)


def test_a_handler_of_the_programs_own_and_other_threads_are_left_alone():
    out = run_python(HELD + """
    import time
    seen = []
    signal.signal(signal.SIGINT, lambda *a: seen.append("the program's handler"))
    with interrupts.held("the test step"):
        ctrl_c()
        time.sleep(0.05)
    print("seen", seen)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    errors = []
    def off_main():
        try:
            with interrupts.held("a thread's step"):
                pass
        except BaseException as exc:
            errors.append(exc)
    t = threading.Thread(target=off_main)
    t.start(); t.join()
    print("thread", errors, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    """)
    assert "seen [\"the program's handler\"]" in out.stdout, (out.stdout, out.stderr)
    assert "thread [] True" in out.stdout, (out.stdout, out.stderr)


SLEEPING = HELD + """
    import vmm_core
    from vmm_core.testing import FaultInjector

    class CtrlCAfter(FaultInjector):
        at = None  # "unmap" or "map": a Ctrl-C right after the next such call
        def _after(self, name, result):
            if self.at == name:
                self.at = None
                ctrl_c()
            return result
        def unmap(self, *args, **kwargs):
            return self._after("unmap", self._real.unmap(*args, **kwargs))
        def map(self, *args, **kwargs):
            return self._after("map", self._real.map(*args, **kwargs))

    with vmm_core.region("w", backend="host") as alloc:
        address = alloc.allocate(3 << 20)
    view = vmm_core.get_backend("host").torch_tensor(0, address, 3 << 20)
    view.fill_(7)
    injector = CtrlCAfter(alloc.backend)
    alloc.backend = injector
"""


def test_ctrl_c_inside_a_sleeps_release_of_pages_lets_the_sleep_finish():
    """Before, the interrupt landed between two unmaps: the allocator said awake with
    its pages unmapped and no host copy recorded."""
    out = run_python(SLEEPING + """
    heard = []
    listener = lambda event, **kw: heard.append(event)  # noqa: E731 - held weakly
    alloc.add_sleep_listener(listener)
    injector.at = "unmap"  # the rest still mapped
    try:
        vmm_core.sleep("w", offload="w")
        print("not raised")
    except KeyboardInterrupt:
        print("raised; asleep", alloc.asleep, "heard", heard)
    alloc.backend = injector._real
    vmm_core.wake_up("w")
    print("bytes back", bool((view == 7).all()), "heard", heard)
    """)
    assert "raised; asleep True heard ['sleep']" in out.stdout, (out.stdout, out.stderr)
    assert "bytes back True heard ['sleep', 'wake']" in out.stdout, (out.stdout, out.stderr)


def test_ctrl_c_as_a_wake_gives_its_host_copy_back_lets_the_listeners_hear_it():
    """Before, an interrupt between the pages kept and the listeners told left graph
    pools believing their memory asleep."""
    out = run_python(SLEEPING + """
    from vmm_core.memory import host_copy
    alloc.backend = injector._real
    heard = []
    listener = lambda event, **kw: heard.append(event)  # noqa: E731 - held weakly
    alloc.add_sleep_listener(listener)
    vmm_core.sleep("w", offload="w")
    real_woke = host_copy.AllocatorHostCopy.woke
    def woke(self, *args, **kwargs):
        ctrl_c()
        return real_woke(self, *args, **kwargs)
    host_copy.AllocatorHostCopy.woke = woke
    try:
        vmm_core.wake_up("w", keep_host_buffers=False)
        print("not raised")
    except KeyboardInterrupt:
        print("raised; asleep", alloc.asleep, "heard", heard,
              "host bytes", vmm_core.memory_summary()["w"]["host_bytes"])
    print("bytes back", bool((view == 7).all()))
    """)
    assert "raised; asleep False heard ['sleep', 'wake'] host bytes 0" in out.stdout, \
        (out.stdout, out.stderr)
    assert "bytes back True" in out.stdout


def test_ctrl_c_during_a_wakes_map_lets_the_wake_finish_and_the_tag_wake_again():
    """Before, the interrupt came as the driver's map returned, before the books held
    the mapping: the rollback left it mapped, and every later wake of the tag failed."""
    out = run_python(SLEEPING + """
    vmm_core.sleep("w", offload="w")
    injector.at = "map"
    try:
        vmm_core.wake_up("w")
        print("not raised")
    except KeyboardInterrupt:
        print("raised; asleep", alloc.asleep, "bytes back", bool((view == 7).all()))
    vmm_core.sleep("w", offload="w")
    vmm_core.wake_up("w")
    print("again", bool((view == 7).all()))
    """)
    assert "raised; asleep False bytes back True" in out.stdout, (out.stdout, out.stderr)
    assert "again True" in out.stdout, (out.stdout, out.stderr)


def test_a_held_ctrl_c_leaves_no_reference_cycle_behind():
    """The interrupt raised as a sleep ends holds no frame that holds it: the step's
    objects (the allocator, its host copy) go when the caller lets go, not at the next
    collection."""
    out = run_python(SLEEPING + """
    import gc
    gc.collect()
    gc.disable()
    injector.at = "unmap"  # the rest still mapped
    try:
        vmm_core.sleep("w", offload="w")
    except KeyboardInterrupt:
        pass
    print("collected", gc.collect())
    """)
    assert "collected 0" in out.stdout, (out.stdout, out.stderr)



@pytest.mark.parametrize("thread, what, region, outcome", [
    ("vmm_core-pin", "the thread that page-locks host copies", "",
     "raised in ['sleep'] asleep [True]"),
    ("vmm_core-offload", "a host copy thread", "",
     "raised in ['sleep'] asleep [False]"),
    ("vmm_core-prepare", "the thread that makes host copies ahead", ", prepare_offload=True",
     "raised in ['region'] asleep [False]"),
])
def test_ctrl_c_as_a_host_copy_thread_starts_lets_the_process_exit(thread, what, region,
                                                                     outcome):
    """Before, an interrupt inside Thread.start of one of offload's worker threads left
    a worker its executor never recorded: nothing told it to stop, and the interpreter's
    exit waited for it forever.  Now the start finishes and the interrupt is raised as
    the step that started it ends (the sleep's copy, interruptible, stops there)."""
    out = run_python(HELD + f"""
    import vmm_core
    from vmm_core import offload

    def ctrl_c_once_the_thread_runs(real):
        def start(function, *args, **kwargs):
            started = real(function, *args, **kwargs)
            thread = getattr(function, "__self__", None)
            if isinstance(thread, threading.Thread) and thread.name.startswith({thread!r}):
                ctrl_c()
            return started
        return start

    for name in ("_start_new_thread", "_start_joinable_thread"):
        if hasattr(threading, name):
            setattr(threading, name, ctrl_c_once_the_thread_runs(getattr(threading, name)))
    raised, asleep = [], []
    with offload.configured(strategy="staged", chunk_bytes=192 << 10, slots=3, threads=2):
        steps = []
        def region():
            with vmm_core.region("w", backend="host"{region}) as alloc:
                address = alloc.allocate(3 << 20)
                steps.append((alloc, address))
                vmm_core.get_backend("host").torch_tensor(0, address, 3 << 20).fill_(7)
        for name, step in (("region", region),
                           ("sleep", lambda: vmm_core.sleep("w", offload="w")),
                           ("wake", lambda: vmm_core.wake_up("w"))):
            try:
                step()
            except KeyboardInterrupt:
                raised.append(name)
                asleep.append(steps[0][0].asleep)
        vmm_core.wake_up("w")
        offload.wait_for_prepared()
        view = vmm_core.get_backend("host").torch_tensor(0, steps[0][1], 3 << 20)
        print("raised in", raised, "asleep", asleep, "bytes back", bool((view == 7).all()))
    """, timeout=30, hung="the exit waited for a thread nothing stops")
    assert f"{outcome} bytes back True" in out.stdout, (out.stdout, out.stderr)
    assert f"Ctrl-C held until the start of {what} is done" in out.stderr, out.stderr
    assert out.returncode == 0, out.stderr
