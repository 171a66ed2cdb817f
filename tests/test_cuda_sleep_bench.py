"""GPU suite for the sleep benchmark's rows through the engine integrations: skipped
without CUDA, failing under VMM_CORE_REQUIRE=cuda.

Each row makes its own tensors in its engine's region, sleeps and wakes them through the
engine's calls and checks every byte after every wake; afterwards its tags are closed,
so the next row (and the next size) starts from nothing.  The host backend runs the same
rows in tests/test_sleep_bench_host.py.

    VMM_CORE_REQUIRE=cuda python -m pytest tests/test_cuda_sleep_bench.py -q
"""

from __future__ import annotations

import pytest

import vmm_core
from vmm_bench import sleep as bench
from vmm_bench.sleep_tms import TMS_COMPAT, TMS_COMPAT_DISK, TMS_COMPAT_RETAIN

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_tags", "fresh_compat")]

MIB = 1 << 20


@pytest.mark.parametrize("peer, variant", [("tms-compat-retain", TMS_COMPAT_RETAIN),
                                           ("vllm-plugin", bench.VLLM_PLUGIN)])
def test_cuda_integration_rows_restore_every_byte_and_leave_nothing_behind(cuda, peer,
                                                                           variant):
    import torch

    size = 256 * MIB
    case = bench.Case(cuda, torch, torch.cuda, cuda.graph_ops(0).torch_device, size,
                      (50.0, 50.0), "unused", None)
    free_before = torch.cuda.mem_get_info()[0]
    rows = bench.PEERS[peer].run(case)
    assert [(r["variant"], r["round"]) for r in rows] == [(variant, n) for n in (1, 2, 3)]
    for r in rows:
        assert r["bytes_restored"], r
        # the region announced its offload: every round copies into its pinned copy
        assert r["strategy"] == "pinned" and r["copied_bytes"] == size, r
        assert r["host_bytes_held_awake"] == size and r["freed_bytes"] >= size, r
        assert r["sleep_pct"] is not None and r["sleep_pct"] > 0
    assert not [t for t in vmm_core.memory_summary() if t.startswith(("tms:", "vllm:"))]
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] >= free_before - 64 * MIB  # the tags' pages freed


def test_cuda_tms_rows_at_its_defaults_and_to_disk(cuda, tmp_path, monkeypatch):
    """torch_memory_saver's defaults: the host copy is made by every pause and given back
    by every resume; to disk: files while asleep, none after each wake; every byte back."""
    import os

    import torch

    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", str(tmp_path))
    size = 256 * MIB
    case = bench.Case(cuda, torch, torch.cuda, cuda.graph_ops(0).torch_device, size,
                      (50.0, 50.0), "unused", None)
    rows = bench.PEERS["tms-compat"].run(case) + bench.PEERS["tms-compat-disk"].run(case)
    assert [(r["variant"], r["round"]) for r in rows] == \
        [(TMS_COMPAT, n) for n in (1, 2, 3)] + [(TMS_COMPAT_DISK, n) for n in (1, 2)]
    for r in rows:
        assert r["bytes_restored"] and r["host_bytes_held_awake"] == 0, r
        assert r["freed_bytes"] >= size, r
    assert os.listdir(tmp_path) == []
