"""The one order of vmm_core's fork callbacks (vmm_core.forksafe): whatever order the
modules are imported in, a fork runs their before callbacks stage by stage (the lock
order of docs/threads-and-locks.md) and their after callbacks in the reverse order.

Each case runs in a fresh interpreter: callbacks registered for a test would otherwise
run at every later fork of the test run."""

from __future__ import annotations

import ast
import json
import random
import textwrap
from pathlib import Path

import pytest
from proc_state import run_python

from vmm_core import forksafe

ROOT = Path(__file__).resolve().parent.parent


def _modules_that_register() -> list[str]:
    """Every library module with a call of ``at_fork``, as an importable name."""
    found = []
    for top, package in (("vmm_core", "vmm_core"), ("backends", "vmm_backends")):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and getattr(node.func, "attr", getattr(node.func, "id", None))
                     == "at_fork"]
            if calls and path.name != "forksafe.py":
                parts = path.relative_to(ROOT / top).with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__init__" else parts
                found.append(".".join((package, *parts)))
    return found


def _order_after_importing(modules: list[str]) -> list[list[str]]:
    proc = run_python(f"""
        import importlib, json
        for name in {modules!r}:
            importlib.import_module(name)
        from vmm_core import forksafe
        print(json.dumps(forksafe.order()))
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_fork_order_is_the_declared_one_whatever_the_import_order():
    modules = _modules_that_register()
    assert "vmm_core.registry" in modules and "vmm_backends.host.vmm_api" in modules
    shuffled = list(modules)
    random.Random(7).shuffle(shuffled)
    orders = [_order_after_importing(names)
              for names in (modules, list(reversed(modules)), shuffled)]
    assert orders[0] == orders[1] == orders[2]
    order = orders[0]
    # stage by stage, by name within a stage; and every module that registers is there
    assert order == sorted(order, key=lambda hook: (forksafe.STAGES.index(hook[0]),
                                                     hook[1]))
    assert {name.rsplit(".", 1)[0] for _, name in order} == set(modules)
    # the lock order: the tagged-memory and allocator locks before the registry's
    stage_of = {name.rsplit(".", 1)[0]: stage for stage, name in order}
    assert forksafe.STAGES.index(stage_of["vmm_core.memory.fork_locks"]) \
        < forksafe.STAGES.index(stage_of["vmm_core.registry"])


def _fork_recording_calls(setup: str):
    """Run ``setup`` (which registers callbacks appending to ``calls``), fork, and return
    the process and what ``calls`` held in the parent and in the child."""
    proc = run_python(textwrap.dedent("""
        import json, os
        from vmm_core import forksafe
    """) + textwrap.dedent(setup) + textwrap.dedent("""
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, json.dumps(calls).encode())
            os._exit(0)
        os.close(write)
        child = json.loads(os.read(read, 1 << 16))
        os.waitpid(pid, 0)
        print(json.dumps({"parent": calls, "child": child}))
    """))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(proc.stdout.splitlines()[-1])


def test_a_fork_runs_before_callbacks_in_stage_order_and_after_callbacks_in_reverse():
    """Callbacks registered in a scrambled order, one of them failing: every callback
    runs, before ones in stage order, after ones (parent and child) in reverse."""
    proc, seen = _fork_recording_calls("""
        calls = []

        def hook(stage, what):
            def fn():
                calls.append(f"{what}:{stage}")
                if stage == "offload" and what == "before":
                    raise RuntimeError("this callback fails")
            fn.__qualname__ = f"hook_{stage.replace(' ', '_')}_{what}"
            return fn

        for stage in ("teardown", "offload", "integrations", "registry"):
            forksafe.at_fork(stage, **{w: hook(stage, w) for w in
                                       ("before", "after_in_parent", "after_in_child")})
    """)
    assert "RuntimeError: this callback fails" in proc.stderr  # reported, as Python does
    before = ["before:integrations", "before:offload", "before:registry", "before:teardown"]
    assert seen["parent"] == before + ["after_in_parent:teardown",
                                       "after_in_parent:registry",
                                       "after_in_parent:offload",
                                       "after_in_parent:integrations"]
    assert seen["child"] == before + ["after_in_child:teardown", "after_in_child:registry",
                                      "after_in_child:offload", "after_in_child:integrations"]


def test_at_fork_refuses_an_unknown_stage_naming_the_stages():
    with pytest.raises(ValueError, match=r"stage must be one of \('integrations'"):
        forksafe.at_fork("allocatorz", after_in_child=lambda: None)
    with pytest.raises(ValueError, match="pass before=, after_in_parent= or after_in_child="):
        forksafe.at_fork("offload")


def test_a_fork_waits_once_for_all_stages_together(host):
    """Two stages' locks held by other threads: the fork waits at most
    FORK_WAIT_SECONDS in all (each stage waiting its own bound would take twice that),
    and the child still works."""
    proc = run_python("""
        import os, threading, time, vmm_core
        from vmm_core import forksafe, registry
        from vmm_core.memory import tagged
        forksafe.FORK_WAIT_SECONDS = 2.0
        be = vmm_core.get_backend("host")
        held, done = threading.Barrier(3), threading.Event()
        def hold(lock):
            with lock:
                held.wait()
                done.wait()
        for lock in (tagged.state_lock(), registry.default_registry()._lock):
            threading.Thread(target=hold, args=(lock,), daemon=True).start()
        held.wait()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            with vmm_core.region("child", backend=be, reserve_bytes=1 << 20) as alloc:
                alloc.allocate(4096)
            vmm_core.sleep()
            vmm_core.wake_up()
            os._exit(0)
        waited = time.monotonic() - start
        done.set()
        _, status = os.waitpid(pid, 0)
        print("waited", waited, "child", os.waitstatus_to_exitcode(status))
    """, hung="a fork over held locks")
    assert proc.returncode == 0, proc.stderr[-2000:]
    words = proc.stdout.split()
    waited, child = float(words[1]), int(words[3])
    assert child == 0, proc.stderr[-2000:]
    assert 1.9 < waited < 3.5, waited  # one bound of 2 s, not one per stage


def test_a_callback_registered_during_a_fork_has_no_after_without_its_before():
    """A module imported by another thread while a fork waits registers callbacks
    mid-fork: an after callback whose before did not run is not run unpaired, and a
    renewal that needs no before runs, in the parent and in the child."""
    proc, seen = _fork_recording_calls("""
        import threading

        calls, registered = [], threading.Event()

        def paired_before():
            calls.append("paired before")

        def paired_after():
            calls.append("paired after")

        def renew():
            calls.append("renew")

        def register_meanwhile():  # what an import on another thread does
            forksafe.at_fork("offload", before=paired_before,
                             after_in_parent=paired_after, after_in_child=paired_after)
            forksafe.at_fork("host memory", after_in_parent=renew, after_in_child=renew)
            registered.set()

        def wait_for_the_other_thread():
            threading.Thread(target=register_meanwhile).start()
            assert registered.wait(10)

        forksafe.at_fork("integrations", before=wait_for_the_other_thread)
    """)
    assert seen == {"parent": ["renew"], "child": ["renew"]}
