"""GPU: ``vmm-core bench`` end to end on CUDA with the Llama stack and a user factory.

Skipped without CUDA; fails instead under ``VMM_CORE_REQUIRE=cuda``.  Small size lists,
so each runs in well under a minute; the full 51-size runs are the benchmark itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vmm_core.bench import report

pytestmark = pytest.mark.gpu

MIB = 2**20


def bench(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vmm_core.cli", "bench", "--backend", "cuda",
                           *args], capture_output=True, text=True, timeout=400, cwd=cwd)


def _documented() -> str:
    text = (Path(__file__).parent.parent / "README.md").read_text()
    return re.search(r"### JSON schema\n(.*?)\n##+ ", text, re.S).group(1)


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
        assert f"`{key}`" in documented, f"README's JSON schema does not document {key!r}"
    assert any(ln.startswith("llama: vmm holds ") for ln in proc.stdout.splitlines())
    assert "Outside every pool the graph executables hold" in proc.stdout
    assert out_png.read_bytes()[:4] == b"\x89PNG"


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
