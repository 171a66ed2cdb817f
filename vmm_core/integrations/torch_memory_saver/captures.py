"""``cuda_graph``'s captures: one ``GraphPool(reuse="single")`` per (tag, torch pool
handle, backend, device), as torch gives captures passing one ``pool=`` one pool and a
capture without it a private one.

While a capture with the caller's ``pool=P`` runs in vmm_core's space, the backend's
adapter makes torch's routing calls that name ``P`` name that space
(``AllocatorAdapter.alias_pool``): SGLang stops and restarts allocation to its pool in
the middle of a capture (its symmetric-memory allocator), and those calls then reach the
pool the capture records to instead of failing on one nobody records to.
"""

from __future__ import annotations

import contextlib
import weakref

from ...errors import CaptureError
from . import state

__all__ = ["capture", "close_unused_private_pools"]


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return None  # not weakly referenceable: its pool stays until the process ends


@contextlib.contextmanager
def capture(cuda_graph, backend, device: int, vtag: str, pool, stream, capture_error_mode,
            auto_dispatch_capture: bool):
    from ...graphs.pool import GraphPool

    if not isinstance(auto_dispatch_capture, bool):
        raise ValueError(f"auto_dispatch_capture must be True or False, got "
                         f"{auto_dispatch_capture!r}")
    options = {}
    if auto_dispatch_capture:
        ops = backend.graph_ops(device)
        if "auto_dispatch_capture" not in getattr(ops, "capture_options", ()):
            raise CaptureError(
                f"cuda_graph(auto_dispatch_capture=True) is torch_npu's capture option "
                f"(torch.npu.graph records the dispatch of operators NPUGraph.update "
                f"changes later); the {backend.name!r} backend's capture has no such "
                f"option: leave it False there")
        options["auto_dispatch_capture"] = True
    close_unused_private_pools()
    with state.lock():
        key = (vtag, pool if pool is not None else ("private", next(state.private_keys)),
               backend.name, device)
        graph_pool = state.graph_pools.get(key)
        if graph_pool is None:
            graph_pool = state.graph_pools[key] = GraphPool(
                device, backend=backend, tag=vtag, reuse="single")
            if pool is None:
                state.private.append((_weak(cuda_graph), key))
    adapter = backend.allocator_adapter(device)
    with graph_pool.space("capture") as handle:  # type: ignore[attr-defined]
        alias = adapter.alias_pool(pool, handle) if pool is not None and adapter is not None \
            else contextlib.nullcontext()
        with alias, graph_pool.ops.capture_context(  # type: ignore[attr-defined]
                cuda_graph, handle, stream=stream, capture_error_mode=capture_error_mode,
                options=options or None):
            yield handle


def close_unused_private_pools() -> None:
    """Close the pools of dropped private captures that hold nothing alive (torch frees
    a private pool with its graph).  One whose outputs are still alive stays."""
    with state.lock():
        for item in list(state.private):
            ref, key = item
            if ref is None or ref() is not None:
                continue
            pool = state.graph_pools.get(key)
            alloc = pool.allocator if pool is not None else None  # type: ignore[attr-defined]
            if pool is None or alloc is None or alloc.closed:
                state.private.remove(item)
                state.graph_pools.pop(key, None)
                continue
            try:
                alive = alloc.asleep or bool(alloc.live_ranges and alloc.live_ranges())
            except Exception:  # noqa: BLE001 - a pool we cannot read is kept, not closed
                alive = True
            if alive:
                continue  # outputs still alive (or paused): checked again later
            state.private.remove(item)
            state.graph_pools.pop(key, None)
            pool.close()  # type: ignore[attr-defined]
