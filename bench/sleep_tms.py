"""The sleep benchmark's rows of the torch_memory_saver API: vmm_core's at its defaults,
with ``retain_cpu_backup``, and to disk, beside torch_memory_saver's own disk backup on
the same bytes, and torch_memory_saver's own rows (its CPU backups, pinned and mmap, and
its disk backup); and their targets.

* ``tms-compat``: SGLang's calls at torch_memory_saver's defaults (``retain_cpu_backup``
  off: the host copy is made at every pause and given back at every resume), against
  torch_memory_saver's own default (pinned backup) row of the same round: both ways
  faster;
* ``tms-compat-retain``: the same with ``retain_cpu_backup = True`` (the copy made ahead
  when the region ends, kept and page-locked between rounds): every round at
  ``TARGET_LATER`` of the pinned copy limit each way;
* ``tms-compat-disk`` and ``torch_memory_saver-disk``: ``enable_disk_backup`` regions
  written to the same directory (``TMS_DISK_BACKUP_DIR``, else a new one under the
  temporary directory), compared round by round.

Each row's rounds check every byte after every wake.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

__all__ = ["TMS_COMPAT", "TMS_COMPAT_RETAIN", "TMS_COMPAT_DISK", "tms_compat",
           "tms_compat_retain", "tms_compat_disk", "torch_memory_saver_cpu",
           "torch_memory_saver_disk", "tms_targets"]

TMS_COMPAT = "tms-compat (SGLang's calls, weights backed up, torch_memory_saver's defaults)"
TMS_COMPAT_RETAIN = "tms-compat retain (retain_cpu_backup=True)"
TMS_COMPAT_DISK = "tms-compat disk (enable_disk_backup)"
TMS_DISK = "torch_memory_saver disk backup"


@contextlib.contextmanager
def _retained(case, value: bool):
    """``retain_cpu_backup`` is the process's: set for the row, put back after."""
    from vmm_core.integrations.torch_memory_saver import TorchMemorySaver

    tms = TorchMemorySaver(backend=case.backend)
    before = tms.retain_cpu_backup
    tms.retain_cpu_backup = value
    try:
        yield
    finally:
        tms.retain_cpu_backup = before


@contextlib.contextmanager
def _disk_dir():
    """The directory both disk rows write to: ``TMS_DISK_BACKUP_DIR`` when set (the same
    disk for both), else a new one, removed after."""
    given = os.environ.get("TMS_DISK_BACKUP_DIR")
    path = given or tempfile.mkdtemp(prefix="vmm-bench-disk-")
    try:
        yield path
    finally:
        if not given:
            shutil.rmtree(path, ignore_errors=True)


def _weights_rows(case, variant: str, rounds: int, **region) -> list[dict]:
    from vmm_core.integrations.torch_memory_saver import TorchMemorySaver, vmm_tags

    from .sleep_rounds import engine_rounds

    tms = TorchMemorySaver(backend=case.backend)
    return engine_rounds(case, variant, tms.region("weights", **region),
                          lambda: vmm_tags("weights"), lambda: tms.pause("weights"),
                          lambda: tms.resume("weights"), rounds)


def tms_compat(case, rounds: int = 3) -> list[dict]:
    """vmm_core's torch_memory_saver API called as SGLang calls it
    (``srt/utils/torch_memory_saver_adapter.py``, the scheduler's
    ``release_memory_occupation`` / ``resume_memory_occupation``): the weights made in
    ``region("weights", enable_cpu_backup=True)``, then ``pause("weights")`` and
    ``resume("weights")``, at torch_memory_saver's defaults."""
    with _retained(case, False):
        return _weights_rows(case, TMS_COMPAT, rounds, enable_cpu_backup=True)


def tms_compat_retain(case, rounds: int = 3) -> list[dict]:
    """The same calls with ``retain_cpu_backup = True``, torch_memory_saver's opt-in."""
    with _retained(case, True):
        return _weights_rows(case, TMS_COMPAT_RETAIN, rounds, enable_cpu_backup=True)


def tms_compat_disk(case, rounds: int = 2) -> list[dict]:
    """The weights in ``region("weights", enable_disk_backup=True)``: every pause writes
    them to files (through to the disk), every resume reads them back."""
    from vmm_core.integrations.torch_memory_saver import TorchMemorySaver

    tms = TorchMemorySaver(backend=case.backend)
    with _disk_dir() as path:
        tms.set_disk_backup_dir(path)
        try:
            return _weights_rows(case, TMS_COMPAT_DISK, rounds, enable_disk_backup=True)
        finally:
            tms.set_disk_backup_dir(None)  # TMS_DISK_BACKUP_DIR again


def _own(case):
    """torch_memory_saver itself and its version, or why it gives no rows here."""
    if case.device_type != "cuda":
        return "torch_memory_saver supports CUDA only"
    try:
        import torch_memory_saver
    except ImportError:
        return "not installed here; no comparison made"
    if getattr(torch_memory_saver, "__vmm_core_alias__", False):
        return "torch_memory_saver resolves to vmm_core's alias here; no comparison made"
    version = getattr(torch_memory_saver, "__version__", None)
    try:
        from importlib.metadata import version as dist_version

        version = version or dist_version("torch_memory_saver")
    except Exception:  # noqa: BLE001
        pass
    return torch_memory_saver.torch_memory_saver, version


def _own_rounds(case, tms, region, tag: str, variant: str, rounds: int) -> list[dict]:
    """Rounds of torch_memory_saver's own pause/resume of bytes made in ``region``."""
    from .sleep_rounds import DeviceBytes, round_row

    data = DeviceBytes(case.torch, case.mod, "cuda", case.size, region)
    rows = []
    for rnd in range(1, rounds + 1):
        data.randomize()
        t0 = time.perf_counter()
        tms.pause(tag)
        t1 = time.perf_counter()
        tms.resume(tag)
        case.mod.synchronize()
        t2 = time.perf_counter()
        rows.append(round_row(variant, rnd, case.size, t1 - t0, t2 - t1, case.limits,
                              data.intact(), None))
    data.drop()
    del data
    case.mod.synchronize()
    case.mod.empty_cache()
    return rows


def torch_memory_saver_cpu(case, backends=("pinned", "mmap"),
                           rounds: int = 2) -> list[dict] | str:
    """torch_memory_saver's own CPU backups (torch hook mode) of the same bytes, one
    set of rounds per ``cpu_backup_backend``."""
    from .sleep_rounds import torch_mode

    own = _own(case)
    if isinstance(own, str):
        return own
    tms, version = own
    rows: list[dict] = []
    try:
        torch_mode(tms)  # once per process: the next size finds it initialized
        for backend in backends:
            tag = f"bench-{backend}"
            kwargs = {"enable_cpu_backup": True}
            if backend != "pinned":
                kwargs["cpu_backup_backend"] = backend
            try:
                region = tms.region(tag=tag, **kwargs)
            except TypeError:  # an older release without cpu_backup_backend
                continue
            rows += _own_rounds(case, tms, region, tag,
                                f"torch_memory_saver {version} ({backend} CPU backup)", rounds)
        return rows
    except Exception as exc:  # a third-party tool failing must not fail our bench
        return rows or f"failed: {type(exc).__name__}: {exc}"


def torch_memory_saver_disk(case, rounds: int = 2) -> list[dict] | str:
    """torch_memory_saver's own disk backup (torch hook mode) of the same bytes."""
    from .sleep_rounds import torch_mode

    own = _own(case)
    if isinstance(own, str):
        return own
    tms, _ = own
    try:
        torch_mode(tms)
        with _disk_dir() as path:
            tms.set_disk_backup_dir(path)
            region = tms.region(tag="bench-disk", enable_disk_backup=True)
            return _own_rounds(case, tms, region, "bench-disk", TMS_DISK, rounds)
    except Exception as exc:  # a third-party tool failing must not fail our bench
        return f"failed: {type(exc).__name__}: {exc}"


def tms_targets(rows: list[dict], gib: str, target_later: float) -> dict:
    """The torch_memory_saver rows' targets at one size (see the module docstring)."""
    out = {}
    retained = [r for r in rows if r["variant"] == TMS_COMPAT_RETAIN]
    if retained:
        sleep_pct = min(r["sleep_pct"] for r in retained)
        wake_pct = min(r["wake_pct"] for r in retained)
        out[f"{gib}, tms-compat retain, every round"] = {
            "sleep_pct": sleep_pct, "wake_pct": wake_pct, "target": target_later,
            "met": sleep_pct >= target_later and wake_pct >= target_later
            and all(r["bytes_restored"] for r in retained)}
    for ours, theirs, label in (
            (TMS_COMPAT, "(pinned CPU backup)", "tms-compat vs torch_memory_saver, defaults"),
            (TMS_COMPAT_DISK, TMS_DISK, "tms-compat disk vs torch_memory_saver disk")):
        mine = {r["round"]: r for r in rows if r["variant"] == ours}
        peer = {r["round"]: r for r in rows if r["variant"].startswith("torch_memory_saver")
                and r["variant"].endswith(theirs)}
        shared = sorted(set(mine) & set(peer))
        if not shared:
            continue
        speedup = min(peer[n]["sleep_s"] / mine[n]["sleep_s"] for n in shared)
        wake_ratio = max(mine[n]["wake_s"] / peer[n]["wake_s"] for n in shared)
        out[f"{gib}, {label}, every round"] = {
            "sleep_speedup": speedup, "wake_ratio": wake_ratio, "target": 1.0,
            "wake_target": 1.0, "met": speedup >= 1.0 and wake_ratio <= 1.0
            and all(mine[n]["bytes_restored"] for n in shared)}
    return out
