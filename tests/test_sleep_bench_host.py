"""``vmm-core bench --sleep``: the parts of its device-only code a CPU can run for real.

The rounds (``_ours``) run on the host backend over bytes of a region's allocator; what
the CUDA run reads from torch and torch_memory_saver is checked against their layouts.
"""

from __future__ import annotations

import ctypes
import os
import types
from pathlib import Path

import pytest

import vmm_core
from vmm_bench import sleep as bench
from vmm_bench.sleep_rounds import torch_mode
from vmm_bench.sleep_tms import TMS_COMPAT, TMS_COMPAT_DISK, TMS_COMPAT_RETAIN
from vmm_bench.spec import BenchSpec, SleepSpec
from vmm_core.integrations.torch_memory_saver.settings import retain

pytestmark = pytest.mark.usefixtures("clean_tags")


class _HostBytes:
    """The bench's ``_Bytes`` on the host backend: raw bytes of the tag's allocator."""

    def __init__(self, alloc, size: int) -> None:
        self.size = size
        self.address = alloc.allocate(size)
        self.mod = types.SimpleNamespace(mem_get_info=lambda: (0, 0), synchronize=lambda: None)
        self.ref = b""

    def randomize(self) -> None:
        self.ref = os.urandom(self.size)
        ctypes.memmove(self.address, self.ref, self.size)

    def intact(self) -> bool:
        return ctypes.string_at(self.address, self.size) == self.ref


def test_rounds_without_kept_copies_measure_the_copy_path_not_a_registered_copy(host):
    """keep_host_buffers=False rows (the ring, the grid) must not pin in the background
    at sleep: the wake would wait for it and copy straight, and the row would measure
    that instead of the path it names."""
    with vmm_core.region("bench-t", backend=host) as alloc:
        data = _HostBytes(alloc, (3 << 20) + 512)
    rows = bench._ours("ring", "bench-t", data, (1.0, 1.0), rounds=2, keep=False)
    assert [r["wake_strategy"] for r in rows] == ["direct", "direct"]
    assert all(r["bytes_restored"] and r["host_bytes_held_awake"] == 0 for r in rows)
    kept = bench._ours("kept", "bench-t", data, (1.0, 1.0), rounds=2, keep=None)
    assert [r["wake_strategy"] for r in kept] == ["pinned", "pinned"]
    assert kept[1]["strategy"] == "pinned" and all(r["bytes_restored"] for r in kept)


def test_torch_pinned_cache_bytes_reads_the_host_allocator_statistics():
    # torch 2.11's torch.cuda.host_memory_stats(): no ".all." level (that is the device
    # allocator's); "allocated_bytes" counts the blocks handed out and cached
    stats = {"allocated_bytes.current": 3 << 30, "allocated_bytes.peak": 4 << 30,
             "active_bytes.current": 0, "num_host_alloc": 5}
    mod = types.SimpleNamespace(host_memory_stats=lambda: stats)
    assert bench._torch_pinned_cache_bytes(mod) == 3 << 30
    assert bench._torch_pinned_cache_bytes(types.SimpleNamespace()) is None


class _Saver:
    """torch_memory_saver 0.0.10's hook_mode setter: refused once initialized."""

    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict = {}
        self._impl: object = None

    @property
    def hook_mode(self):
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, mode) -> None:
        assert self._impl_ctor_kwargs is not None  # AttributeError once deleted
        self._impl_ctor_kwargs["hook_mode"] = mode

    def region(self) -> None:  # what its first region does
        self._impl = types.SimpleNamespace(_hook_mode=self._impl_ctor_kwargs.get(
            "hook_mode", "preload"))
        del self._impl_ctor_kwargs


def test_torch_memory_saver_mode_is_set_once_per_process():
    tms = _Saver()
    torch_mode(tms)
    tms.region()
    torch_mode(tms)  # the second size of --sleep-gib 4,16: no AttributeError
    preloaded = _Saver()
    preloaded.region()
    with pytest.raises(RuntimeError, match="'preload'"):
        torch_mode(preloaded)


def test_sleep_only_runs_vmm_cores_rows_on_the_host_backend(host, capsys):
    """``vmm-core bench --sleep-only`` on a CPU runs the offload rows on the host backend
    (staging pipeline forced, as on a device), every byte checked; it says in words what
    it measured and judges no device target it has no device for."""
    spec = BenchSpec(sleep=SleepSpec(gib=(0.01,), only=True))
    out = bench.run_host_sleep_bench(spec, host)
    rows = out["sizes"][0]["rows"]
    default = [r for r in rows if r["variant"] == "vmm_core default (kept, pinned)"]
    ring = [r for r in rows if r["variant"] == "keep_host_buffers=False (ring only)"]
    assert out["ok"] and all(r["bytes_restored"] for r in rows)
    assert [r["strategy"] for r in default] == ["staged", "pinned", "pinned"]
    assert all(r["wake_strategy"] == "pinned" and r["wake_pin_wait_s"] >= 0 for r in default)
    between = [r for r in rows if r["variant"] == bench.BETWEEN]
    assert [(r["strategy"], r["wake_strategy"]) for r in between] == [("staged", "pinned")]
    assert between[0]["between_pin_s"] is not None
    assert [r["strategy"] for r in ring] == ["staged", "staged"]
    assert all(r["host_bytes_held_awake"] == 0 for r in ring)
    assert "bench-offload-0.01" not in vmm_core.memory_summary()  # closed afterwards
    # what a host run cannot judge, it does not: no device limit, share of it or target
    assert "targets" not in out and "pinned_d2h_gib_s" not in out
    assert all(r["sleep_pct"] is None and r["wake_pct"] is None for r in rows)
    printed = capsys.readouterr().out
    assert "CPU numbers" in printed
    for device_only in ("device->host", "%lim", "\ntarget ", "NOT met", "{'"):
        assert device_only not in printed, device_only
    threads = out["host"]["threads"]
    warm = out["host"]["warm_memcpy_gib_s"]
    assert f"measured host memory, {threads} threads over 0.01 GiB" in printed
    assert f"warm {warm:.1f} GiB/s" in printed


# ------------------------------------------------------------------ the engine integrations
def test_the_peers_run_in_the_table_order_and_the_integrations_on_the_host_too():
    assert list(bench.PEERS) == ["vLLM-style", "tms-compat", "tms-compat-retain",
                                 "vllm-plugin", "torch_memory_saver", "tms-compat-disk",
                                 "torch_memory_saver-disk"]
    assert [name for name, peer in bench.PEERS.items() if peer.host] == \
        ["tms-compat", "tms-compat-retain", "vllm-plugin", "tms-compat-disk"]
    assert bench.ROWS == ("vmm", "grid", *bench.PEERS)  # what --sleep-rows takes


@pytest.mark.usefixtures("fresh_compat")
def test_the_integrations_rows_run_on_the_host_with_every_byte_checked(host, capsys):
    """``--sleep-rows tms-compat-retain,vllm-plugin`` on a CPU: each integration's own
    calls, three rounds over random bytes checked after every wake; every round, the
    first included, copies straight into the pinned copy its region made when it ended,
    and that copy (the live bytes) is what stays held awake.  The rows' tags are closed
    afterwards, and no device target is judged."""
    spec = BenchSpec(sleep=SleepSpec(gib=(1 / 128,), only=True,  # 8 MiB: whole pages
                                     rows=("tms-compat-retain", "vllm-plugin")))
    out = bench.run_host_sleep_bench(spec, host)
    (size,) = out["sizes"]
    rows = size["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == \
        [(TMS_COMPAT_RETAIN, n) for n in (1, 2, 3)] + \
        [(bench.VLLM_PLUGIN, n) for n in (1, 2, 3)]
    assert out["ok"] and all(r["bytes_restored"] for r in rows) and size["peer_notes"] == {}
    nbytes = rows[0]["bytes"]
    for r in rows:
        assert r["strategy"] == r["wake_strategy"] == "pinned", r
        assert r["copied_bytes"] == r["host_bytes_held_awake"] == r["freed_bytes"] == nbytes
    summary = vmm_core.memory_summary()
    assert not [t for t in summary if t.startswith("tms:") or t == "weights"], summary
    assert "targets" not in out and all(r["sleep_pct"] is None for r in rows)
    printed = capsys.readouterr().out
    assert f"{TMS_COMPAT_RETAIN[:52]:52s}   3" in printed and "NOT met" not in printed
    schema = (Path(__file__).parents[1] / "docs" / "json-schema.md").read_text()
    for key in [*out, *size, *rows[0], TMS_COMPAT_RETAIN, bench.VLLM_PLUGIN]:
        assert f"`{key}`" in schema, f"docs/json-schema.md does not document {key!r}"


@pytest.mark.usefixtures("fresh_compat")
def test_the_tms_rows_at_its_defaults_and_to_disk_give_everything_back(host, tmp_path,
                                                                       monkeypatch):
    """At torch_memory_saver's defaults every pause makes a host copy and every resume
    gives it back (nothing held awake); to disk, the files hold the bytes while asleep,
    stay for the next pause as torch_memory_saver's do, and go when the row closes its
    memory; every byte checked after every wake."""
    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(tmp_path))
    spec = BenchSpec(sleep=SleepSpec(gib=(1 / 128,), only=True,
                                     rows=("tms-compat", "tms-compat-disk")))
    out = bench.run_host_sleep_bench(spec, host)
    rows = out["sizes"][0]["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == \
        [(TMS_COMPAT, n) for n in (1, 2, 3)] + [(TMS_COMPAT_DISK, n) for n in (1, 2)]
    assert out["ok"] and all(r["bytes_restored"] for r in rows)
    assert all(r["host_bytes_held_awake"] == 0 for r in rows)
    assert [r["copied_bytes"] for r in rows[:3]] == [rows[0]["bytes"]] * 3
    assert os.listdir(tmp_path) == []
    assert retain() is False, "the row put the process's setting back"


def _judged(variant: str, sleep, wake, restored=True) -> list[dict]:
    return [{"variant": variant, "round": n, "sleep_s": s, "wake_s": w, "sleep_pct": 4 / s / 50,
             "wake_pct": 4 / w / 50, "bytes_restored": restored}
            for n, (s, w) in enumerate(zip(sleep, wake), start=1)]


def _print_targets(targets: dict) -> None:
    """The summary of a run with no rows and ``targets``."""
    bench._print({"env": {"device": "d", "torch": "t", "cpus": 1, "transparent_hugepage": "x",
                          "default_strategy": "s", "default_config": {}},
                  "pinned_d2h_gib_s": 50.0, "pinned_h2d_gib_s": 50.0,
                  "host": {"threads": 1, "bytes": bench.GIB, "fresh_fill_first_gib_s": 1.0,
                           "fresh_fill_again_gib_s": 1.0, "fresh_memcpy_gib_s": 1.0,
                           "warm_memcpy_gib_s": 1.0, "release_s": 0.0},
                  "staging_ring_bytes": 0, "staging_setup_s": 0.0, "sizes": [],
                  "targets": targets})


def test_the_integrations_targets_every_tms_round_and_the_plugin_against_vllm(capsys):
    """tms-compat: every round, the first included, at 90% of the limit each way (4 GiB
    at a 50 GiB/s limit: 88.9 ms is 90%) with every byte back; vllm-plugin: round 1, where
    vLLM pins fresh host memory, sleeps 2.5x faster than the vLLM-style row's round 1 and
    wakes within 1.1x its time; rounds 2..N are reported beside it, not judged."""
    vllm = _judged(bench.VLLM_STYLE, [1.6, 0.25], [0.09, 0.09])

    def judged(tms, plugin):
        return bench._integration_targets({"gib": 4.0, "rows": tms + plugin + vllm})

    key = "4GiB, vllm-plugin round 1 vs vLLM-style"
    fast = _judged(TMS_COMPAT_RETAIN, [0.085, 0.082, 0.081], [0.086, 0.086, 0.086])
    plugin = _judged(bench.VLLM_PLUGIN, [0.2, 0.24, 0.26], [0.095, 0.085, 0.089])
    targets = judged(fast, plugin)
    tms, versus = targets["4GiB, tms-compat retain, every round"], targets[key]
    assert tms["met"] and tms["sleep_pct"] == pytest.approx(4 / 0.085 / 50)
    assert versus["met"] and versus["sleep_speedup"] == pytest.approx(1.6 / 0.2)
    assert versus["wake_ratio"] == pytest.approx(0.095 / 0.09)
    assert versus["later_sleep_speedup"] == pytest.approx(0.25 / 0.25)  # not judged
    slow_first = _judged(TMS_COMPAT_RETAIN, [0.3, 0.082, 0.081], [0.086] * 3)
    assert not judged(slow_first, plugin)["4GiB, tms-compat retain, every round"]["met"]
    lost = _judged(TMS_COMPAT_RETAIN, [0.085] * 3, [0.086] * 3, restored=False)
    assert not judged(lost, plugin)["4GiB, tms-compat retain, every round"]["met"]
    slow_wake = _judged(bench.VLLM_PLUGIN, [0.2, 0.09, 0.1], [0.1, 0.085, 0.089])
    assert not judged(fast, slow_wake)[key]["met"]
    slow_sleep = _judged(bench.VLLM_PLUGIN, [0.7, 0.09, 0.1], [0.09, 0.085, 0.089])
    assert not judged(fast, slow_sleep)[key]["met"]
    lost_later = _judged(bench.VLLM_PLUGIN, [0.2, 0.09], [0.09, 0.085]) + \
        [dict(_judged(bench.VLLM_PLUGIN, [0.1], [0.08], restored=False)[0], round=3)]
    assert not judged(fast, lost_later)[key]["met"]
    assert bench._integration_targets({"gib": 4.0, "rows": vllm}) == {}
    _print_targets(targets)
    printed = capsys.readouterr().out
    assert "target 4GiB, tms-compat retain, every round (>= 90% of the limit): sleep 94%, " \
        "wake 93%: " \
        "met" in printed
    assert "target 4GiB, vllm-plugin round 1 vs vLLM-style (sleep >= 2.5x faster, wake <= " \
        "1.1x the time): sleep 8.00x faster (rounds 2..N, not judged: 1.00x), wake 1.06x " \
        "the time: met" in printed
    schema = (Path(__file__).parents[1] / "docs" / "json-schema.md").read_text()
    for key in [*tms, *versus]:
        assert f"`{key}`" in schema, f"docs/json-schema.md does not document {key!r}"


def test_the_targets_of_every_row_kind_print_together(capsys):
    """One run's rows of every kind (vmm_core's, the vLLM plugin's beside vLLM's way,
    torch_memory_saver's API at its defaults, retained and to disk beside its own) give
    targets of both shapes, and the summary prints each of them."""
    from vmm_bench.sleep_tms import TMS_DISK

    rows = (_judged("vmm_core default (kept, pinned)", [0.09, 0.082], [0.09, 0.086])
            + _judged("vmm_core default + prepare() at load", [0.09], [0.09])
            + _judged("keep_host_buffers=False (ring only)", [0.1], [0.1])
            + _judged(bench.VLLM_STYLE, [1.6, 0.25], [0.09, 0.09])
            + _judged(bench.VLLM_PLUGIN, [0.2, 0.24], [0.095, 0.085])
            + _judged(TMS_COMPAT, [0.24, 0.25], [0.13, 0.13])
            + _judged(TMS_COMPAT_RETAIN, [0.085, 0.082], [0.086, 0.086])
            + _judged(TMS_COMPAT_DISK, [2.0, 2.1], [1.5, 1.4])
            + _judged("torch_memory_saver 0.0.10 (pinned CPU backup)", [1.6, 1.7], [0.5, 0.6])
            + _judged(TMS_DISK, [2.5, 2.4], [1.4, 1.5]))
    targets = bench._targets([{"gib": 4.0, "rows": rows}])
    assert {"4GiB, vllm-plugin round 1 vs vLLM-style",
            "4GiB, tms-compat vs torch_memory_saver, defaults, every round",
            "4GiB, tms-compat disk vs torch_memory_saver disk, every round",
            "4GiB, tms-compat retain, every round"} <= set(targets)
    _print_targets(targets)
    printed = capsys.readouterr().out
    for key in targets:
        assert f"target {key} (" in printed, f"{key!r} not printed"
    assert "target 4GiB, tms-compat disk vs torch_memory_saver disk, every round (sleep >= " \
        "1x faster, wake <= 1x the time): sleep 1.14x faster, wake 1.07x the time: NOT met" \
        in printed


def test_the_tms_rows_are_judged_against_torch_memory_saver_round_by_round():
    """At its defaults and to disk, vmm_core's rows must be faster than torch_memory_
    saver's own rows of the same rounds, each way, with every byte back."""
    from vmm_bench.sleep_tms import TMS_DISK, tms_targets

    ours = _judged(TMS_COMPAT, [0.24, 0.25, 0.24], [0.13, 0.13, 0.12])
    theirs = _judged("torch_memory_saver 0.0.10 (pinned CPU backup)", [1.6, 1.7], [0.5, 0.6])
    disk = _judged(TMS_COMPAT_DISK, [2.0, 2.1], [1.5, 1.4])
    their_disk = _judged(TMS_DISK, [2.5, 2.4], [1.4, 1.5])
    targets = tms_targets(ours + theirs + disk + their_disk, "4GiB", 0.9)
    defaults = targets["4GiB, tms-compat vs torch_memory_saver, defaults, every round"]
    assert defaults["met"] and defaults["sleep_speedup"] == pytest.approx(1.6 / 0.24)
    assert defaults["wake_ratio"] == pytest.approx(0.13 / 0.5)
    to_disk = targets["4GiB, tms-compat disk vs torch_memory_saver disk, every round"]
    assert not to_disk["met"] and to_disk["wake_ratio"] == pytest.approx(1.5 / 1.4)
    assert tms_targets(ours, "4GiB", 0.9) == {}, "nothing to compare with"
