"""``vmm-core bench --scenario rl``: its plumbing on the CPU, and the loop itself on a GPU.

The GPU test runs the RL loop for 3 steps with every correctness check (skipped without
CUDA, failing under VMM_CORE_REQUIRE=cuda)."""

from __future__ import annotations

import types

import pytest

from vmm_core.bench import rl
from vmm_core.bench.spec import BenchSpec, Output, RLSpec
from vmm_core.cli import main

pytestmark = pytest.mark.usefixtures("clean_tags")


def test_on_the_host_rl_says_in_one_line_that_it_needs_a_device(capsys):
    assert main(["bench", "--scenario", "rl", "--sizes", "1,2", "--orders", "ascending",
                 "--quiet"]) == 0  # like every device-only scenario: the allocator one runs
    out = capsys.readouterr().out.splitlines()
    notes = [line for line in out if "--scenario rl" in line]
    assert len(notes) == 1 and "this backend has none" in notes[0], out


def test_rl_runs_on_its_own():
    assert main(["bench", "--scenario", "rl,piecewise", "--sizes", "1,2"]) == 2


def test_rl_refuses_a_model_that_is_not_a_llama():
    from vmm_core.bench.workload import llama_model
    from vmm_core.errors import BenchModelError

    with pytest.raises(BenchModelError, match="--model llama"):
        llama_model("mlp", "rl")
    assert llama_model(None, "rl") == "llama"


class _HostEngine(rl._Engine):
    """The loop's graphs on the host backend (its graph ops replay as a device would)."""

    def new_pool(self):
        import vmm_core

        return vmm_core.GraphPool(backend=self.backend, reads=())


def test_the_loop_captures_once_checks_every_size_and_counts_recaptures():
    pytest.importorskip("transformers")
    import torch

    import vmm_core
    from vmm_core.bench.models import LlamaStack

    host = vmm_core.get_backend("host")
    stack = LlamaStack(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, ctx=8,
                       max_batch=16, dtype=torch.float32, device="cpu")
    model = types.SimpleNamespace(stack=stack)
    engine = _HostEngine(torch, host, "cpu")
    # non-owning views need a device pool (on a CPU freed memory goes back to malloc):
    # here the runner keeps every output it captured, declared with keep()
    loop = rl._Loop(torch, engine, model, [4, 16], discipline="sglang")
    assert loop.runner.captured == 2 * stack.num_pieces
    worst, wrong = loop.check(0)
    assert wrong == [] and worst < 1e-5
    with torch.no_grad():  # new weights in place: the same graphs read them
        for p in stack.layers[0].parameters():
            p.mul_(-1.5)
    worst, wrong = loop.check(1)
    assert wrong == []
    before = loop.runner.captured
    loop.check(2)
    assert loop.runner.captured == before  # replays never capture
    loop.drop_graphs()
    assert loop.runner is None and loop.pool is None
    assert loop.capture_all() == 2 * stack.num_pieces  # what the recapture strategy pays
    assert loop.check(3)[1] == []


def test_the_vmm_engine_sleeps_and_counts_its_own_tags_only():
    """An engine owns weights, kv and graph; other memory of the process (on the GPU
    suite, tags earlier tests left) is not its to discard, nor its host memory."""
    import ctypes

    import torch

    import vmm_core
    from vmm_core.memory import offload, tagged

    host = vmm_core.get_backend("host")
    engine = rl._Vmm(torch, host, "cpu")
    for tag in engine.tags + ["someone-else"]:
        with vmm_core.region(tag, backend=host) as alloc:
            ctypes.memset(alloc.allocate(1 << 20), 0x5A, 1 << 20)
    other = tagged.allocators("someone-else")[0]
    other.sleep(offload=True)  # holds a host copy the engine must not count
    other.wake(keep_host_buffers=True)
    engine.sleep(None)
    summary = vmm_core.memory_summary()
    assert all(summary[t]["asleep"] for t in engine.tags)
    assert not summary["someone-else"]["asleep"]
    engine.wake(None)
    assert not any(s["asleep"] for s in vmm_core.memory_summary().values())
    weights = vmm_core.memory_summary()["weights"]
    assert engine.host_bytes_awake(None) == weights["host_bytes"] + offload.staging_bytes()
    assert engine.offloaded_bytes(None) == weights["device_bytes"] > 0
    assert set(engine.tag_summary()) == set(engine.tags)  # "someone-else" is not its own
    assert engine.tag_summary()["weights"]["host_bytes"] == weights["host_bytes"]


def _steps(freed, sleep, wake, first, recaptured=0):
    return [{"step": i + 1, "freed_bytes": f, "sleep_s": s, "wake_s": w,
             "first_replay_s": r, "first_replay_ok": True, "host_bytes_awake": 1 << 30,
             "recaptured_graphs": recaptured, "train_bytes": 0, "train_ok": True,
             "worst_rel_err": 1e-3, "wrong_sizes": [], "step_s": s + w + r}
            for i, (f, s, w, r) in enumerate(zip(freed, sleep, wake, first))]


def test_the_parent_prints_and_saves_each_strategy_as_its_child_ends(monkeypatch, capsys,
                                                                     tmp_path):
    """A run cut by the time limit keeps what finished: rows on stdout and the JSON
    after every child, the slow recapture variant last."""
    import json

    gib = 1 << 30
    calls = []

    def child(configs, on_record, **kwargs):
        records = []
        for identity, argv in configs:
            calls.append(identity["strategy"])
            if identity["strategy"] == "vllm":
                record = {**identity, "error": "child exited 1: boom"}
            else:
                record = {**identity, "weight_bytes": gib, "kv_bytes": gib,
                          "offloaded_bytes": gib, "wrong_before_sleep": [],
                          "model_description": "a llama", "device": "dev", "torch": "t",
                          "pinned_limit_gib_s": [50.0, 50.0],
                          "steps": _steps([2 * gib] * 2, [0.1] * 2, [0.1] * 2, [0.01] * 2)}
            records.append(record)
            on_record(record)
            saved = json.loads(path.read_text())  # on disk as each child ends
            assert saved["partial"] and saved["records"] == records
        return records

    monkeypatch.setattr(rl, "run_configurations", child)
    path = tmp_path / "rl.json"
    spec = BenchSpec(sizes=(1, 2), rl=RLSpec(steps=2), output=Output(json=str(path), quiet=True))
    result = rl.run_rl_bench(spec, types.SimpleNamespace(name="cuda"))
    assert calls[0] == "vmm" and calls[-1] == "recapture"
    out = capsys.readouterr().out
    assert out.index("measured  vmm ") < out.index("measured  vllm       FAILED: child "
                                                   "exited 1: boom")
    saved = json.loads(path.read_text())
    assert saved["partial"] and [r["strategy"] for r in saved["records"]] == calls
    assert not result["ok"] and result["summary"]["vmm"]["correct"]


def test_summary_separates_round_one_from_later_rounds(capsys, tmp_path):
    gib = 1 << 30
    vmm = {"strategy": "vmm", "weight_bytes": 4 * gib, "kv_bytes": gib,
           "wrong_before_sleep": [], "model_description": "a llama", "device": "dev",
           "torch": "t", "pinned_limit_gib_s": [50.0, 50.0],
           "steps": _steps([6 * gib] * 3, [0.4, 0.1, 0.1], [0.2, 0.1, 0.1], [0.01] * 3)}
    again = {**vmm, "strategy": "recapture",
             "steps": _steps([6 * gib] * 3, [1.0] * 3, [1.0] * 3, [15.0] * 3, 100)}
    again["steps"][2]["wrong_sizes"] = [[8, 0.5]]
    failed = {"strategy": "tms", "error": "boom"}
    summary = rl._summarize([vmm, again, failed], (50.0, 50.0))
    assert summary["vmm"]["round 1"]["sleep_s"] == pytest.approx(0.4)
    assert summary["vmm"]["rounds 2..N"]["sleep_s"] == pytest.approx(0.1)
    # 4 GiB in 0.1 s = 40 GiB/s = 80% of a 50 GiB/s limit
    assert summary["vmm"]["rounds 2..N"]["sleep_pct_of_limit"] == pytest.approx(0.8)
    assert summary["vmm"]["correct"] and not summary["recapture"]["correct"]
    assert summary["recapture"]["rounds 2..N"]["recaptured_graphs"] == 100
    assert "error" in summary["tms"]
    rl._print([vmm, again, failed], summary, vmm, (50.0, 50.0))
    out = capsys.readouterr().out
    assert "tms        FAILED: boom" in out
    assert "(weights at 80% / 80% of the limit)" in out
    assert "recapture  every replay correct: False" in out
    pytest.importorskip("matplotlib")
    path = tmp_path / "rl.png"
    assert rl._plot([vmm, again, failed], str(path), "title")
    assert path.stat().st_size > 0


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["vmm", "recapture"])
def test_cuda_rl_loop_three_steps_every_replay_correct(cuda, strategy):
    """Sleep frees weights, kv and (vmm) graph memory, a training allocation takes it,
    wake and an in-place weight update, and every size replays correctly.

    Each strategy runs in a child process, as the benchmark runs it: in one process, a
    strategy's cuBLAS workspace may live in tagged memory that the next test's cleanup
    closes (found on the H100; docs/failures.md, library workspaces)."""
    pytest.importorskip("transformers")
    from vmm_core.bench.children import run_configurations

    spec = rl.small_spec(steps=3)
    [record] = run_configurations(
        [({"scenario": "rl", "strategy": strategy},
          rl._child_argv(spec, cuda.name, strategy))], quiet=True)
    assert "error" not in record, record.get("error")
    assert record["wrong_before_sleep"] == []
    assert len(record["steps"]) == 3
    for step in record["steps"]:
        assert step["first_replay_ok"] and step["wrong_sizes"] == [], step
        assert step["train_ok"] and step["freed_bytes"] >= record["weight_bytes"]
        if strategy == "vmm":
            assert step["recaptured_graphs"] == 0
        else:
            assert step["recaptured_graphs"] == record["graphs"]
    if strategy == "vmm":  # held while awake: the offloaded weights, pinned, and the ring
        last = record["steps"][-1]
        tags = last["tags_awake"]
        assert set(tags) == {"weights", "kv", "graph"}
        assert last["host_bytes_awake"] == tags["weights"]["device_bytes"] \
            + record["staging_bytes"]
        assert tags["weights"]["pinned_host_bytes"] == tags["weights"]["device_bytes"]
        assert tags["kv"]["host_bytes"] == tags["graph"]["host_bytes"] == 0


def test_a_failed_group_rank_logs_its_error_before_destroying_its_group(monkeypatch, capsys):
    """The group's shutdown waits for the rank's unfinished collectives (NCCL finalizes its
    communicators), so the error must reach the log first; the group is destroyed after,
    and a one-rank gloo group on the host is enough to see the order."""
    import torch.distributed as dist

    import vmm_core

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []

    def fail(spec, device):
        assert dist.is_initialized()
        raise RuntimeError("rank failed mid-step")

    real_destroy = dist.destroy_process_group

    def destroy(*a, **k):
        seen.append(capsys.readouterr().err)
        real_destroy(*a, **k)

    monkeypatch.setattr(rl, "_rl_group_rank", fail)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    with pytest.raises(RuntimeError, match="mid-step"):
        rl.run_rl_group(BenchSpec(sizes=(1, 2)), vmm_core.get_backend("host"))
    assert len(seen) == 1 and "RuntimeError: rank failed mid-step" in seen[0]
    assert not dist.is_initialized()
