"""The allocator scenario that ``vmm-core bench`` runs where no graphs can be captured.

Each "shape" allocates a working set (as a decode step of that batch size would) from a
new virtual space.  Physical memory is counted where the backend holds it: the bytes of
the handles it created and has not released, seen at its ``vmm_create_handle`` and
``vmm_release_handle`` hooks, so the max-vs-sum result is measured, not computed.
Aliasing is verified byte for byte through the copy hooks, and a sleep/wake round checks
that offloaded bytes come back at the same addresses and that a discard gives every
page back.  Only the vmm_api contract is used, so this runs on any backend that passes
the contract suite, the host backend or a third party's.  What it cannot show is graph
memory: that is the framework's allocations during device graph capture, which needs a
device (docs/benchmarks.md has the GPU numbers), and the run says so.
"""

from __future__ import annotations

import ctypes
import time

from vmm_core import SharedVMMAllocator
from vmm_core.errors import ReservationExceededError

from .errors import BenchModelError
from .measure import VLLM_DECODE_SIZES, as_backend, ordered
from .spec import HOST_SLEEP_GIB, BenchSpec

__all__ = ["working_set", "run_host_demo", "run_host_bench", "check_model_on_cpu",
           "closing_sentence", "plot", "COLUMNS", "HandleMeter"]

HIDDEN, FFN, DTYPE_BYTES = 4096, 14336, 2
MIB = 2**20
MARK_BYTES = 64

#: the host table's columns, explained under it (docs/benchmarks.md repeats them)
COLUMNS = (
    ("shapes", "batch sizes run, each allocating its working set in a new virtual space"),
    ("physical MiB", "bytes of physical memory the backend holds at the end (its handles, "
                     "counted as it creates and releases them)"),
    ("max set MiB", "the largest shape's working set: the least any scheme must hold"),
    ("sum MiB", "all working sets together: what one allocation per shape would hold"),
    ("phys/max, sum/max", "those two against the largest working set"),
    ("handles", "physical memory handles behind every space"),
    ("switch ms", "median time to open a new virtual space and map every handle into it"),
    ("aliased", "a write through the last space was read back through every space"),
    ("sleep/wake", "offload sleep held 0 bytes and wake gave every space its bytes back; "
                   "a discard sleep freed every page and wake(zero=True) read zeros"),
)


class HandleMeter:
    """A backend seen through its hooks, counting the bytes of the physical memory handles
    it holds: created through ``vmm_create_handle`` and not yet given back to
    ``vmm_release_handle``.  A stand-in that delegates every other name to the real
    backend, as every ``backend=`` argument of vmm_core accepts."""

    def __init__(self, backend) -> None:
        self._real = backend
        self._held: dict[int, tuple[object, int]] = {}  # id -> (handle, bytes)

    def __getattr__(self, name):
        return getattr(self._real, name)

    @property
    def held_bytes(self) -> int:
        return sum(size for _, size in self._held.values())

    def create_handle(self, device: int, size: int):
        handle = self._real.create_handle(device, size)
        self._held[id(handle)] = (handle, size)  # the handle kept: its id stays its own
        return handle

    def release_handle(self, device: int, handle) -> None:
        self._real.release_handle(device, handle)
        self._held.pop(id(handle), None)


def working_set(tokens: int) -> list[int]:
    """Buffer sizes a decode step of ``tokens`` would allocate (MLP-layer shaped)."""
    return [tokens * HIDDEN * DTYPE_BYTES, tokens * FFN * DTYPE_BYTES * 2,
            tokens * FFN * DTYPE_BYTES, tokens * HIDDEN * DTYPE_BYTES]


def _mark(alloc: SharedVMMAllocator, space: int, value: int) -> None:
    alloc.backend.memset(alloc.device, alloc.space_base(space), value, MARK_BYTES)


def _reads(alloc: SharedVMMAllocator, space: int) -> bytes:
    buf = ctypes.create_string_buffer(MARK_BYTES)
    alloc.backend.copy_to_host(alloc.device, alloc.space_base(space), ctypes.addressof(buf),
                               MARK_BYTES)
    return buf.raw


def _page_rounded(tokens: int, granularity: int) -> int:
    return sum(-(-b // granularity) * granularity for b in working_set(tokens))


def check_sizes_fit(sizes, backend=None) -> None:
    """Refuse, before any work, a batch size whose working set one virtual space cannot
    hold; the remedy is the flag the user typed."""
    alloc = SharedVMMAllocator(backend if backend is not None else "host")
    try:
        reserve, granularity = alloc.reserve_bytes, alloc.granularity
    finally:
        alloc.close()
    too_big = [n for n in sizes if _page_rounded(n, granularity) > reserve]
    if too_big:
        n = max(too_big)
        fits = reserve // sum(working_set(1))  # the working set grows linearly
        raise ReservationExceededError(
            f"--sizes {','.join(map(str, too_big))}: batch {n} needs a working set of "
            f"{_page_rounded(n, granularity) / 2**30:.1f} GiB, more than one virtual space "
            f"of this backend reserves ({reserve / 2**30:.1f} GiB); pass --sizes of at most "
            f"about {fits}")


def run_host_demo(sizes=None, order: str = "ascending", backend=None, seed: int = 0,
                  on_shape=None) -> dict:
    """Allocate every shape's working set from its own virtual space, in ``order``, then
    put the memory to sleep and wake it twice (offload, then discard).

    ``backend`` is a Backend or a name (default ``"host"``); ``on_shape()`` is called
    after each shape (a progress bar's update).
    """
    sizes = ordered(sizes or VLLM_DECODE_SIZES, order, seed)
    real = as_backend("host" if backend is None else backend)
    meter = HandleMeter(real)
    alloc = SharedVMMAllocator(meter)
    try:
        separate = 0
        largest = 0
        growth_physical, growth_separate = [], []
        t0 = time.perf_counter()
        marks = []
        for i, tokens in enumerate(sizes):
            if i:
                alloc.switch_to_new_virtual_space()
            need = 0
            for nbytes in working_set(tokens):
                p = alloc.allocate(nbytes)
                need += alloc.live_allocations()[p]
            separate += need
            largest = max(largest, need)
            # touch the set: mark its first bytes with the shape index
            _mark(alloc, alloc.current_space, i % 251 + 1)
            marks.append(alloc.current_space)
            growth_physical.append(meter.held_bytes)
            growth_separate.append(separate)
            if on_shape is not None:
                on_shape()
        seconds = time.perf_counter() - t0
        physical = meter.held_bytes
        # Aliasing: every space's first bytes are the same physical bytes; the last
        # shape wrote last, so every space must read its mark.
        last_mark = (len(sizes) - 1) % 251 + 1

        def every_space_reads(byte: int) -> bool:
            return all(_reads(alloc, s) == bytes([byte]) * MARK_BYTES for s in marks)

        aliased = every_space_reads(last_mark)
        switches = alloc.switch_seconds
        # sleep/wake: offloaded bytes come back at the same addresses; discard frees all
        alloc.sleep(offload=True)
        asleep_offload = meter.held_bytes
        alloc.wake()
        offload_kept = every_space_reads(last_mark) and meter.held_bytes == physical
        alloc.sleep(offload=False)
        asleep_discard = meter.held_bytes
        alloc.wake(zero=True)
        discard_zeroed = every_space_reads(0)
        return {
            "backend": alloc.backend.name,
            "order": order,
            "shapes": len(sizes),
            "physical_bytes": physical,
            "largest_working_set_bytes": largest,
            "sum_of_working_sets_bytes": separate,
            "ratio_to_largest": physical / largest,
            "ratio_sum_to_largest": separate / largest,
            "handles": alloc.num_handles,
            "virtual_spaces": alloc.num_virtual_spaces,
            "switch_ms_median": 1e3 * sorted(switches)[len(switches) // 2] if switches else 0.0,
            "seconds": seconds,
            "aliasing_verified": aliased,
            "growth_physical_bytes": growth_physical,
            "growth_separate_bytes": growth_separate,
            "sleep_wake": {"asleep_offload_bytes": asleep_offload,
                           "offload_bytes_back": offload_kept,
                           "asleep_discard_bytes": asleep_discard,
                           "discard_woke_zeroed": discard_zeroed},
            "sleep_wake_verified": (offload_kept and discard_zeroed and asleep_offload == 0
                                    and asleep_discard == 0),
        }
    finally:
        alloc.close()


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f}" if n >= 100 * MIB else f"{n / MIB:.1f}"


def closing_sentence(rows: list[dict]) -> str:
    """The host run's last lines: what this CPU run proves and what it cannot."""
    held = max(r["physical_bytes"] for r in rows)
    largest = max(r["largest_working_set_bytes"] for r in rows)
    spaces = max(r["virtual_spaces"] for r in rows)
    where = " in every order" if len(rows) > 1 else ""
    aliased = all(r["aliasing_verified"] for r in rows)
    slept = all(r["sleep_wake_verified"] for r in rows)
    proved = (f"What this CPU run proves: {spaces} virtual ranges mapped the same "
              f"{_mib(held)} MiB of physical pages{where} "
              + ("(a write through one was read back through all of them)" if aliased else
                 "(BUT the write through one was NOT read back through all: a bug)")
              + f", the allocator's bookkeeping held {held / largest:.2f}x the largest "
              f"working set, and sleep/wake "
              + ("gave every byte back (offload) and every page back (discard)." if slept
                 else "FAILED its byte check."))
    cannot = ("What it cannot show is how much graph memory a device saves: that memory is "
              "the framework's allocations during graph capture, which only a GPU run "
              "measures (see docs/benchmarks.md for the measured GPU numbers).")
    return proved + "\n" + cannot


def plot(rows: list[dict], path: str, *, title: str) -> None:
    """One PNG: physical memory held as shapes are allocated, against one allocation per
    shape, per order.  The CLI checks that matplotlib is installed before the run."""
    from .report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, r in enumerate(rows):
        xs = range(1, len(r["growth_physical_bytes"]) + 1)
        color = plt.get_cmap("tab10")(i % 10)
        ax.plot(xs, [b / MIB for b in r["growth_physical_bytes"]], color=color,
                label=f"vmm_core physical, {r['order']}")
        ax.plot(xs, [b / MIB for b in r["growth_separate_bytes"]], color=color,
                linestyle="--", label=f"one allocation per shape, {r['order']}")
    ax.set_xlabel("shapes allocated (each in a new virtual space)")
    ax.set_ylabel("MiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=110)


def _notes(spec: BenchSpec) -> list[str]:
    """One line per flag a backend without device graphs cannot honour."""
    notes = []
    decode = spec.scenarios == ("decode",)
    if not decode:
        notes.append(f"--scenario {spec.scenario}: captures device graphs with an "
                     f"engine-shaped runner; this backend has none, so the allocator "
                     f"scenario runs instead")
    if "modes" in spec.given and decode:
        notes.append("--modes: graph pool strategies need device graphs; ignored here")
    if "repeat" in spec.given and decode:
        notes.append("--repeat: repeats the device-graph configurations; ignored here")
    if "strategies" in spec.given and not decode:
        notes.append(f"--strategies: {spec.scenario} strategies need device graphs; "
                     f"ignored here")
    if "executables" in spec.given and not decode:
        notes.append("--executables: the engine-runner scenarios replay device graphs; "
                     "ignored here (the policies themselves run on this backend in "
                     "scripts/executables_policy_trace.py)")
    if spec.sleep is not None:
        flag = "--sleep-only" if spec.sleep.only else "--sleep"
        default = ",".join(f"{g:g}" for g in HOST_SLEEP_GIB)
        notes.append(f"{flag}: sleep/wake bandwidth is measured on a device backend; here "
                     f"the sleep rounds run the same offload code by host memcpy (CPU "
                     f"rates, --sleep-gib default {default}), and every order's sleep/wake "
                     f"bytes are checked in the allocator scenario")
    if spec.model.name is None:
        unused = sorted(spec.model.options) + (["dtype"] if "dtype" in spec.given else [])
        if unused:
            flags = ", ".join("--" + k.replace("_", "-") for k in sorted(unused))
            notes.append(f"{flags}: configure --model, which this run does not build; "
                         f"ignored")
    return notes


def check_model_on_cpu(spec: BenchSpec) -> dict:
    """What a machine without device graphs can do with ``--model``: check it.

    A factory is imported, called with ``device=cpu`` and ``dtype=float32``, and its
    function run once eagerly at the largest batch, so a mistake shows before device time
    is spent.  The built-in models are only resolved: they are large for a CPU, and the
    device benchmark builds them anyway.
    """
    from .workload import (
        BUILTIN_MODELS,
        check_eager,
        check_options,
        load_workload,
        resolve_factory,
    )

    name = spec.model.named("mlp")
    resolve_factory(name)  # a bad spec fails here, before torch is imported
    if name in BUILTIN_MODELS:
        check_options(name, spec.model.options)
        print(f"--model {name}: a built-in model; its graphs are captured only on a device "
              f"backend (CUDA, Ascend, MLU), so it is not built here.")
        return {"name": name, "checked": "resolved"}
    import torch

    n = max(spec.sizes)
    workload = load_workload(name, device="cpu", dtype=torch.float32, max_batch=n,
                             seed=spec.seed, options=spec.model.options)
    try:
        outputs = check_eager(workload)
    except BenchModelError:
        raise
    except Exception as exc:  # the user's function: one line, the CLI's model exit code
        raise BenchModelError(f"--model {name!r}: the function the factory returned raised "
                              f"{type(exc).__name__} when run eagerly at batch {n}: "
                              f"{exc}") from exc
    print(f"--model {name}: built on the CPU in float32 and run once eagerly at batch {n}: "
          f"{workload.description}, outputs {', '.join(map(str, map(list, outputs)))}. Its "
          f"graphs are captured only on a device backend (CUDA, Ascend, MLU); the scenario "
          f"below does not use it.")
    return {"name": name, "checked": "built on the CPU and run eagerly",
            "description": workload.description, "outputs": [list(o) for o in outputs]}


def run_host_bench(spec: BenchSpec, selection) -> dict:
    """``vmm-core bench`` on a backend without device graphs: say which flags it cannot
    honour, check ``--model``, run the allocator scenario, and say what it proves."""
    from . import report
    from .progress import bar, bars_enabled

    backend = selection.backend
    sizes = list(spec.sizes)
    print(f"backend {backend.name!r} ({selection.reason}).")
    check_sizes_fit(sizes, backend)
    ops = backend.graph_ops(0)
    why = "it has no graph API" if ops is None else "a CPU has no device graphs"
    notes = _notes(spec)
    for note in notes:
        print(f"note: {note}")
    model = check_model_on_cpu(spec) if spec.model.name is not None else None
    print(f"No graphs are captured on this backend ({why}), so this runs the allocator "
          f"scenario: each shape allocates an MLP-sized working set from a new virtual "
          f"space, then the memory sleeps and wakes.\n")
    draw = bars_enabled(spec.output.quiet)
    rows = []
    for order in spec.orders:
        with bar(len(sizes), f"host {order}", enabled=draw, unit="shape") as shapes:
            rows.append(run_host_demo(sizes, order, backend=backend, seed=spec.seed,
                                      on_shape=shapes.update))
    print(f"{'order':11s} {'shapes':>6s} {'physical MiB':>12s} {'max set MiB':>11s} "
          f"{'sum MiB':>9s} {'phys/max':>8s} {'sum/max':>7s} {'handles':>7s} "
          f"{'switch ms':>9s} {'aliased':>7s} sleep/wake")
    for r in rows:
        print(f"{r['order']:11s} {r['shapes']:6d} {r['physical_bytes'] / MIB:12.1f} "
              f"{r['largest_working_set_bytes'] / MIB:11.1f} "
              f"{r['sum_of_working_sets_bytes'] / MIB:9.1f} {r['ratio_to_largest']:8.3f} "
              f"{r['ratio_sum_to_largest']:7.1f} {r['handles']:7d} "
              f"{r['switch_ms_median']:9.3f} {str(r['aliasing_verified']):>7s} "
              f"{r['sleep_wake_verified']}")
    print()
    width = max(len(name) for name, _ in COLUMNS)
    for name, meaning in COLUMNS:
        print(f"  {name:{width}s}  {meaning}")
    ok = all(r["aliasing_verified"] and r["sleep_wake_verified"] for r in rows)
    if spec.output.plot:
        plot(rows, spec.output.plot, title=f"vmm-core bench on the {backend.name} backend: "
                                           f"{len(sizes)} shapes, allocator scenario")
    sentence = closing_sentence(rows)
    print()
    print(sentence)
    if spec.output.plot:
        print(f"wrote {spec.output.plot}")
    result = {"schema": report.SCHEMA, "kind": "host-demo", "backend": backend.name,
              "sizes": sizes, "model": model, "rows": rows, "summary": sentence, "ok": ok,
              "notes": notes + list(spec.notes)}
    if spec.sleep is not None:
        from .group_run import under_torchrun

        if under_torchrun():  # one rank per process: the group's rows, over gloo
            from .group_sleep import run_group_sleep_bench as run_host_sleep_bench
        else:
            from .sleep import run_host_sleep_bench

        result["sleep"] = run_host_sleep_bench(spec, backend)
        result["ok"] = ok and result["sleep"]["ok"]
    return result
