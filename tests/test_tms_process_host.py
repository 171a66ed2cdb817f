"""torch_memory_saver's whole-process mode (``TMS_INIT_ENABLE``) and the private names
its callers use, on the host backend, each in a fresh process started as RL launchers
start their training processes: the environment, and ``LD_PRELOAD`` of the library found
beside the ``torch_memory_saver`` package.

The host's CPU allocator cannot be redirected, so what a framework's pool would ask for
is asked here through the whole-process entry points themselves (the C functions the
pool loads), and region memory through the allocator a region yields."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vmm_core.integrations import torch_memory_saver as compat

MIB = 1 << 20

#: what slime's launcher (ray/actor_group.py) does to find the library
_FIND_AS_SLIME_DOES = """
import os, torch_memory_saver
for name in ("torch_memory_saver_hook_mode_preload_cu12.abi3.so",
             "torch_memory_saver_hook_mode_preload.abi3.so"):
    path = os.path.join(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)), name)
    if os.path.exists(path):
        break
else:
    raise FileNotFoundError("Cannot find torch_memory_saver dynamic library")
print(path)
"""


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TMS_") and k not in ("PYTHONPATH", "LD_PRELOAD")}
    env["VMM_CORE_BACKEND"] = "host"
    env.update(extra)
    return env


def _python(code: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def preload() -> str:
    """The library, found by the launcher's own lookup through the alias."""
    result = _python(_FIND_AS_SLIME_DOES, _clean_env(PYTHONPATH=compat.alias_path()))
    assert result.returncode == 0, result.stderr
    path = result.stdout.strip()
    assert path == compat.preload_path()
    return path


def _launched(preload: str, code: str, **env) -> subprocess.CompletedProcess:
    """A training process as slime starts one: its environment, the library preloaded,
    no PYTHONPATH of ours."""
    result = _python(code, _clean_env(LD_PRELOAD=preload, TMS_INIT_ENABLE="1", **env))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_a_process_started_as_slime_starts_one_runs_whole_in_the_default_region(preload):
    out = _launched(preload, """
        import ctypes, sys
        import torch_memory_saver
        from torch_memory_saver import torch_memory_saver as tms
        import vmm_core
        from vmm_core.memory import routing, whole_process

        assert getattr(torch_memory_saver, "__vmm_core_alias__", False), "the alias"
        # the routing starts when torch initializes its device, or at the first call
        # (the host's torch has no device to initialize)
        tms._ensure_initialized()
        # as a framework's pool: two segments of the process
        entry = whole_process.entry()
        weights = entry.alloc(4 << 20)
        scratch = entry.alloc(2 << 20)
        assert weights and scratch, whole_process.process_routing().last_error
        ctypes.memset(weights, 0x42, 4 << 20)

        cdll = tms._impl._binary_wrapper.cdll
        assert cdll.tms_get_interesting_region() and cdll.tms_get_enable_cpu_backup()
        assert cdll.tms_get_current_tag() == b"default"
        assert cdll.tms_get_cpu_backup_backend() == b"pinned"

        # slime's Megatron patch: grad buffers in a nested region without a backup
        with tms.region(tag="grad_buffer", enable_cpu_backup=False) as grads:
            assert cdll.tms_get_current_tag() == b"grad_buffer"
            assert not cdll.tms_get_enable_cpu_backup()
            grad = grads.allocate(1 << 20)
        assert cdll.tms_get_current_tag() == b"default"

        # disable() outside any explicit region
        with tms.disable():
            assert not cdll.tms_get_interesting_region()
            assert routing.current_target(0) is None

        # the DeepEP patch: its buffers out of the region while its constructor runs
        old = cdll.tms_get_interesting_region()
        cdll.tms_set_interesting_region(False)
        assert not cdll.tms_get_interesting_region() and routing.current_target(0) is None
        cdll.tms_set_interesting_region(old)
        assert cdll.tms_get_interesting_region()

        tms.pause()
        summary = vmm_core.memory_summary()
        print("paused", sorted(summary), all(v["asleep"] for v in summary.values()),
              sum(v["device_bytes"] for v in summary.values()))
        tms.resume()
        print("weights back", ctypes.string_at(weights, 4 << 20) == b"\\x42" * (4 << 20))
        ctypes.memset(grad, 1, 1 << 20)  # usable again

        # a segment the framework frees gives its memory back
        entry.free(scratch)
        routing_ = whole_process.process_routing()
        import time
        for _ in range(50):
            if scratch not in routing_.segments():
                break
            time.sleep(0.05)
        print("freed", scratch not in routing_.segments(), len(routing_.segments()))

        # what code reaching the library's C symbols does (torch_memory_saver's tests)
        assert ctypes.CDLL(None).tms_pause(None) == 0
        assert vmm_core.memory_summary()["tms:default:cpu_backup"]["asleep"]
        assert ctypes.CDLL(None).tms_resume(None) == 0
        print("C symbols ok", ctypes.string_at(weights, 2) == b"BB")
    """, TMS_INIT_ENABLE_CPU_BACKUP="1").stdout
    assert "paused ['tms:default:cpu_backup', 'tms:grad_buffer'] True 0" in out, out
    assert "weights back True" in out and "freed True 1" in out and "C symbols ok True" in out


def test_an_interrupt_inside_tms_pause_answers_failed_not_done(preload):
    """ctypes leaves a callback's return value undefined when an exception escapes it:
    Ctrl-C inside the pause that the C symbol reaches could read as "done" (0).  The
    outcome goes through an int the symbol sets to -1 first."""
    out = _launched(preload, """
        import ctypes, sys
        from torch_memory_saver import torch_memory_saver as tms
        from vmm_core.integrations.torch_memory_saver import private_api

        tms._ensure_initialized()
        escaped = []
        sys.unraisablehook = escaped.append

        class Interrupted:
            def pause(self, tag):
                raise KeyboardInterrupt

            def resume(self, tag):
                pass

        assert private_api.install_preload_callbacks(Interrupted())
        lib = ctypes.CDLL(None)
        print("answers", [lib.tms_pause(b"kv") for _ in range(3)], lib.tms_resume(None),
              len(escaped), escaped[0].exc_type.__name__)
    """).stdout
    assert "answers [-1, -1, -1] 0 3 KeyboardInterrupt" in out, out


def test_a_preloaded_library_of_another_abi_is_left_alone_and_said(tmp_path):
    """A library built by another vmm_core calls its callbacks with other arguments:
    installing ours into it would have C write through a pointer it never passed."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    src = tmp_path / "old_preload.c"
    src.write_text("int vmm_tms_preload_abi_version(void) { return 1; }\n"
                   "int installed = 0;\n"
                   "void vmm_tms_preload_install(void *p, void *r) { installed = 1; }\n")
    lib = tmp_path / "libold_preload.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    out = _python("""
        import ctypes, logging, os
        logging.basicConfig()
        old = ctypes.CDLL(os.environ["OLD_PRELOAD"], mode=ctypes.RTLD_GLOBAL)
        from vmm_core.integrations.torch_memory_saver import private_api

        print("installed", private_api.install_preload_callbacks(object()),
              ctypes.c_int.in_dll(old, "installed").value)
    """, _clean_env(OLD_PRELOAD=str(lib)))
    assert out.returncode == 0, out.stderr
    assert "installed False 0" in out.stdout, out.stdout
    assert "has ABI 1, this vmm_core expects 2" in out.stderr and "reinstall" in out.stderr


def test_threads_that_never_entered_a_block_allocate_in_the_default_region(preload):
    """A framework allocates from threads the program never touched (autograd's device
    threads run every backward): with no block of their own they take the default
    region, whatever block the main thread is in, and a pause moves their bytes too.
    Routing them by the thread that entered a block would leave them no memory at all
    (an out-of-memory error with the device empty)."""
    out = _launched(preload, """
        import ctypes, threading
        from torch_memory_saver import torch_memory_saver as tms
        import vmm_core
        from vmm_core.memory import routing, whole_process

        tms._ensure_initialized()
        entry = whole_process.entry()
        got = {}

        def allocate_on_a_fresh_thread(name, fill):
            def body():
                assert routing.current_target(0) is None  # nothing routes this thread
                address = entry.alloc(2 << 20)
                if address:
                    ctypes.memset(address, fill, 2 << 20)
                got[name] = address
            thread = threading.Thread(target=body)
            thread.start()
            thread.join()

        allocate_on_a_fresh_thread("alone", 0x11)
        with tms.region(tag="grad_buffer", enable_cpu_backup=False) as grads:
            grads.allocate(1 << 20)
            allocate_on_a_fresh_thread("beside a region", 0x22)
        with tms.disable():
            allocate_on_a_fresh_thread("beside disable()", 0x33)
        print("served", all(got.values()), whole_process.process_routing().last_error)

        routed = whole_process.process_routing()  # a segment of its own per allocation
        print("in the default region", routed.tag,
              all(a in routed.segments() for a in got.values()))
        tms.pause()
        print("asleep", vmm_core.memory_summary()["tms:default:cpu_backup"]["asleep"])
        tms.resume()
        print("back", [ctypes.string_at(got[k], 2 << 20) == bytes([fill]) * (2 << 20)
                       for k, fill in (("alone", 0x11), ("beside a region", 0x22),
                                       ("beside disable()", 0x33))])
    """, TMS_INIT_ENABLE_CPU_BACKUP="1").stdout
    assert "served True None" in out, out
    assert "in the default region tms:default:cpu_backup True" in out, out
    assert "asleep True" in out, out
    assert "back [True, True, True]" in out, out


def test_a_child_forked_while_the_segment_list_is_locked_allocates_and_frees(preload):
    """The closing thread holds the routing's segment list while it closes what the
    framework freed; a child forked then has no closing thread, so it gets the list
    unlocked, and its allocations, frees and their closing go on."""
    out = _launched(preload, """
        import ctypes, sys
        sys.path.insert(0, TESTS)
        from proc_state import fork_while_held
        from torch_memory_saver import torch_memory_saver as tms
        from vmm_core.memory import whole_process

        tms._ensure_initialized()
        routed, entry = whole_process.process_routing(), whole_process.entry()

        def child():
            address = entry.alloc(2 << 20)
            assert address and address in routed.segments(), routed.last_error
            ctypes.memset(address, 5, 2 << 20)
            entry.free(address)
            assert routed.close_freed() == 1 and address not in routed.segments()

        fork_while_held(routed._lock, child, "on the whole-process segment list")
        print("the child allocated and freed")
    """.replace("TESTS", repr(os.path.dirname(os.path.abspath(__file__)))))
    assert "the child allocated and freed" in out.stdout, out.stdout


def test_the_library_is_harmless_where_nothing_asks_for_it(preload):
    assert subprocess.run(["/bin/true"], env=_clean_env(LD_PRELOAD=preload)).returncode == 0
    result = _python("""
        import sys, os
        print("vmm_core" in sys.modules, os.environ["PYTHONPATH"].split(os.pathsep)[0])
    """, _clean_env(LD_PRELOAD=preload))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", compat.alias_path()]


def test_the_sitecustomize_it_hides_still_runs(preload, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    result = _python("import os; print(os.environ.get('THEIRS_RAN'))",
                     _clean_env(LD_PRELOAD=preload, PYTHONPATH=str(tmp_path)))
    assert result.returncode == 0 and result.stdout.strip() == "1", result.stderr


def test_launchers_find_the_library_through_utils_and_its_disk_variables(preload):
    result = _python("""
        from torch_memory_saver.utils import change_env, get_binary_path_from_package
        import os
        path = get_binary_path_from_package("torch_memory_saver_hook_mode_preload")
        print(path)
        print(b"TMS_INIT_ENABLE_DISK_BACKUP" in open(path, "rb").read())
        with change_env("TMS_SOMETHING", "1"):
            print(os.environ["TMS_SOMETHING"])
        print(os.environ.get("TMS_SOMETHING"))
        try:
            get_binary_path_from_package("torch_memory_saver_hook_mode_torch")
        except RuntimeError as exc:
            print("torch mode:", "expected one library" in str(exc))
    """, _clean_env(PYTHONPATH=compat.alias_path()))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:5] == [preload, "True", "1", "None", "torch mode: True"]


def test_the_whole_process_goes_to_disk_with_its_variables(preload, tmp_path):
    out = _launched(preload, f"""
        import ctypes, os
        from torch_memory_saver import torch_memory_saver as tms
        from vmm_core.memory import whole_process

        tms._ensure_initialized()
        entry = whole_process.entry()
        a = entry.alloc(3 << 20)
        ctypes.memset(a, 7, 3 << 20)
        tms.pause()
        files = os.listdir({str(tmp_path)!r})
        print("files", len(files), sum(os.path.getsize(os.path.join({str(tmp_path)!r}, f))
                                       for f in files))
        tms.resume()
        print("back", ctypes.string_at(a, 3 << 20) == b"\\x07" * (3 << 20),
              os.listdir({str(tmp_path)!r}) == files, files[0].startswith("tms_"))
    """, TMS_INIT_ENABLE_DISK_BACKUP="1", TMS_DISK_BACKUP_DIR=str(tmp_path),
        TMS_DISK_BACKUP_CHUNK_MB="1").stdout
    assert f"files 1 {3 * MIB}" in out and "back True True True" in out, out


def test_memory_margin_bytes_refuses_what_would_leave_too_little_free(preload):
    out = _launched(preload, """
        from torch_memory_saver import torch_memory_saver as tms
        import vmm_core
        from vmm_core.memory import shim, whole_process

        tms._ensure_initialized()
        entry = whole_process.entry()
        assert entry.alloc(1 << 20)
        free, total = vmm_core.get_backend("host").mem_get_info(0)
        tms.memory_margin_bytes = free  # nothing can be allocated and leave that much
        print("process segment", entry.alloc(1 << 20),
              "margin" in str(whole_process.process_routing().last_error))
        lib = shim.load_shim()
        lib.ensure_routing()
        with tms.region("kv"):  # a framework's allocation in a region (the shim's route)
            print("region segment", lib.lib.vmm_shim_alloc(1 << 20, 0, None))
        tms.memory_margin_bytes = 0
        print("after", bool(entry.alloc(1 << 20)))
    """).stdout
    assert "process segment 0 True" in out and "region segment None" in out, out
    assert "after True" in out


def test_the_private_region_names_callers_read(host, tmp_path):
    """``_impl._with_region_config`` and ``_impl._mem_pools`` as torch_memory_saver's
    cpu_backup example uses them: a region's pool handed over and dropped closes its
    memory and the host copy it retained."""
    import gc

    tms = compat.TorchMemorySaver(backend=host)
    tms.retain_cpu_backup = True
    with tms.region(tag="retained", enable_cpu_backup=True) as w:
        w.allocate(MIB)
    tms.pause(tag="retained")
    tms.resume(tag="retained")
    assert w.host_bytes == MIB
    tms._ensure_initialized()
    key = ("retained", True, False, "pinned", 0)
    assert key in tms._impl._mem_pools
    pool = tms._impl._mem_pools.pop(key)
    cdll = tms._impl._binary_wrapper.cdll
    with tms._impl._with_region_config(tag="retained", enable_cpu_backup=True,
                                       cpu_backup_backend="pinned"):
        assert cdll.tms_get_current_tag() == b"retained" and cdll.tms_get_enable_cpu_backup()
        del pool
        gc.collect()
    assert w.closed and w.host_bytes == 0
    assert cdll.tms_get_current_tag() == b"default"
    tms.retain_cpu_backup = False


@pytest.mark.usefixtures("clean_tags")  # its graph pool is left to the next test otherwise
def test_auto_dispatch_capture_is_refused_where_the_capture_has_no_such_option(host):
    from vmm_core.errors import CaptureError

    tms = compat.TorchMemorySaver(backend=host)
    with pytest.raises(CaptureError, match="torch_npu's capture option"):
        with tms.cuda_graph(host.graph_ops(0).new_graph(), auto_dispatch_capture=True):
            pass
    with tms.cuda_graph(host.graph_ops(0).new_graph(), tag="g", auto_dispatch_capture=False):
        pass


def test_the_whole_process_routing_ends_before_the_interpreter_finalizes():
    """Finalization destroys the framework's pools, which torch refuses while a routing
    is underway: the routing's handles are closed by the exit handler, before that."""
    result = _python("""
        import atexit
        from vmm_backends.host import allocator_adapter
        from vmm_core.memory import whole_process

        allocator_adapter._NoRouting.close = lambda self: print("routing ended", flush=True)
        whole_process.route_process("tms:default", backend="host")
        atexit.register(print, "exit handlers run", flush=True)  # runs before ours
    """, _clean_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == ["exit handlers run", "routing ended"], \
        result.stdout
