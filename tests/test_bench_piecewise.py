"""The piecewise/families benchmark's plumbing on the CPU (the runs need a GPU)."""

from __future__ import annotations

import types

import pytest

from vmm_core.bench import piecewise


def _args(**kw):
    base = dict(scenario="piecewise", strategies="vmm,vllm", orders="ascending,random")
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_specs_cover_alone_every_strategy_and_order():
    assert piecewise._specs(_args()) == [
        "piecewise:alone:ascending", "piecewise:vmm:ascending", "piecewise:vmm:random",
        "piecewise:vllm:ascending", "piecewise:vllm:random"]
    assert piecewise._specs(_args(scenario="record-stream")) == [
        "record-stream:off:ascending", "record-stream:on:ascending"]
    with pytest.raises(ValueError, match="unknown scenario"):
        piecewise._specs(_args(scenario="pipeline"))
    with pytest.raises(ValueError, match="unknown strategies"):
        piecewise._specs(_args(strategies="vmm,magic"))


def _record(strategy, order, graphs, graph_mib, pool_mib, **kw):
    MiB = 1 << 20
    r = {"scenario": "piecewise", "strategy": strategy, "order": order, "graphs": graphs,
         "graph_bytes": graph_mib * MiB, "pool_bytes": pool_mib * MiB,
         "default_pool_bytes": 0, "capture_s": 1.0, "replay_us": 100.0,
         "wrong_graphs": [], "worst_rel_err": 1e-3, "growth_bytes": [graph_mib * MiB],
         "physical_bytes": pool_mib * MiB, "largest_space_bytes": pool_mib * MiB,
         "handles": 1}
    r.update(kw)
    return r


def test_table_reports_ratios_against_alone_and_the_executable_floor(capsys):
    rows = [_record("alone", "ascending", 5, 101, 100),
            _record("vmm", "ascending", 255, 151, 100),
            _record("vllm", "ascending", 255, 400, 398),
            {"scenario": "piecewise", "strategy": "sglang", "order": "ascending",
             "error": "boom"}]
    piecewise.print_scenario("piecewise", rows, "dev", "t", "a llama")
    out = capsys.readouterr().out
    assert "sglang" in out and "FAILED: boom" in out
    assert "1.000x the largest space" in out
    # executables: 51 MiB over 255 graphs = 0.2 MiB per graph, measured on vmm; the target
    # is 101 MiB alone + 250 more graphs at 0.2 MiB = 151 MiB: ratio 1.000
    assert "= 1.000" in out
    vmm_line = next(line for line in out.splitlines() if line.startswith("vmm "))
    assert " 1.50 " in vmm_line  # 151 / 101 MiB against the largest size alone


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_engine_shaped_runners_over_graph_pool_match_eager_on_the_host(order):
    """The runners' logic (keys, keep, replay around eager attention) on the host
    backend, where a replay rewrites the captured outputs as a device graph does."""
    pytest.importorskip("transformers")
    import torch

    import vmm_core
    from vmm_core.bench.models import LlamaStack

    host = vmm_core.get_backend("host")
    model = LlamaStack(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, ctx=8,
                       max_batch=16, dtype=torch.float32, device="cpu")
    pool = vmm_core.GraphPool(backend=host, reads=())
    pieces = piecewise.PiecewiseRunner(model, pool, [4, 16])
    full = piecewise.FullRunner(model, vmm_core.GraphPool(backend=host, reads=(),
                                                          allocator=pool.allocator), [4, 16])
    for size in sorted([4, 16], reverse=order == "descending"):
        pieces.capture(size), full.capture(size)
    assert pieces.num_graphs == 2 * model.num_pieces and full.num_graphs == 2
    assert set(pool.keys) == {("piecewise", 4), ("piecewise", 16)}
    for n in (3, 16, 1, 9):
        x = torch.randn(n, 64)
        torch.testing.assert_close(pieces(x), model(x))
        torch.testing.assert_close(full(x), model(x))
    with pytest.raises(ValueError, match="exceeds the largest"):
        pieces(torch.randn(17, 64))
