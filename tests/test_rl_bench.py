"""``vmm-core bench --scenario rl``: its plumbing on the CPU, and the loop itself on a GPU.

The GPU test runs the RL loop for 3 steps with every correctness check (skipped without
CUDA, failing under VMM_CORE_REQUIRE=cuda)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from vmm_bench import rl, rl_group, rl_report, rl_strategies
from vmm_bench.spec import BenchSpec, Output, RLSpec
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
    from vmm_bench.errors import BenchModelError
    from vmm_bench.workload import llama_model

    with pytest.raises(BenchModelError, match="--model llama"):
        llama_model("mlp", "rl")
    assert llama_model(None, "rl") == "llama"


class _HostEngine(rl_strategies._Engine):
    """The loop's graphs on the host backend (its graph ops replay as a device would)."""

    def new_pool(self):
        import vmm_core

        return vmm_core.GraphPool(backend=self.backend, reads=())


def test_the_loop_captures_once_checks_every_size_and_counts_recaptures():
    pytest.importorskip("transformers")
    import torch

    import vmm_core
    from vmm_bench.models import LlamaStack

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
    engine = rl_strategies._Vmm(torch, host, "cpu")
    for tag in engine.tags + ["someone-else"]:
        with vmm_core.region(tag, backend=host) as alloc:
            ctypes.memset(alloc.allocate(1 << 20), 0x5A, 1 << 20)
            alloc.deallocate(alloc.allocate(2 << 20))  # a free block: held, never copied
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
    # what the sleep copied: the live weights, not the free block the tag also holds
    assert engine.offloaded_bytes(None) == 1 << 20 < weights["device_bytes"]
    assert set(engine.tag_summary()) == set(engine.tags)  # "someone-else" is not its own
    assert engine.tag_summary()["weights"]["host_bytes"] == weights["host_bytes"]


def _random_bytes(alloc, nbytes: int, seed: int) -> tuple[int, bytes]:
    import ctypes
    import random

    data = random.Random(seed).randbytes(nbytes)
    address = alloc.allocate(nbytes)
    ctypes.memmove(address, data, nbytes)
    return address, data


def _spy(monkeypatch, obj, name: str, calls: list) -> None:
    """Record each call of ``obj.name`` as ``(name, *args)``, or ``(name, kwargs)`` when
    made with keywords, and make it."""
    real = getattr(obj, name)

    def call(*args, **kwargs):
        calls.append((name, kwargs) if kwargs else (name, *args))
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, call)


@pytest.mark.usefixtures("fresh_compat")
@pytest.mark.parametrize("name", ["vmm", "vllm", "recapture", "tms-compat", "vllm-plugin",
                                  "vllm-graphs", "vllm-plugin-graphs"])
def test_every_engines_pool_gives_the_runner_what_it_calls(name):
    """The loop's runner (PiecewiseRunner) makes its graphs with ``pool.new_graph()``,
    captures in ``pool.space(key)`` through ``pool.ops`` and replays inside
    ``pool.replaying(key)``: every engine's pool must answer all of them (the Llama loop
    itself needs the bench extra, which CI does not install)."""
    import torch

    import vmm_core

    host = vmm_core.get_backend("host")
    engine = rl_strategies.STRATEGIES[name].engine(torch, host, "cpu")
    pool = engine.new_pool()
    graph = pool.new_graph()
    x = torch.randn(4)
    with pool.space(1) as handle:
        out = pool.ops.capture(graph, lambda: x * 2, handle)
    torch.testing.assert_close(out, x * 2)
    if name != "tms-compat":  # captured as a block on the host: nothing a replay can rerun
        x.copy_(torch.randn(4))
        with pool.replaying(1):
            graph.replay()
        torch.testing.assert_close(out, x * 2)
    if name in ("vllm", "recapture"):  # a peer replays the framework's own executables
        assert not pool.stats().get("executables")
    close = getattr(pool, "close", None)
    if close is not None:
        close()


@pytest.mark.usefixtures("fresh_compat")
@pytest.mark.parametrize("name", ["tms-compat", "vllm-plugin"])
def test_an_integration_engine_offloads_its_live_weights_and_wakes_them_byte_for_byte(
        name):
    """The rows through the integrations, on the host backend for real: the weights come
    back byte for byte at the same address every step, only their live bytes are copied
    (a free block of the region is not), the KV cache is discarded, host memory awake is
    the staging ring plus the kept copy (vLLM's; torch_memory_saver's default gives it
    back), and memory of the process that is not the engine's is left alone."""
    import ctypes

    import torch

    import vmm_core
    from vmm_core.memory import offload

    host = vmm_core.get_backend("host")
    engine = rl_strategies.STRATEGIES[name].engine(torch, host, "cpu")
    assert engine.uses_offload
    with engine.weights_region() as w:
        weights, expected = _random_bytes(w, 3 << 20, seed=1)
        w.deallocate(w.allocate(1 << 20))  # a free block: held, never copied
    with engine.kv_region() as kv:
        kv.allocate(2 << 20)
    with vmm_core.region("someone-else", backend=host) as other:
        other.allocate(1 << 20)
    assert offload.wait_for_prepared(10)  # the weights' region announced its offload
    assert len(engine.tags) == 2 and engine.tags == list(engine.tag_summary())
    for _ in range(2):
        engine.sleep(None)
        summary = vmm_core.memory_summary()
        assert all(summary[t]["asleep"] for t in engine.tags)
        assert not summary["someone-else"]["asleep"]
        assert engine.offloaded_bytes(None) == 3 << 20
        engine.wake(None)
        assert not any(s["asleep"] for s in vmm_core.memory_summary().values())
        assert ctypes.string_at(weights, 3 << 20) == expected
    tags = engine.tag_summary()
    weights_tag, kv_tag = engine.tags
    # torch_memory_saver's default gives the host copy back on resume; vLLM's keeps it
    kept = 0 if name == "tms-compat" else 3 << 20
    assert tags[weights_tag]["host_bytes"] == kept and tags[kv_tag]["host_bytes"] == 0
    assert engine.host_bytes_awake(None) == kept + offload.staging_bytes()


@pytest.mark.usefixtures("fresh_compat")
def test_tms_compat_makes_sglangs_calls_and_its_graphs_keep_what_replays_read(
        monkeypatch):
    """SGLang's calls: one global graph pool handle passed to the memory saver's
    ``cuda_graph`` with tag ``cuda_graph`` and a CPU backup; pauses kv_cache, weights,
    cuda_graph and resumes cuda_graph, weights, kv_cache.  A block a capture left alive
    (state its replays read) keeps its bytes through the step; the free ones are not
    copied."""
    import ctypes

    import torch

    import vmm_core
    from vmm_core.memory import routing, tagged

    host = vmm_core.get_backend("host")
    engine = rl_strategies.STRATEGIES["tms-compat"].engine(torch, host, "cpu")
    with engine.weights_region() as w:
        weights, expected = _random_bytes(w, 1 << 20, seed=2)
    with engine.kv_region() as kv:
        kv.allocate(1 << 20)
    pool = engine.new_pool()
    calls: list = []
    _spy(monkeypatch, engine.tms, "cuda_graph", calls)
    states = []
    for size in (16, 8):  # largest first, into the same pool
        with pool.space(size) as handle:
            def body():
                target = routing.current_target(0)  # where the capture allocates
                state = target.allocate(8)
                ctypes.c_int64.from_address(state).value = 100 + size
                target.deallocate(target.allocate(1 << 20))  # an intermediate, freed
                return state
            states.append(pool.ops.capture(pool.ops.new_graph(), body, handle))
    assert len(calls) == 2 and all(kw["pool"] is pool.handle and kw["tag"] == "cuda_graph"
                                   and kw["enable_cpu_backup"] is True
                                   and kw["stream"] is pool.ops.capture_stream
                                   for _, kw in calls)
    pause: list = []
    _spy(monkeypatch, engine.tms, "pause", pause)
    _spy(monkeypatch, engine.tms, "resume", pause)
    (graphs,) = tagged.allocators("tms:cuda_graph:cpu_backup")
    states_bytes = sum(graphs.live_allocations().values())  # the two states, not the rest
    assert states_bytes < graphs.physical_bytes
    engine.sleep(None)
    assert engine.offloaded_bytes(None) == (1 << 20) + states_bytes
    engine.wake(None)
    assert pause == [("pause", "kv_cache"), ("pause", "weights"), ("pause", "cuda_graph"),
                     ("resume", "cuda_graph"), ("resume", "weights"), ("resume", "kv_cache")]
    assert [ctypes.c_int64.from_address(s).value for s in states] == [116, 108]
    assert ctypes.string_at(weights, 1 << 20) == expected
    assert "tms:cuda_graph:cpu_backup" in engine.tags


@pytest.mark.usefixtures("fresh_compat")
def test_vllm_plugin_makes_the_worker_calls_level_1_and_wakes_weights_first(monkeypatch):
    import torch

    import vmm_core

    host = vmm_core.get_backend("host")
    engine = rl_strategies.STRATEGIES["vllm-plugin"].engine(torch, host, "cpu")
    with engine.weights_region() as w:
        w.allocate(1 << 20)
    with engine.kv_region() as kv:
        kv.allocate(1 << 20)
    calls: list = []
    _spy(monkeypatch, engine.backend_calls, "suspend", calls)
    _spy(monkeypatch, engine.backend_calls, "resume", calls)
    engine.sleep(None)
    assert engine.backend_calls.state() == "SUSPENDED"
    summary = vmm_core.memory_summary()  # level 1: weights offloaded, the KV cache not
    assert summary["vllm:weights"]["host_bytes"] == 1 << 20
    assert summary["vllm:kv_cache"]["host_bytes"] == 0
    engine.wake(None)
    assert calls == [("suspend", {"level": 1}), ("resume", ["weights"]),
                     ("resume", ["kv_cache"])]
    assert engine.backend_calls.state() == "RUNNING"


@pytest.mark.usefixtures("fresh_compat")
@pytest.mark.parametrize("name", ["vllm-graphs", "vllm-plugin-graphs"])
def test_graph_memory_sleeps_with_a_copy_under_offload_cudagraph(name):
    """``--sleep-mode-offload-cudagraph`` on the host backend, both ways: what a capture
    left alive in the graph pool leaves the device at sleep, sits on the host while
    asleep (vLLM's cumem: the whole allocation; the plugin: its live blocks) and comes
    back byte for byte at the same address; the weights and KV cache sleep as their
    rows do."""
    import ctypes
    import random

    import torch
    from host_space import framework_alloc

    import vmm_core

    host = vmm_core.get_backend("host")
    engine = rl_strategies.STRATEGIES[name].engine(torch, host, "cpu")
    with engine.weights_region() as w:
        w.allocate(1 << 20)
    with engine.kv_region() as kv:
        kv.allocate(1 << 20)
    pool = engine.new_pool()
    with pool.space(8):  # what a capture allocates and keeps (an output)
        state = framework_alloc(2 << 20)
    data = random.Random(5).randbytes(2 << 20)
    ctypes.memmove(state, data, len(data))
    model = types.SimpleNamespace(weight_tensors=lambda: [], weight_bytes=0)
    awake = engine.graph_memory()
    assert awake["device_bytes"] >= 2 << 20 and awake["host_bytes"] == 0
    engine.sleep(model)
    asleep = engine.graph_memory()
    assert asleep["device_bytes"] == 0 and asleep["host_bytes"] >= 2 << 20
    engine.wake(model)
    assert ctypes.string_at(state, len(data)) == data
    assert engine.graph_memory()["device_bytes"] == awake["device_bytes"]
    assert engine.offloaded_bytes(model) >= 2 << 20


def test_strategies_run_in_the_table_order_the_slowest_last_and_only_those_chosen(
        monkeypatch):
    import importlib.util

    names, skipped = rl._strategies()
    tms = importlib.util.find_spec("torch_memory_saver") is not None
    assert names == ["vmm", "vllm", "tms-compat", "vllm-plugin", "vllm-graphs",
                     "vllm-plugin-graphs"] + (["tms"] if tms else []) + ["recapture"] \
        and skipped == []
    assert rl._strategies(("recapture", "vllm-plugin", "vmm")) == \
        (["vmm", "vllm-plugin", "recapture"], [])
    monkeypatch.setitem(rl_strategies.STRATEGIES, "absent",
                        rl_strategies.Strategy(rl_strategies._Vllm,
                                               "a peer not installed here",
                                               needs="no_such_package_here"))
    assert rl._strategies(("absent", "vmm")) == (
        ["vmm"], ["absent: needs no_such_package_here, which is not installed here; "
                  "skipped"])
    assert "absent" not in rl._strategies()[0]  # not chosen: no note either
    with pytest.raises(ValueError, match=r"unknown strategies \['magic'\] of --scenario rl"):
        rl._strategies(("vmm", "magic"))


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
    assert out.index("measured  vmm ") < out.index("measured  vllm        FAILED: child "
                                                   "exited 1: boom")
    saved = json.loads(path.read_text())
    assert saved["partial"] and [r["strategy"] for r in saved["records"]] == calls
    assert not result["ok"] and result["summary"]["vmm"]["correct"]


def _record(strategy: str, sleep, wake, wrong=()):
    gib = 1 << 30
    record = {"strategy": strategy, "weight_bytes": gib, "kv_bytes": gib,
              "wrong_before_sleep": [], "model_description": "a llama", "device": "dev",
              "torch": "t", "pinned_limit_gib_s": [50.0, 50.0],
              "steps": _steps([2 * gib] * len(sleep), sleep, wake, [0.01] * len(sleep))}
    for step in wrong:
        record["steps"][step]["wrong_sizes"] = [[8, 0.5]]
    return record


def test_the_vllm_plugin_is_judged_against_vllms_own_allocator(capsys):
    """Round 1 (where vLLM pins fresh host memory) and rounds 2..N sleep at least 2.5x
    faster than vLLM's way, every wake within 1.1x of vLLM's (round 1 and rounds 2..N),
    with every replay correct."""
    vllm = _record("vllm", [4.9, 0.46, 0.47], [0.16] * 3)

    def judged(sleep, wake, wrong=()):
        summary = rl_report._summarize([vllm, _record("vllm-plugin", sleep, wake, wrong)], None)
        return rl_report._targets(summary)["vllm-plugin vs vllm"]

    met = judged([0.5, 0.15, 0.16], [0.17, 0.15, 0.15])
    assert met["met"] and met["target"] == 2.5 and met["wake_target"] == 1.1
    assert met["sleep_speedup_round_1"] == pytest.approx(4.9 / 0.5)
    assert met["sleep_speedup"] == pytest.approx(0.465 / 0.155)
    assert met["wake_ratio"] == pytest.approx(0.17 / 0.16)
    assert not judged([0.5, 0.23, 0.23], [0.15] * 3)["met"]  # rounds 2..N only 2x faster
    assert not judged([2.5, 0.15, 0.16], [0.15] * 3)["met"]  # round 1 only 2x faster
    assert not judged([0.5, 0.15, 0.16], [0.2, 0.15, 0.15])["met"]  # round 1 wake slower
    assert not judged([0.5, 0.15, 0.16], [0.15, 0.2, 0.2])["met"]  # later wakes slower
    assert not judged([0.5, 0.15, 0.16], [0.15] * 3, wrong=[2])["met"]
    assert rl_report._targets(rl_report._summarize([vllm], None)) == {}  # nothing to judge
    plugin = _record("vllm-plugin", [0.5, 0.15, 0.16], [0.15] * 3)
    summary = rl_report._summarize([vllm, plugin], (50.0, 50.0))
    rl_report._print([vllm, plugin], summary, vllm, (50.0, 50.0), rl_report._targets(summary))
    assert ("target vllm-plugin vs vllm (every round's sleep >= 2.5x faster, every wake <= "
            "1.1x the time): sleep 9.80x faster in round 1, 3.00x in rounds 2..N, wake at "
            "most 0.94x the time: met") in capsys.readouterr().out


def test_the_parent_runs_the_strategies_chosen_and_says_which_cannot_run(monkeypatch,
                                                                         capsys):
    calls = []

    def child(configs, on_record, **kwargs):
        records = []
        for identity, argv in configs:
            calls.append(identity["strategy"])
            records.append(_record(identity["strategy"], [0.4, 0.1], [0.1, 0.1]))
            on_record(records[-1])
        return records

    monkeypatch.setattr(rl, "run_configurations", child)
    monkeypatch.setitem(rl_strategies.STRATEGIES, "absent",
                        rl_strategies.Strategy(rl_strategies._Vllm, "not here",
                                               needs="no_such_package_here"))
    spec = BenchSpec(sizes=(1, 2), rl=RLSpec(steps=2, strategies=("vllm-plugin", "absent",
                                                                     "vllm")),
                     output=Output(quiet=True))
    result = rl.run_rl_bench(spec, types.SimpleNamespace(name="cuda"))
    assert calls == ["vllm", "vllm-plugin"]
    assert "note: --strategies absent: needs no_such_package_here" in capsys.readouterr().out
    assert set(result["targets"]) == {"vllm-plugin vs vllm"}
    schema = (Path(__file__).parents[1] / "docs" / "json-schema.md").read_text()
    for key in [*result, *result["targets"]["vllm-plugin vs vllm"], *result["summary"]["vllm"],
                *result["summary"]["vllm"]["rounds 2..N"]]:
        assert f"`{key}`" in schema, f"docs/json-schema.md does not document {key!r}"


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
    summary = rl_report._summarize([vmm, again, failed], (50.0, 50.0))
    assert summary["vmm"]["round 1"]["sleep_s"] == pytest.approx(0.4)
    assert summary["vmm"]["rounds 2..N"]["sleep_s"] == pytest.approx(0.1)
    # 4 GiB in 0.1 s = 40 GiB/s = 80% of a 50 GiB/s limit
    assert summary["vmm"]["rounds 2..N"]["sleep_pct_of_limit"] == pytest.approx(0.8)
    assert summary["vmm"]["correct"] and not summary["recapture"]["correct"]
    assert summary["recapture"]["rounds 2..N"]["recaptured_graphs"] == 100
    assert "error" in summary["tms"]
    rl_report._print([vmm, again, failed], summary, vmm, (50.0, 50.0))
    out = capsys.readouterr().out
    assert "tms         FAILED: boom" in out
    assert "(copies at 80% / 80% of the limit)" in out
    assert "recapture   every replay correct: False" in out
    pytest.importorskip("matplotlib")
    path = tmp_path / "rl.png"
    assert rl_report._plot([vmm, again, failed], str(path), "title")
    assert path.stat().st_size > 0


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["vmm", "recapture", "tms-compat", "vllm-plugin"])
def test_cuda_rl_loop_three_steps_every_replay_correct(cuda, strategy):
    """Sleep frees weights, kv and (vmm, tms-compat) graph memory, a training allocation
    takes it, wake and an in-place weight update, and every size replays correctly.

    Each strategy runs in a child process, as the benchmark runs it: in one process, a
    strategy's cuBLAS workspace may live in tagged memory that the next test's cleanup
    closes (found on the H100; docs/failures.md, library workspaces)."""
    pytest.importorskip("transformers")
    from vmm_bench.children import run_configurations

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
        if strategy == "recapture":
            assert step["recaptured_graphs"] == record["graphs"]
        else:
            assert step["recaptured_graphs"] == 0
    if strategy == "recapture":
        return
    # held while awake: the offloaded weights' live bytes, pinned, and the staging ring;
    # what a sleep copies: those, and (tms-compat) graph blocks left alive by captures
    last = record["steps"][-1]
    tags = last["tags_awake"]
    weights, discarded = {
        "vmm": ("weights", {"kv", "graph"}),
        "tms-compat": ("tms:weights:cpu_backup", {"tms:kv_cache"}),
        "vllm-plugin": ("vllm:weights", {"vllm:kv_cache"})}[strategy]
    graphs = {"tms:cuda_graph:cpu_backup"} if strategy == "tms-compat" else set()
    assert set(tags) == {weights} | discarded | graphs
    assert all(tags[t]["host_bytes"] == 0 for t in discarded)
    assert last["host_bytes_awake"] == sum(t["host_bytes"] for t in tags.values()) \
        + record["staging_bytes"]
    held = tags[weights]["host_bytes"]
    assert tags[weights]["pinned_host_bytes"] == held
    # live blocks only (512-byte blocks, ranges 64 KiB apart copied as one), never the
    # free blocks the caching allocator keeps in the region
    assert record["weight_bytes"] <= held < record["weight_bytes"] + (16 << 20)
    assert held <= record["offloaded_bytes"] <= held + sum(
        tags[t]["host_bytes"] for t in graphs)


@pytest.mark.gpu
def test_cuda_graph_memory_sleeps_both_ways_under_offload_cudagraph(cuda):
    """``--sleep-mode-offload-cudagraph``, the plugin's way and vLLM's cumem way, on the
    same graphs: every replay after wake is correct without a recapture, the graph pool
    holds nothing on the device while asleep, and the plugin's host copy of it (live
    blocks) is no larger than cumem's (every allocation whole)."""
    pytest.importorskip("transformers")
    from vmm_bench.children import run_configurations

    spec = rl.small_spec(steps=3)
    records = run_configurations(
        [({"scenario": "rl", "strategy": s}, rl._child_argv(spec, cuda.name, s))
         for s in ("vllm-graphs", "vllm-plugin-graphs")], quiet=True)
    asleep = {}
    for record in records:
        assert "error" not in record, record.get("error")
        assert record["wrong_before_sleep"] == []
        for step in record["steps"]:
            assert step["first_replay_ok"] and step["wrong_sizes"] == [], step
            assert step["recaptured_graphs"] == 0
            awake, slept = step["graph_memory_awake"], step["graph_memory_asleep"]
            assert awake["device_bytes"] > 0 and slept["device_bytes"] == 0, step
            assert slept["host_bytes"] > 0, step
            assert step["freed_bytes"] >= record["weight_bytes"] + awake["device_bytes"]
        asleep[record["strategy"]] = record["steps"][-1]["graph_memory_asleep"]["host_bytes"]
    assert asleep["vllm-plugin-graphs"] <= asleep["vllm-graphs"]


def test_a_failed_group_rank_logs_its_error_before_destroying_its_group(monkeypatch, capsys):
    """The group's shutdown waits for the rank's unfinished collectives (NCCL finalizes its
    communicators), so the error must reach the log first; the group is destroyed after,
    and a one-rank gloo group on the host is enough to see the order."""
    import torch.distributed as dist

    import vmm_core

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []

    def fail(spec, device, joined):
        assert dist.is_initialized()
        raise RuntimeError("rank failed mid-step")

    real_destroy = dist.destroy_process_group

    def destroy(*a, **k):
        seen.append(capsys.readouterr().err)
        real_destroy(*a, **k)

    monkeypatch.setattr(rl_group, "_rl_group_rank", fail)
    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    with pytest.raises(RuntimeError, match="mid-step"):
        rl_group.run_rl_group(BenchSpec(sizes=(1, 2)), vmm_core.get_backend("host"))
    assert len(seen) == 1 and "RuntimeError: rank failed mid-step" in seen[0]
    assert not dist.is_initialized()
