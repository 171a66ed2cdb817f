"""The rounds every row of the sleep benchmark runs, and the bytes they move: a row's
record (:func:`round_row`), the bytes of one size on a device (:class:`DeviceBytes`) or on
the host backend (:class:`HostBytes`), one size as a peer's rounds see it
(:class:`Case`), and the rounds of an engine's own sleep and wake calls
(:func:`engine_rounds`).  :mod:`.sleep` and :mod:`.sleep_tms` build their rows on it."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

__all__ = ["GIB", "gib_s", "round_row", "DeviceBytes", "HostBytes", "HostModule", "Case",
           "engine_rounds", "transfers", "strategies", "torch_mode"]

GIB = 2**30


def gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / GIB / seconds if seconds > 0 else float("inf")


class DeviceBytes:
    """``size`` bytes as 1 GiB tensors under one tag, plus device references."""

    def __init__(self, torch, mod, device, size: int, region) -> None:
        self.torch, self.mod, self.size = torch, mod, size
        n = max(1, round(size / GIB))
        parts = [size // n] * n
        with region:
            self.tensors = [torch.empty(p, dtype=torch.uint8, device=device) for p in parts]
        self.refs = [torch.empty_like(t) for t in self.tensors]

    def randomize(self) -> None:
        for t, r in zip(self.tensors, self.refs):
            t.random_(0, 256)
            r.copy_(t)
        self.mod.synchronize()

    def intact(self) -> bool:
        return all(bool(self.torch.equal(t, r)) for t, r in zip(self.tensors, self.refs))

    def drop(self) -> None:
        self.tensors, self.refs = [], []


def round_row(variant: str, rnd: int, size: int, sleep_s: float, wake_s: float, limits,
              ok: bool, host_awake, **extra) -> dict:
    """One round's row; ``limits`` is the device's pinned copy rate each way (the rates
    are then also given as shares of it), or None on the host (no device to judge)."""
    row = {"variant": variant, "round": rnd, "bytes": size, "sleep_s": sleep_s,
           "wake_s": wake_s, "sleep_gib_s": gib_s(size, sleep_s),
           "wake_gib_s": gib_s(size, wake_s), "bytes_restored": ok,
           "host_bytes_held_awake": host_awake}
    row["sleep_pct"] = row["sleep_gib_s"] / limits[0] if limits else None
    row["wake_pct"] = row["wake_gib_s"] / limits[1] if limits else None
    row.update(extra)
    # printed as measured, so that a run stopped by a time limit still shows its rows
    between = extra.get("between_pin_s")

    def rate(kind: str) -> str:
        pct = row[f"{kind}_pct"]
        return f"{pct:.0%}" if pct is not None else f"{row[f'{kind}_gib_s']:.1f} GiB/s"

    print(f"  measured {size / GIB:g} GiB, {variant}, round {rnd}: sleep "
          f"{sleep_s * 1e3:.1f} ms ({rate('sleep')}), wake {wake_s * 1e3:.1f} ms "
          f"({rate('wake')}), bytes restored {ok}"
          + ("" if between is None else
             f"; the registration ended {between * 1e3:.1f} ms after the sleep"),
          flush=True)
    return row


@dataclasses.dataclass


class Case:
    """One size of the sleep benchmark, as a peer's rounds see it."""

    backend: Any
    torch: Any
    mod: Any         # torch.cuda, torch.npu, torch.mlu; None without device graphs
    device: Any      # the torch device
    size: int        # bytes offloaded
    #: the pinned copy limit each way, GiB/s; None on the host backend (nothing to judge)
    limits: tuple[float, float] | None
    tag: str         # vmm_core's bytes (awake until the peers with own_bytes run)
    data: Any        # those bytes (DeviceBytes, or HostBytes on the host backend)

    @property
    def device_type(self) -> str:
        return getattr(self.backend.graph_ops(0), "device_type", "")

    def own_bytes(self, region) -> Any:
        """``size`` random-ready bytes made inside ``region`` (a peer's own block, entered
        here): device tensors, or on a backend without device graphs (the host backend),
        where no framework allocator is routed, bytes of the allocator the block yields."""
        if self.mod is None:
            with region as alloc:
                return HostBytes(self.torch, alloc, self.size)
        return DeviceBytes(self.torch, self.mod, self.device, self.size, region)


def torch_mode(tms) -> None:
    """Put torch_memory_saver in its torch hook mode (a pluggable-allocator MemPool per
    tag; no LD_PRELOAD).  Its ``hook_mode`` setter refuses once the tool is initialized
    (0.0.10: ``del self._impl_ctor_kwargs`` at the first region, then an AttributeError),
    so it is set only before that, and a tool already running in another mode is refused
    with the reason."""
    impl = getattr(tms, "_impl", None)
    if impl is None:
        tms.hook_mode = "torch"
        return
    mode = getattr(impl, "_hook_mode", "torch")
    if mode != "torch":
        raise RuntimeError(f"torch_memory_saver was initialized in hook mode {mode!r}; "
                           f"the comparison needs 'torch' (set before its first region)")


def engine_rounds(case: Case, variant: str, region, tags: Callable[[], list[str]],
                   sleep: Callable[[], None], wake: Callable[[], None],
                   rounds: int) -> list[dict]:
    """Rounds of an engine's own sleep and wake calls over ``size`` bytes it made in
    ``region``, every byte checked after every wake.

    The region announced its offload, so its pinned host copy is made in the background
    when the block ends; round 1 starts once it is (untimed, as at model load: an
    engine loads, captures and serves before its first sleep).  The engines synchronize
    after their calls (SGLang's release and vLLM's worker do), and so do these rounds.
    Host memory awake is what ``tags()`` hold.  The tags are closed afterwards, so the
    next row and the next size start from nothing."""
    import vmm_core
    from vmm_core import offload

    data = case.own_bytes(region)
    offload.wait_for_prepared(60)
    rows = []
    try:
        for rnd in range(1, rounds + 1):
            data.randomize()
            free0 = data.mod.mem_get_info()[0]
            t0 = time.perf_counter()
            sleep()
            data.mod.synchronize()
            t1 = time.perf_counter()
            freed = data.mod.mem_get_info()[0] - free0
            saved = transfers(tags())
            wake()
            data.mod.synchronize()
            t2 = time.perf_counter()
            restored = transfers(tags())
            summary = vmm_core.memory_summary()
            held = sum(summary[t]["host_bytes"] for t in tags() if t in summary)
            rows.append(round_row(variant, rnd, data.size, t1 - t0, t2 - t1, case.limits,
                                  data.intact(), held, freed_bytes=freed,
                                  strategy=strategies(saved),
                                  wake_strategy=strategies(restored),
                                  sleep_copy_s=sum(t.seconds for t in saved),
                                  copied_bytes=sum(t.nbytes for t in saved),
                                  wake_pin_wait_s=sum(t.pin_wait_seconds for t in restored)))
    finally:
        chosen = tags()
        data.drop()
        data.mod.synchronize()
        for tag in chosen:
            for alloc in vmm_core.allocators(tag):
                alloc.close()
        getattr(data.mod, "empty_cache", lambda: None)()
    return rows


def transfers(tags: list[str]) -> list:
    """The last transfer of each allocator of ``tags`` (the copy a sleep or wake made)."""
    import vmm_core

    return [a.last_transfer for t in tags for a in vmm_core.allocators(t)
            if a.last_transfer is not None]


def strategies(transfers: list) -> str:
    """How the transfers moved their bytes (``offload.choose_strategy``'s names)."""
    return ",".join(sorted({t.strategy for t in transfers}))


class HostModule:
    """What ``_ours`` reads from ``torch.cuda`` on the host backend: nothing to
    synchronize, and "free memory" that grows by what the tag's allocator releases."""

    TOTAL = 1 << 62

    def __init__(self, alloc) -> None:
        self._alloc = alloc

    def synchronize(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return self.TOTAL - self._alloc.physical_bytes, self.TOTAL


class HostBytes:
    """vmm_core's bytes on a backend without device graphs (framework tensors cannot be
    routed into a region there): ``size`` bytes allocated from the tag's allocator
    itself, written and read back only through the backend's copy hooks."""

    def __init__(self, torch, alloc, size: int) -> None:
        self.torch, self.size = torch, size
        self.mod = HostModule(alloc)
        self._alloc = alloc
        self._address = alloc.allocate(size)
        self._ref = torch.empty(size, dtype=torch.uint8)

    def randomize(self) -> None:
        self._ref.random_(0, 256)
        self._alloc.backend.copy_from_host(self._alloc.device, self._ref.data_ptr(),
                                           self._address, self.size)

    def intact(self) -> bool:
        back = self.torch.empty(self.size, dtype=self.torch.uint8)
        self._alloc.backend.copy_to_host(self._alloc.device, self._address, back.data_ptr(),
                                         self.size)
        return bool(self.torch.equal(back, self._ref))

    def drop(self) -> None:
        self._alloc.deallocate(self._address)
