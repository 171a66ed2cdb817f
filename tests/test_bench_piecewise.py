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
         "outside_pool_bytes": (graph_mib - pool_mib) * MiB, "capture_s": 1.0,
         "step_us": 100.0, "wrong": [], "device": "dev", "torch": "t",
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
    piecewise.print_piecewise_table(rows)
    out = capsys.readouterr().out
    assert "sglang   ascending   FAILED" in out
    assert "1.000x the largest space" in out
    # 51 MiB outside the pool over 255 graphs = 205 KiB per graph, measured on vmm
    assert "205 KiB per graph" in out
    vmm_line = next(line for line in out.splitlines() if line.startswith("vmm "))
    assert " 1.50 " in vmm_line  # 151 / 101 MiB against the largest size alone
