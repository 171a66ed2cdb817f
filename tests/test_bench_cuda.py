"""GPU: ``vmm-core bench`` end to end on CUDA with the Llama stack and a user factory.

Skipped without CUDA; fails instead under ``VMM_CORE_REQUIRE=cuda``.  Small size lists,
so each runs in well under a minute; the full 51-size runs are the benchmark itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vmm_bench import report

pytestmark = pytest.mark.gpu

MIB = 2**20


def bench(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vmm_core.cli", "bench", "--backend", "cuda",
                           *args], capture_output=True, text=True, timeout=400, cwd=cwd)


def _documented() -> str:
    return (Path(__file__).parent.parent / "docs" / "json-schema.md").read_text()


def test_cuda_bench_llama_records_growth_pools_and_the_executable_floor(cuda, tmp_path):
    pytest.importorskip("transformers")
    out_json, out_png = tmp_path / "llama.json", tmp_path / "llama.png"
    proc = bench("--model", "llama", "--sizes", "1,2,4,8,16,32", "--modes", "shared,vmm",
                 "--orders", "descending", "--json", str(out_json), "--plot", str(out_png))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == report.SCHEMA and doc["ok"] is True
    records = {r["strategy"]: r for r in doc["records"]}
    assert set(records) == {"alone", "shared", "vmm"}
    for r in records.values():
        assert "error" not in r and r["wrong_graphs"] == []
        assert len(r["growth_bytes"]) == r["graphs"] == len(r["capture_order"])
        assert r["growth_bytes"][-1] == r["graph_bytes"] > 0
        assert r["default_pool_bytes"] is not None and r["pool_bytes"] > 0
        per_graph = report.executable_bytes(r) / r["graphs"]
        assert -1 * MIB < per_graph < 8 * MIB, (r["strategy"], per_graph)
    assert records["vmm"]["pool_bytes"] == records["vmm"]["physical_bytes"]
    assert records["vmm"]["graph_bytes"] < records["shared"]["graph_bytes"] * 1.5
    documented = _documented()
    for key in set(doc) | {k for r in doc["records"] for k in r} | set(doc["summary"]):
        assert f"`{key}`" in documented, f"docs/json-schema.md does not document {key!r}"
    assert any(ln.startswith("llama: vmm holds ") for ln in proc.stdout.splitlines())
    assert "Outside every pool the graph executables hold" in proc.stdout
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_a_sleep_size_beyond_the_device_is_refused_before_any_work(cuda):
    proc = bench("--sleep-only", "--sleep-gib", "4,100000")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert "vmm-core: error: --sleep-gib 100000: more than the " in proc.stderr
    assert "of cuda device 0's memory" in proc.stderr


FACTORY = '''
import torch

def make(*, device, dtype, max_batch, seed):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(1000, 256, generator=gen).to(device, dtype)
    w = (torch.randn(256, 1024, generator=gen) / 16).to(device, dtype)
    ids = torch.randint(0, 1000, (max_batch, 4), generator=gen).to(device)
    def step(ids):
        h = table[ids].sum(1)
        return torch.relu(h @ w), ids + 1
    return step, ids
'''


def test_cuda_bench_runs_a_user_factory_with_integer_inputs(cuda, tmp_path):
    (tmp_path / "user_model.py").write_text(FACTORY)
    proc = bench("--model", "user_model:make", "--sizes", "1,2,4,8,16", "--modes", "vmm",
                 "--orders", "random", "--json", str(tmp_path / "u.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "u.json").read_text())
    assert doc["model"]["name"] == "user_model:make"
    assert [r["strategy"] for r in doc["records"]] == ["alone", "vmm"]
    assert all(r["wrong_graphs"] == [] for r in doc["records"])


def test_cuda_bench_stops_at_a_factory_that_fails_on_the_device(cuda, tmp_path):
    (tmp_path / "user_model.py").write_text("def make(device, max_batch):\n"
                                            "    raise RuntimeError('no weights here')\n")
    proc = bench("--model", "user_model:make", "--sizes", "1,2", "--modes", "vmm",
                 "--orders", "random", cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "vmm-core: error: --model 'user_model:make': the factory raised RuntimeError: no "
        "weights here")


SMALL_LLAMA = ("--layers", "1", "--hidden", "256", "--ffn", "512", "--heads", "4",
               "--kv-heads", "2", "--ctx", "8")


def test_cuda_engine_runner_scenarios_follow_their_peers_and_match_eager(cuda, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e.json"
    proc = bench("--model", "llama", *SMALL_LLAMA, "--sizes", "1,2,4,8,16",
                 "--scenario", "piecewise,whole,ondemand",
                 "--strategies", "vmm,vmm-keep,vllm,keep,sglang", "--orders", "ascending",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = {(s, r["strategy"]): r for s, d in doc["scenarios"].items() for r in d["records"]}
    assert ("piecewise", "sglang") not in rows  # SGLang's runner captures whole graphs
    assert {("ondemand", s) for s in ("alone", "vmm", "vmm-keep", "vllm", "sglang")} <= set(rows)
    for r in rows.values():
        assert r["wrong_graphs"] == [], r
        assert r["exec_bytes_per_graph"] is None or r["exec_bytes_per_graph"] >= 0
    # vLLM's discipline frees a size's intermediate outputs for the next size; keeping them
    # cannot take less memory in the same shared pool
    assert rows[("piecewise", "vllm")]["graph_bytes"] <= rows[("piecewise", "keep")]["graph_bytes"]
    assert "CUDAGraphWrapper" in doc["scenarios"]["piecewise"]["peers"]["vllm"]


def test_cuda_record_stream_scenario_shows_what_the_flag_saves(cuda, tmp_path):
    import torch

    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 9):
        pytest.skip("graph_capture_record_stream_reuse needs torch >= 2.9")
    out = tmp_path / "r.json"
    proc = bench("--scenario", "record-stream", "--layers", "4", "--sizes", "8",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["scenarios"]
            ["record-stream"]["records"]}
    assert all(r["wrong_graphs"] == [] for r in rows.values()), rows
    # four 64 MiB temporaries held to the capture's end without the flag, about one with it
    assert rows["vmm-on"]["largest_space_bytes"] < rows["vmm-off"]["largest_space_bytes"]
    assert rows["torch-on"]["graph_bytes"] < rows["torch-off"]["graph_bytes"]


def test_cuda_executables_policies_run_the_trace_sleep_and_wake(cuda, tmp_path):
    """--executables on a GPU: the budget misses, sleep releases what the pool owns, the
    wake makes it again on first replay without a recapture, every result matches eager,
    and every key written is documented."""
    pytest.importorskip("transformers")
    out = tmp_path / "x.json"
    proc = bench("--model", "llama", *SMALL_LLAMA, "--sizes", "1,2,4,8,16",
                 "--scenario", "piecewise", "--strategies", "vmm,vllm", "--orders", "random",
                 "--executables", "all,budget:34%+share", "--trace-steps", "40",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())["scenarios"]["piecewise"]
    rows = {(r["strategy"], r["executables"]): r for r in doc["records"]}
    assert set(rows) == {("alone", "framework"), ("vllm", "framework"), ("vmm", "all"),
                         ("vmm", "budget:34%+share")}
    for r in rows.values():
        assert r["wrong_graphs"] == [], r
    every, budget = rows[("vmm", "all")], rows[("vmm", "budget:34%+share")]
    assert every["trace_misses"] == 0 and every["exec_resident"] == every["exec_graphs"]
    assert budget["trace_misses"] > 0 and budget["exec_resident"] < budget["exec_graphs"]
    for r in (every, budget):
        assert r["sleep_released"] == r["exec_resident"] > 0
        assert r["wake_recaptures"] == 0
        assert all(w["instantiations"] + w["updates"] > 0 for w in r["wake_replays"])
    assert rows[("vllm", "framework")]["exec_resident"] is None
    served = {(r["strategy"], r["executables"]): r for r in doc["executables"]}
    assert served[("vmm", "budget:34%+share")]["reference"] == "vllm random"
    assert served[("vmm", "all")]["step_mean_x_all"] == 1.0
    assert "vmm budget:34%+share random: graph memory after the trace" in proc.stdout
    documented = _documented()
    keys = {k for r in doc["records"] for k in r} | {k for r in doc["executables"] for k in r}
    for key in keys:
        assert f"`{key}`" in documented, f"docs/json-schema.md does not document {key!r}"
