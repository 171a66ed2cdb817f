"""Device fact, printed in seconds: may another thread page-lock host memory while a
device graph is being captured in the default (global) capture mode?

Answered on an H100 (torch 2.11, cuda-bindings 13.3.1): not in the thread's default
mode (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, and the capture breaks), yes in relaxed
mode, which the CUDA backend's host register/unregister hooks now switch to for the call
(kept copies register in the background after a sleep, beside captures vmm_core never
sees).  A capture space still waits for registrations in flight, and ``offload.prepare``
pins under the lock every capture block holds.  This asks the driver, in a process of
its own (a broken capture stays here): a thread calls cuMemHostRegister /
cuMemHostUnregister while the main thread captures, first straight through the driver in
the thread's default mode, then through vmm_core's CUDA hooks (relaxed mode).  One line
per case: what the registering thread got, and whether the capture survived and replays
correctly.

Usage: python3 scripts/probe_capture_pinning.py   (needs a CUDA GPU)
"""

from __future__ import annotations

import ctypes
import mmap
import threading


def _case(relaxed: bool) -> str:
    import torch

    import vmm_core

    backend = vmm_core.get_backend("cuda")
    size = 64 << 20
    buf = mmap.mmap(-1, size)
    buf.write(b"\x01" * size)  # faulted in: registration only pins
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    result = {}
    go, done = threading.Event(), threading.Event()

    def worker():
        go.wait(10)
        try:
            if relaxed:  # the hooks switch this thread to relaxed mode for the call
                backend.host_register(0, address, size)
                result["register"] = "ok"
                backend.host_unregister(0, address)
            else:  # the driver alone, in the thread's default mode (the hooks' old way)
                flags = backend._drv().CU_MEMHOSTREGISTER_PORTABLE
                backend._run(0, "cuMemHostRegister", "cuMemHostRegister", address, size,
                             flags)
                result["register"] = "ok"
                backend._run(0, "cuMemHostUnregister", "cuMemHostUnregister", address)
            result["unregister"] = "ok"
        except Exception as exc:  # noqa: BLE001 - the fact this probe reports
            result.setdefault("register", f"{type(exc).__name__}: {exc}")
        finally:
            done.set()

    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    thread = threading.Thread(target=worker, daemon=True)  # a stuck call: not waited at exit
    thread.start()
    graph = torch.cuda.CUDAGraph()
    capture = "ok"
    try:
        with torch.cuda.graph(graph):  # capture_error_mode="global", torch's default
            y = x * 2
            go.set()
            done.wait(10)  # the registration runs while this capture is open
            y = y + 1
        graph.replay()
        torch.cuda.synchronize()
        capture = "ok, replay correct" if bool((y == 3).all()) else "ok, replay WRONG"
    except Exception as exc:  # noqa: BLE001
        capture = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    go.set()
    thread.join(10)
    if result.get("register") == "ok" and "unregister" not in result:
        result["unregister"] = "not reached"
    try:  # registered but not unregistered above: leave nothing pinned behind
        backend.host_unregister(0, address)
    except Exception:  # noqa: BLE001
        pass
    mode = "RELAXED (vmm_core's hooks)" if relaxed else "default (global)"
    return (f"probe: host registration on another thread during a global-mode capture, "
            f"thread mode {mode}: cuMemHostRegister {result.get('register')}; "
            f"cuMemHostUnregister {result.get('unregister', 'not reached')}; "
            f"capture {capture}")


def main() -> None:
    """Each case in a process of its own: a capture the driver broke may leave torch's
    allocator routing that thread into the dead graph's pool."""
    import subprocess
    import sys

    if len(sys.argv) > 1:
        try:
            print(_case(sys.argv[1] == "relaxed"), flush=True)
        except Exception as exc:  # noqa: BLE001 - a probe reports, it does not fail
            print(f"probe: {sys.argv[1]}: {type(exc).__name__}: {exc}", flush=True)
        return
    import torch

    print(f"probe: torch {torch.__version__}, {torch.cuda.get_device_name(0)}", flush=True)
    for mode in ("default", "relaxed"):
        try:
            subprocess.run([sys.executable, __file__, mode], timeout=28, check=False)
        except subprocess.TimeoutExpired:
            print(f"probe: {mode}: no answer in 28 s (a call hung)", flush=True)


if __name__ == "__main__":
    main()
