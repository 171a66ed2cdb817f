"""What a process holds, read from /proc: the multi-process tests compare it before and
after, so a leaked descriptor or mapping fails them.  Also the group barrier they share,
and the fork-while-a-lock-is-held check of the fork tests, and the child code that
refuses or interrupts a thread's start."""

from __future__ import annotations

import os

from vmm_core.distributed.group import Group

#: child code: ``thread_starts[name] = how`` makes starts of the thread named ``name``
#: fail: "no thread" (each raises "can't start new thread"), or once, with a real SIGINT,
#: "ctrl-c before" or "ctrl-c after" the thread exists, or "ctrl-c as it fails"
THREAD_STARTS_REFUSED = """
    import os, signal, threading
    thread_starts = {}
    _real_start = threading.Thread.start
    def _start(thread):
        how = thread_starts.get(thread.name)
        if how == "no thread":
            raise RuntimeError("can't start new thread")
        if not how:
            return _real_start(thread)
        del thread_starts[thread.name]
        if how in ("ctrl-c before", "ctrl-c as it fails"):
            os.kill(os.getpid(), signal.SIGINT)
        if how == "ctrl-c as it fails":
            raise RuntimeError("can't start new thread")
        _real_start(thread)
        if how == "ctrl-c after":
            os.kill(os.getpid(), signal.SIGINT)
    threading.Thread.start = _start
"""


def barrier() -> None:
    Group().gather(None, "test barrier")


def fd_table() -> dict:
    table = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            table[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return table


def memfd_maps() -> int:
    with open("/proc/self/maps") as fh:
        return sum("memfd:" in line for line in fh)


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def anonymous_mappings(size: int) -> int:
    """Private anonymous read-write mappings of exactly ``size`` bytes (host copies).

    Garbage of earlier tests (host copies, rings, allocators closed by the reaper) is
    freed first, so that it cannot leave between a test's two counts."""
    import gc

    from vmm_core.memory import reaper

    gc.collect()
    reaper.drain()
    count = 0
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if end - start == size and fields[1].startswith("rw") and fields[4] == "0":
                count += 1
    return count


def mem_available() -> int:
    """The kernel's MemAvailable, in bytes."""
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def join_child(proc, hung: str, timeout: float = 30) -> None:
    """Wait for a forked child; one still alive after ``timeout`` is killed and the test
    fails saying ``hung`` (what it hung on), so a hang costs seconds, not the suite."""
    import pytest

    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"the forked child hung {hung}")


def env_with_tests() -> dict:
    """This process's environment with the tests folder on PYTHONPATH: for a child
    snippet that imports a test module's helpers (``from test_executables_host ...``)."""
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}


def run_python(code: str, *, timeout: float = 60, env: dict | None = None,
               hung: str = "a hang or deadlock"):
    """Run ``code`` (dedented) in a fresh interpreter, so a segfault or a hang there cannot
    take the test run with it; returns the CompletedProcess, and fails the test saying
    ``hung`` when the child does not finish within ``timeout`` seconds."""
    import subprocess
    import sys
    import textwrap

    import pytest

    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the child did not finish in {timeout} s ({hung}); output: "
                    f"{exc.stdout!r} {exc.stderr!r}")


def fork_while_held(lock, work, what: str) -> None:
    """Fork while another thread holds ``lock`` (and goes on holding it for half a second),
    then run ``work()`` in the child: it must finish, not hang on a lock it inherited held
    by a thread it does not have."""
    import multiprocessing
    import threading
    import time

    taken, go = threading.Event(), threading.Event()

    def holder():
        with lock:
            taken.set()
            go.wait(5)
            time.sleep(0.5)  # still held when the fork starts

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    assert taken.wait(5)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child():
        work()
        queue.put("ok")

    go.set()
    proc = ctx.Process(target=child)
    proc.start()
    join_child(proc, what)
    thread.join(5)
    assert proc.exitcode == 0 and queue.get(timeout=5) == "ok"
